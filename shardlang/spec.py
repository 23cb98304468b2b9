"""Spec files as values: the meshes a model uses and every tensor's layouts."""

from __future__ import annotations

import fnmatch
import functools
import itertools
import math
import re

import attrs

from shardlang.errors import ParseError, SourcePosition, SpecError
from shardlang.layout import Layout, format_layout
from shardlang.mesh import Mesh

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(-?[0-9]+)\.\.(-?[0-9]+)\Z")
_MAX_RANGE_DIGITS = 18
_FNMATCH_FORM = re.compile(r"\(\?s:(.*)\)\\[Zz]", re.DOTALL)  # fnmatch.translate's wrapper around a glob
_FNMATCH_KNOWN = all(_FNMATCH_FORM.fullmatch(fnmatch.translate(g)) for g in ("", "a*b", "*a*b", "[!x]?"))


Choice = list[str] | tuple[int, int]  # alternatives, or an inclusive range of integers


def brace_choices(text: str, limit: int | None = None) -> list[Choice]:
    """``text`` cut at its braces: ``[literal], choice, [literal], choice, ..., [literal]``,
    each choice a list of alternatives or a range ``(lo, hi)``. Raises :class:`ParseError`
    (without a position; the caller adds it) on an empty or malformed brace, or when the text
    names more than ``limit`` names (counted, never built, so ``{0..99999999999}`` fails at once).
    """
    parts = _BRACE.split(text)
    if "{" in parts[0] or "}" in parts[0] or any("{" in p or "}" in p for p in parts[2::2]):
        raise ParseError(f"unbalanced brace in '{text}'")
    choices: list[Choice] = []
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
    return choices


def expand_braces(text: str, limit: int | None = None) -> list[str]:
    """``h.{0..2}.{q,k}`` -> ``h.0.q, h.0.k, h.1.q, ...`` (ranges inclusive, in order).

    Raises :class:`ParseError` as :func:`brace_choices` does.
    """
    choices = brace_choices(text, limit)
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
    # Where a layout's ``...`` stands (docs/language.md, "Rules"): per entry key (``param``,
    # ``grad``, ``state``, ``state.NAME``), how many of its named dims come before it. A layout
    # without one, or with one after its last dim, is filled at the end.
    ellipses: tuple[tuple[str, int], ...] = attrs.field(default=(), converter=lambda e: tuple(sorted(e)))
    position: SourcePosition | None = attrs.field(default=None, eq=False)

    def matches(self, name: str) -> bool:
        return pattern_regex(self.pattern).match(name) is not None

    def layouts_for(self, ndim: int) -> Layouts:
        """The rule's layouts for a tensor of ``ndim`` dims: the dims a layout does not name
        are replicated, where its ``...`` stands or else after its last dim (as in JAX's
        ``PartitionSpec``)."""
        at = dict(self.ellipses)

        def fill(key: str, layout: Layout) -> Layout:
            extra = ndim - layout.ndim
            if extra == 0:
                return layout
            i = at.get(key, layout.ndim)
            dims = layout.dims[:i] + ((),) * extra + layout.dims[i:]
            return Layout(dims=dims, mesh=layout.mesh, partial=layout.partial)

        layouts = self.layouts
        states = tuple((k, fill(state_entry_key(k), v)) for k, v in layouts.states)
        return Layouts(param=fill("param", layouts.param), grad=fill("grad", layouts.grad), states=states)


