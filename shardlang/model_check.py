r"""A spec against the model it is for, before anything trains.

:func:`check_model` takes a :class:`~shardlang.spec.Spec` and the model's parameters as
``(name, shape, dtype)`` entries (or ``model.named_parameters()``) and returns every finding:

============================  ========  ==========================================================
finding (``Finding.kind``)    severity  what it says
============================  ========  ==========================================================
``prefix``                    error     the parameters' names carry a wrapper's prefix the spec's
                                        names lack (so they get no layouts, or a catch-all rule's
                                        instead of the declared ones), or the reverse: ``module.``
                                        (DDP), ``_orig_mod.`` (torch.compile), ``_fsdp_wrapped_module.``
                                        (FSDP1), ``_checkpoint_wrapped_module.`` (checkpointing)
``missing``                   error     a parameter that no declaration and no rule gives layouts
                                        (with "did you mean" a declared name, by :mod:`difflib`)
``shape``                     error     a declared tensor whose shape is not its parameter's, or a
                                        rule whose layouts name more dims than the parameter has
``mesh``                      error     a mesh holding ranks the job does not have (``world_size``)
``dtype``                     warning   a declared dtype that is not the parameter's (a plan of the
                                        spec prices the declared one; the runtime moves and prices
                                        the real one, as :func:`with_model_dtypes` does)
``unused``                    warning   a declaration or a rule that matches no parameter (a
                                        misspelled declaration with "did you mean" the parameter)
``idle_ranks``                warning   ranks of the job that no mesh of the spec holds
============================  ========  ==========================================================

Errors are what cannot train (the optimizers run this check when built and refuse them);
warnings are what trains but is probably not meant. The language layer's own: no torch, no
planner. ``shardlang check FILE --model MODULE:FACTORY [--world N]`` runs it. Example::

    >>> from shardlang import parse_spec
    >>> spec = parse_spec("mesh world = [dp=4]\ntensor wte.weight : f32[100, 8] { param = S(dp),R over world }")
    >>> check = check_model(spec, [("module.wte.weight", (100, 8), "bf16")], world_size=2)
    >>> [(f.severity, f.kind) for f in check.findings]
    [('error', 'prefix'), ('error', 'mesh'), ('warning', 'dtype')]
    >>> check.raise_errors()
    Traceback (most recent call last):
    shardlang.model_check.ModelMismatchError: the spec does not fit the model (2 errors, 1 warning)
      - the names carry the prefix 'module.' (DDP or DataParallel): 1 parameter of the model, ...
      - <text>:1:1: mesh 'world' (mesh[dp=4]) holds 4 ranks (up to rank 3) but the job has 2: ...
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from shardlang.errors import ShardlangError, SourcePosition, SpecError
from shardlang.generate import named_entries
from shardlang.mesh import Mesh
from shardlang.spec import Rule, Spec, TensorSpec

ERROR = "error"
WARNING = "warning"
# Wrappers that put a segment into every parameter's name: the segment, who adds it, and
# whether it stands anywhere in a name (FSDP1 and checkpointing wrap inner modules) or leads it.
WRAPPERS: tuple[tuple[str, str, bool], ...] = (
    ("_fsdp_wrapped_module.", "FSDP1, FullyShardedDataParallel", True),
    ("_checkpoint_wrapped_module.", "activation checkpointing, checkpoint_wrapper", True),
    ("_orig_mod.", "torch.compile", True),
    ("module.", "DDP or DataParallel", False),
)
_CLOSE = 0.8  # difflib's ratio for "did you mean"


@attrs.frozen
class Finding:
    """One thing the spec and the model disagree on. ``parameters``: the model's names it is
    about; ``position``: where in the spec, when it is about a declaration or a rule."""

    kind: str
    severity: str
    message: str
    parameters: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    position: SourcePosition | None = attrs.field(default=None, eq=False)

    def __str__(self) -> str:
        if self.position is None:
            return f"{self.severity}: {self.message}"
        return f"{self.position.prefix()}: {self.severity}: {self.message}\n{self.position.caret()}"


@attrs.frozen
class ModelCheck:
    """Every finding of :func:`check_model`, errors first (each in the order met)."""

    findings: tuple[Finding, ...] = attrs.field(converter=tuple)
    parameters: int
    world_size: int | None = None

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == ERROR)

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == WARNING)

    @property
    def ok(self) -> bool:
        """No errors (warnings allowed)."""
        return not self.errors

    def raise_errors(self) -> None:
        """Raise :class:`ModelMismatchError` when there is an error."""
        if self.errors:
            raise ModelMismatchError(self)

    def summary(self) -> str:
        e, w = len(self.errors), len(self.warnings)
        return f"{e} error{'s' * (e != 1)}, {w} warning{'s' * (w != 1)}"


class ModelMismatchError(SpecError):
    """A spec that does not fit its model: every error of the check, one per line."""

    def __init__(self, check: ModelCheck) -> None:
        # Each error where the spec has it (file:line:col), as a rank's optimizer raises it.
        lines = [f"{f.position.prefix()}: {f.message}" if f.position else f.message for f in check.errors]
        head = f"the spec does not fit the model ({check.summary()})"
        super().__init__(head + "".join(f"\n  - {line}" for line in lines))
        self.check = check

    def __reduce__(self) -> tuple[type[ModelMismatchError], tuple[ModelCheck]]:
        return type(self), (self.check,)  # crosses process boundaries (a rank's error) whole

    def at(self, position: SourcePosition | None) -> ShardlangError:
        return self


def check_model(
    spec: Spec, parameters: Iterable[Any], *, world_size: int | None = None, rank: int | None = None
) -> ModelCheck:
    """Check ``spec`` against a model's ``parameters``: ``(name, shape, dtype)`` entries (the
    dtype as the language names it, ``"bf16"``, or as torch does, ``"torch.bfloat16"`` or a
    torch dtype) or ``(name, tensor)`` pairs such as ``model.named_parameters()``. With
    ``world_size``, the meshes are checked against it too. With ``rank``, the parameters are
    that rank's, as an optimizer is given them: a declared tensor's may have the shape of the
    rank's piece under its param layout instead of the whole shape (a DTensor has the whole).
    Pure: reads nothing, raises only for entries that are not parameters (:class:`SpecError`);
    see the module's table."""
    entries = named_entries(parameters)
    for value, what in ((world_size, "world_size"), (rank, "rank")):
        low = 1 if what == "world_size" else 0
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise SpecError(f"{what} must be {'a positive' if low else 'a non-negative'} integer, not {value!r}")
    return _Checker(spec, entries, rank).run(world_size)


