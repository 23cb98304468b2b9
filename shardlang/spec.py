"""Spec files as values: the meshes a model uses and every tensor's layouts."""

from __future__ import annotations

import fnmatch
import functools
import itertools
import math
import re

import attrs

from shardlang.errors import ParseError, SourcePosition, SpecError
from shardlang.layout import Layout
from shardlang.mesh import Mesh

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(-?[0-9]+)\.\.(-?[0-9]+)\Z")
_MAX_RANGE_DIGITS = 18


def expand_braces(text: str, limit: int | None = None) -> list[str]:
    """``h.{0..2}.{q,k}`` -> ``h.0.q, h.0.k, h.1.q, ...`` (ranges inclusive, in order).

    Raises :class:`ParseError` (without a position; the caller adds it) on an empty or
    malformed brace, or when the text names more than ``limit`` names (counted before any is
    built, so ``{0..99999999999}`` fails at once).
    """
    parts = _BRACE.split(text)
    if "{" in parts[0] or "}" in parts[0] or any("{" in p or "}" in p for p in parts[2::2]):
        raise ParseError(f"unbalanced brace in '{text}'")
    choices: list[list[str] | tuple[int, int]] = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            choices.append([part])
            continue
        m = _RANGE.match(part)
        if m:
            if max(len(m.group(1)), len(m.group(2))) > _MAX_RANGE_DIGITS:
                raise ParseError(f"brace range {{{part}}} has an end longer than {_MAX_RANGE_DIGITS} digits")
            lo, hi = int(m.group(1)), int(m.group(2))
            if hi < lo:
                raise ParseError(f"brace range {{{part}}} in '{text}' is empty: {hi} < {lo}")
            choices.append((lo, hi))
        elif part and all(part.split(",")):
            choices.append(part.split(","))
        else:
            raise ParseError(
                f"brace {{{part}}} in '{text}' is neither a range like {{0..11}} nor alternatives like {{q,k,v}}"
            )
    count = math.prod(c[1] - c[0] + 1 if isinstance(c, tuple) else len(c) for c in choices)
    if limit is not None and count > limit:
        raise ParseError(f"'{text}' expands to {count} names, more than {limit}")
    expanded = [[str(k) for k in range(c[0], c[1] + 1)] if isinstance(c, tuple) else c for c in choices]
    return ["".join(combo) for combo in itertools.product(*expanded)]


@attrs.frozen
class CostHints:
    """Per-axis bandwidth (bytes/s) and latency (seconds per round) declared for a mesh."""

    bandwidth: tuple[float, ...] | None = None
    latency: tuple[float, ...] | None = None


@attrs.frozen
class MeshDecl:
    mesh: Mesh
    hints: CostHints = CostHints()
    position: SourcePosition | None = attrs.field(default=None, eq=False)


STATE_DEFAULT = ""


@attrs.frozen
class Layouts:
    """The layouts of one tensor: param, grad, and optimizer states.

    ``states`` maps a state name (``exp_avg_sq``) to its layout; the key ``""`` is the
    default for every state not named.
    """

    param: Layout
    grad: Layout
    states: tuple[tuple[str, Layout], ...]

    def state(self, name: str = STATE_DEFAULT) -> Layout:
        table = dict(self.states)
        return table.get(name, table[STATE_DEFAULT])


@attrs.frozen
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(x) for x in s))
    layouts: Layouts
    position: SourcePosition | None = attrs.field(default=None, eq=False)

    @property
    def param(self) -> Layout:
        return self.layouts.param

    @property
    def grad(self) -> Layout:
        return self.layouts.grad

    def state(self, name: str = STATE_DEFAULT) -> Layout:
        return self.layouts.state(name)


@attrs.frozen
class Rule:
    """Layouts for every tensor whose name matches ``pattern`` (a glob: ``*``, ``?``,
    ``[abc]``, and braces as in tensor names)."""

    pattern: str
    layouts: Layouts
    position: SourcePosition | None = attrs.field(default=None, eq=False)

    def matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in _globs(self.pattern))


@functools.cache
def _globs(pattern: str) -> tuple[str, ...]:
    """A rule pattern's braces expanded once (rules are matched against every tensor name)."""
    return tuple(expand_braces(pattern))


@attrs.frozen
class Spec:
    meshes: tuple[MeshDecl, ...]
    tensors: tuple[TensorSpec, ...]
    rules: tuple[Rule, ...]
    filename: str | None = None

    def mesh(self, name: str) -> Mesh:
        for decl in self.meshes:
            if decl.mesh.name == name:
                return decl.mesh
        raise SpecError(f"no mesh named '{name}' in {self.filename or 'the spec'}")

    def hints(self, mesh: Mesh) -> CostHints:
        """The cost hints declared for ``mesh`` (empty for an inline mesh)."""
        for decl in self.meshes:
            if decl.mesh == mesh:
                return decl.hints
        return CostHints()

    def tensor(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise SpecError(f"no tensor named '{name}' in {self.filename or 'the spec'}")

    def resolve(self, name: str, shape: tuple[int, ...], dtype: str) -> TensorSpec:
        """The spec of a tensor met at run time: its own declaration, else the first rule
        (in file order) whose pattern matches its name."""
        shape = tuple(shape)
        for t in self.tensors:
            if t.name == name:
                if t.shape != shape:
                    raise SpecError(
                        f"tensor '{name}' is declared with shape {list(t.shape)} but has shape {list(shape)}",
                        t.position,
                    )
                return t
        for rule in self.rules:
            if rule.matches(name):
                for role, layout in _named_layouts(rule.layouts):
                    if layout.ndim != len(shape):
                        raise SpecError(
                            f"rule \"{rule.pattern}\" gives tensor '{name}' of shape {list(shape)} "
                            f"a {layout.ndim}-d {role} layout '{layout}'",
                            rule.position,
                        )
                return TensorSpec(name=name, dtype=dtype, shape=shape, layouts=rule.layouts, position=rule.position)
        raise SpecError(f"tensor '{name}' is not declared and no rule matches it in {self.filename or 'the spec'}")


def _named_layouts(layouts: Layouts) -> list[tuple[str, Layout]]:
    named = [("param", layouts.param), ("grad", layouts.grad)]
    named += [("state" if not k else f"state.{k}", v) for k, v in layouts.states]
    return named