@functools.cache
def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A rule pattern compiled once into one regular expression that matches exactly the
    names that one of its brace expansions matches as an ``fnmatch`` glob: ``*``, ``?`` and
    ``[...]`` as fnmatch reads them, alternatives as an alternation, and a range as the
    numbers in it (never expanded, so ``x{0..99999}`` costs what ``x*`` does)."""
    choices = brace_choices(pattern)
    pieces = [p for c in choices if isinstance(c, list) for p in c]
    crossing = len(choices) > 1 and "]" in pattern and any(_unclosed_bracket(p) for p in pieces)
    if _FNMATCH_KNOWN and not crossing:
        body = "".join(_globs(c) if isinstance(c, list) else _number_range(*c) for c in choices)
        return re.compile(body + r"\Z", re.DOTALL)
    # A [...] set that a brace may cut through: expand, and match each expansion as fnmatch does.
    return re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in expand_braces(pattern)))


def _globs(alternatives: list[str]) -> str:
    """The regex of a list of globs (one literal part, or a brace's alternatives), each read
    by fnmatch (its translation without the wrapper :data:`_FNMATCH_FORM` takes off)."""
    out = [_unwrapped(fnmatch.translate(glob)) for glob in alternatives]
    return out[0] if len(out) == 1 else "(?:" + "|".join(out) + ")"


def _unwrapped(translated: str) -> str:
    m = _FNMATCH_FORM.fullmatch(translated)
    assert m is not None, translated  # _FNMATCH_KNOWN holds
    return m.group(1)


def _unclosed_bracket(glob: str) -> bool:
    """Whether ``glob`` has a ``[`` that no ``]`` in it closes (fnmatch would then look for one
    in the text that follows it in an expansion)."""
    i, n = 0, len(glob)
    while i < n:
        if glob[i] == "[":
            j = i + 1
            if j < n and glob[j] == "!":
                j += 1
            if j < n and glob[j] == "]":
                j += 1
            j = glob.find("]", j)
            if j < 0:
                return True
            i = j
        i += 1
    return False


def _number_range(lo: int, hi: int) -> str:
    """A regex matching ``str(k)`` for exactly the integers ``lo <= k <= hi``."""
    out = []
    if lo < 0:
        out += ["-" + r for r in _natural_range(max(1, -hi), -lo)]
    if hi >= 0:
        out += _natural_range(max(lo, 0), hi)
    return "(?:" + "|".join(out) + ")"


def _natural_range(lo: int, hi: int) -> list[str]:
    """Regexes for the decimal numbers (no leading zeros) from ``lo`` to ``hi`` (both >= 0)."""
    out = []
    for digits in range(len(str(lo)), len(str(hi)) + 1):
        first = 0 if digits == 1 else 10 ** (digits - 1)
        a, b = max(lo, first), min(hi, 10**digits - 1)
        if a <= b:
            out += _same_length(str(a), str(b))
    return out


def _same_length(lo: str, hi: str) -> list[str]:
    """Regexes for the digit strings of ``len(lo)`` from ``lo`` to ``hi`` (as numbers)."""
    if not lo:
        return [""]
    if lo[0] == hi[0]:
        return [lo[0] + rest for rest in _same_length(lo[1:], hi[1:])]
    n = len(lo) - 1
    if lo[1:] == "0" * n and hi[1:] == "9" * n:
        return [f"[{lo[0]}-{hi[0]}]" + (f"[0-9]{{{n}}}" if n else "")]
    out = [lo[0] + rest for rest in _same_length(lo[1:], "9" * n)]
    if int(hi[0]) - int(lo[0]) > 1:
        out.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}]" + (f"[0-9]{{{n}}}" if n else ""))
    out += [hi[0] + rest for rest in _same_length("0" * n, hi[1:])]
    return out


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
                at = dict(rule.ellipses)
                for role, layout in _named_layouts(rule.layouts):
                    if layout.ndim > len(shape):
                        text = format_layout(layout, ellipsis=at.get(role))
                        raise SpecError(
                            f"rule \"{rule.pattern}\" gives tensor '{name}' of shape {list(shape)} "
                            f"a {layout.ndim}-d {role} layout '{text}': a rule's layout may name fewer dims "
                            "than the tensor has (the rest are replicated), never more",
                            rule.position,
                        )
                layouts = rule.layouts_for(len(shape))
                return TensorSpec(name=name, dtype=dtype, shape=shape, layouts=layouts, position=rule.position)
        raise SpecError(f"tensor '{name}' is not declared and no rule matches it in {self.filename or 'the spec'}")


def state_entry_key(name: str) -> str:
    """The entry key of a state layout: ``state`` for the default, else ``state.NAME``."""
    return "state" if name == STATE_DEFAULT else f"state.{name}"


def _named_layouts(layouts: Layouts) -> list[tuple[str, Layout]]:
    named = [("param", layouts.param), ("grad", layouts.grad)]
    named += [(state_entry_key(k), v) for k, v in layouts.states]
    return named