def with_model_dtypes(spec: Spec, parameters: Iterable[Any]) -> Spec:
    """``spec`` with every declared tensor in the dtype of its parameter (by name, else by the
    name without a wrapper's prefix): what the optimizers move and price, where a ``dtype``
    finding of :func:`check_model` says the declaration differs. Tensors no parameter has keep
    their declared dtype."""
    entries = named_entries(parameters)
    dtypes = {bare(name)[0]: dtype for name, _, dtype in entries} | {name: dtype for name, _, dtype in entries}
    tensors = tuple(attrs.evolve(t, dtype=dtypes.get(t.name, t.dtype)) for t in spec.tensors)
    return attrs.evolve(spec, tensors=tensors)


@attrs.define
class _Checker:
    spec: Spec
    entries: list[tuple[str, tuple[int, ...], str]]
    rank: int | None = None
    findings: list[Finding] = attrs.field(factory=list)
    used_tensors: set[str] = attrs.field(factory=set)
    used_rules: set[int] = attrs.field(factory=set)

    def run(self, world_size: int | None) -> ModelCheck:
        declared = {t.name: t for t in self.spec.tensors}
        missing: list[tuple[str, tuple[int, ...], str]] = []
        bypassed: list[tuple[str, str]] = []  # (parameter, its bare name's declaration) a rule took instead
        for name, shape, dtype in self.entries:
            tensor = declared.get(name)
            if tensor is not None:
                self.used_tensors.add(name)
                self.declared(tensor, shape, dtype)
                continue
            rule = next((i for i, r in enumerate(self.spec.rules) if r.matches(name)), None)
            if rule is not None:
                self.used_rules.add(rule)
                self.ruled(self.spec.rules[rule], name, shape, dtype)
                plain = bare(name)[0]
                if plain != name and plain in declared:
                    bypassed.append((name, plain))
                continue
            missing.append((name, shape, dtype))
        missing = self.prefixed(missing, declared)
        if bypassed:
            self.bypassed(bypassed)
        self.unmatched(missing, declared)
        for i, rule in enumerate(self.spec.rules):
            if i not in self.used_rules:
                self.add(
                    "unused", WARNING, f'rule "{rule.pattern}" matches no parameter of the model', (), rule.position
                )
        if world_size is not None:
            self.meshes(world_size)
        order = {ERROR: 0, WARNING: 1}
        findings = sorted(self.findings, key=lambda f: order[f.severity])  # stable: in the order met
        return ModelCheck(findings, len(self.entries), world_size)

    def add(
        self, kind: str, severity: str, message: str, names: Sequence[str] = (), at: SourcePosition | None = None
    ) -> None:
        self.findings.append(Finding(kind, severity, message, tuple(names), at))

    # --- parameters the spec gives layouts -------------------------------------------------
    def declared(self, tensor: TensorSpec, shape: tuple[int, ...], dtype: str) -> None:
        name = tensor.name
        if tensor.shape != shape and shape != self.piece(tensor):
            self.add(
                "shape",
                ERROR,
                f"tensor '{name}' is declared with shape {list(tensor.shape)} but the model's parameter has shape "
                f"{list(shape)}: declare it {dtype}{list(shape)}",
                [name],
                tensor.position,
            )
        if tensor.dtype != dtype:
            self.add(
                "dtype",
                WARNING,
                f"tensor '{name}' is declared {tensor.dtype} but the model's parameter is {dtype}: plans and "
                f"memory are priced for {tensor.dtype} while the runtime moves {dtype}; declare it {dtype}",
                [name],
                tensor.position,
            )

    def piece(self, tensor: TensorSpec) -> tuple[int, ...] | None:
        """The shape of the rank's piece of ``tensor`` under its param layout (``None`` without
        a rank, or where the rank is not in the layout's mesh)."""
        if self.rank is None or self.rank not in tensor.param.mesh.ranks:
            return None
        return tensor.param.rank_piece(tensor.shape, self.rank).shape

    def ruled(self, rule: Rule, name: str, shape: tuple[int, ...], dtype: str) -> None:
        try:
            self.spec.resolve(name, shape, dtype)
        except SpecError as e:  # a layout naming more dims than the parameter has
            self.add("shape", ERROR, e.message, [name], rule.position)

    # --- names that do not meet ---------------------------------------------------------------
    def prefixed(self, missing: list[tuple[str, tuple[int, ...], str]], declared: dict[str, TensorSpec]) -> list:
        """The missing parameters a wrapper's prefix explains are one finding per wrapper
        (both ways: the model's names carry it, or the spec's); the others are returned."""
        unused = {bare(n)[0]: n for n in declared if n not in self.used_tensors}
        rest, by_wrapper = [], {}
        for name, shape, dtype in missing:
            plain, wrappers = bare(name)
            rule = next((i for i, r in enumerate(self.spec.rules) if r.matches(plain)), None) if wrappers else None
            if wrappers and (plain in declared or rule is not None):
                by_wrapper.setdefault((wrappers, False), []).append((name, plain))
                if plain in declared:
                    self.used_tensors.add(plain)
                    self.declared(declared[plain], shape, dtype)
                elif rule is not None:
                    self.used_rules.add(rule)
            elif plain in unused and unused[plain] != name:
                by_wrapper.setdefault((bare(unused[plain])[1], True), []).append((name, unused[plain]))
                self.used_tensors.add(unused[plain])
            else:
                rest.append((name, shape, dtype))
        for (wrappers, in_spec), pairs in by_wrapper.items():
            count = f"{len(pairs)} parameter{'s' * (len(pairs) != 1)}"
            model_name, spec_name = pairs[0]
            if in_spec:
                message = (
                    f"the spec's names carry the prefix {_segments(wrappers)} and the model's do not ({count}): "
                    f"the spec declares '{spec_name}' for the parameter '{model_name}'; write the spec for the "
                    "model as it is given to the optimizer"
                )
            else:
                message = (
                    f"the names carry the prefix {_segments(wrappers)}: {count} of the model, e.g. "
                    f"'{model_name}' is '{spec_name}' in the spec; check the model before it is wrapped "
                    "(model.module, or the module given to the wrapper), or write the prefix in the spec"
                )
            self.add("prefix", ERROR, message, [m for m, _ in pairs])
        return rest

    def bypassed(self, pairs: list[tuple[str, str]]) -> None:
        """Parameters a rule matched whose names without a wrapper's prefix are declared: the
        declarations would go unused, the rule's layouts applying instead (an error: what the
        spec declares for them is not what would train)."""
        wrappers = tuple(sorted({w for name, _ in pairs for w in bare(name)[1]}))
        model_name, spec_name = pairs[0]
        count = f"{len(pairs)} parameter{'s' * (len(pairs) != 1)}"
        self.add(
            "prefix",
            ERROR,
            f"the names carry the prefix {_segments(wrappers)}: {count} of the model, e.g. '{model_name}', would "
            f"take a rule's layouts instead of those the spec declares for the name without it ('{spec_name}'); "
            "check the model before it is wrapped (model.module, or the module given to the wrapper), or write "
            "the prefix in the spec",
            [m for m, _ in pairs],
        )
        self.used_tensors.update(spec for _, spec in pairs)

    def unmatched(self, missing: list[tuple[str, tuple[int, ...], str]], declared: dict[str, TensorSpec]) -> None:
        """Missing parameters, declarations no parameter uses, and misspellings between them
        (compared without the wrappers' segments)."""
        unused = {bare(n)[0]: n for n in declared if n not in self.used_tensors}
        names = {bare(name)[0]: name for name, _, _ in self.entries}
        for name, shape, dtype in missing:
            plain, wrappers = bare(name)
            close = difflib.get_close_matches(plain, list(unused), n=1, cutoff=_CLOSE)
            if close:
                tensor = declared[unused.pop(close[0])]
                also = f"; the parameter's name also carries the prefix {_segments(wrappers)}" if wrappers else ""
                self.add(
                    "missing",
                    ERROR,
                    f"parameter '{name}' {dtype}{list(shape)} has no layouts: did you mean '{tensor.name}'? The spec "
                    f"declares that name and no parameter has it{also}",
                    [name],
                    tensor.position,
                )
                continue
            self.add(
                "missing",
                ERROR,
                f"parameter '{name}' {dtype}{list(shape)} has no layouts: no tensor of the spec is called so and "
                "no rule matches it; declare it, or add a rule",
                [name],
            )
        for plain, tensor_name in unused.items():
            close = difflib.get_close_matches(plain, list(names), n=1, cutoff=_CLOSE)
            hint = f" (did you mean '{names[close[0]]}'?)" if close else ""
            self.add(
                "unused",
                WARNING,
                f"tensor '{tensor_name}' is declared but the model has no parameter of that name{hint}",
                [],
                declared[tensor_name].position,
            )

    # --- meshes and the job ------------------------------------------------------------------
    def meshes(self, world_size: int) -> None:
        held: set[int] = set()
        for mesh, position in self.used_meshes():
            ranks = list(mesh.ranks)
            held.update(ranks)
            beyond = [r for r in ranks if r >= world_size]
            if beyond:
                self.add(
                    "mesh",
                    ERROR,
                    f"{_mesh(mesh)} holds {len(ranks)} ranks (up to rank {max(ranks)}) but the job has "
                    f"{world_size}: run it on {max(ranks) + 1} ranks or more, or shrink the mesh",
                    [],
                    position,
                )
        idle = [r for r in range(world_size) if r not in held]
        if held and idle:
            self.add(
                "idle_ranks",
                WARNING,
                f"{len(idle)} of the job's {world_size} ranks ({_ranks(idle)}) are in no mesh of the spec: "
                "they hold no piece of any parameter",
            )

    def used_meshes(self) -> list[tuple[Mesh, SourcePosition | None]]:
        """Every mesh a declaration or rule names (once each), with where it is first met."""
        seen: dict[Mesh, SourcePosition | None] = {d.mesh: d.position for d in self.spec.meshes}
        used: dict[Mesh, SourcePosition | None] = {}
        items: list[Any] = [*self.spec.tensors, *self.spec.rules]
        for item in items:
            layouts = item.layouts
            for layout in (layouts.param, layouts.grad, *(v for _, v in layouts.states)):
                used.setdefault(layout.mesh, seen.get(layout.mesh, item.position))
        return list(used.items())


def bare(name: str) -> tuple[str, tuple[str, ...]]:
    """``name`` without the wrappers' segments, and which were there (in :data:`WRAPPERS`' order)."""
    found = []
    for segment, _, anywhere in WRAPPERS:
        if anywhere:
            parts = name.split(".")
            kept = [p for p in parts if p + "." != segment]
            if len(kept) != len(parts):
                found.append(segment)
                name = ".".join(kept)
        elif name.startswith(segment):
            found.append(segment)
            while name.startswith(segment):
                name = name[len(segment) :]
    return name, tuple(found)


def _mesh(mesh: Mesh) -> str:
    return f"mesh '{mesh.name}' ({mesh.describe()})" if mesh.name else f"the mesh {mesh.describe()}"


def _segments(wrappers: tuple[str, ...]) -> str:
    return ", ".join(f"'{w}' ({who})" for w, who, _ in WRAPPERS if w in wrappers)


def _ranks(ranks: list[int]) -> str:
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}..{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
