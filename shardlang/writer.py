"""Values to text: a :class:`~shardlang.spec.Spec` as a spec file that parses back to it.

Tensors with the same dtype, shape and layouts are declared together, their names folded into
brace groups (``h.{0..11}.mlp.c_fc.weight``, ``h.{0..11}.ln_{1,2}.weight``). Tensors come out
in the order the braces expand, so ``parse_spec(format_spec(spec))`` equals ``spec`` when the
spec's tensors are in that order already (what :func:`format_spec` of a parsed file keeps);
:func:`shardlang.spec_for` builds its specs through this text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from decimal import Decimal

from shardlang.layout import Layout, format_layout
from shardlang.mesh import format_ranks, numbered_from_zero
from shardlang.parser import parse_duration
from shardlang.spec import STATE_DEFAULT, Layouts, MeshDecl, Rule, Spec, TensorSpec, expand_braces, state_entry_key

_INT = re.compile(r"(0|[1-9][0-9]*)\Z")
Comment = Callable[[TensorSpec, int], str | None]  # a group's first tensor and its size -> a comment


def fold_names(names: Sequence[str]) -> list[str]:
    """Brace patterns that expand to exactly ``names`` (each name once), in an order whose
    expansion lists every name of the first pattern, then of the second, and so on: names that
    differ in one dot-separated part are merged into ``{a,b}`` or ``{0..11}``, repeatedly."""
    patterns: list[list[list[str]]] = [[[part] for part in name.split(".")] for name in names]
    changed = True
    while changed:
        changed = False
        for position in range(max((len(p) for p in patterns), default=0) - 1, -1, -1):
            merged: dict[tuple, list[list[str]]] = {}
            order: list[tuple] = []
            for p in patterns:
                if position >= len(p):  # too short to differ here: kept as it is
                    key: tuple = ("kept", len(order))
                else:
                    key = (len(p), position, tuple(tuple(s) for i, s in enumerate(p) if i != position))
                if key in merged:
                    merged[key][position] = merged[key][position] + p[position]
                    changed = True
                else:
                    merged[key] = [list(s) for s in p]
                    order.append(key)
            patterns = [merged[k] for k in order]
    return [".".join(_alternatives(parts) for parts in p) for p in patterns]


def _alternatives(parts: list[str]) -> str:
    if len(parts) == 1:
        return parts[0]
    if all(_INT.match(p) for p in parts):
        numbers = [int(p) for p in parts]
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return f"{{{numbers[0]}..{numbers[-1]}}}"
    return "{" + ",".join(parts) + "}"


def format_number(value: float) -> str:
    """A bandwidth as short as it reads back exactly: ``25e9``, ``3.5e11``, ``100``."""
    sign, digits, exponent = Decimal(repr(value)).normalize().as_tuple()
    assert isinstance(exponent, int) and not sign  # bandwidths are finite and positive
    mantissa = "".join(map(str, digits))
    text = mantissa + "0" * exponent if 0 <= exponent <= 2 else f"{mantissa}e{exponent}"
    plain = repr(value).removesuffix(".0")
    return min((t for t in (text, plain) if float(t) == value), key=len)


def format_duration(seconds: float) -> str:
    """A latency as short as it reads back exactly: ``20us``, ``0.5ms``, ``2e-05``."""
    candidates = [repr(seconds)]
    for unit, scale in (("ns", 1e9), ("us", 1e6), ("ms", 1e3), ("s", 1)):
        candidates.append(f"{seconds * scale:g}".replace("e+", "e").replace("e0", "e") + unit)
    good = [t for t in candidates if "-" not in t.split("e")[0] and parse_duration(t) == seconds]
    return min(good, key=len)


def format_mesh_decl(decl: MeshDecl) -> str:
    """``mesh world = [dp=4, tp=8]  bandwidth [25e9, 3e11]  latency [20us, 3us]``."""
    mesh = decl.mesh
    if mesh.axis_names is None:
        axes = ", ".join(map(str, mesh.shape))
    else:
        axes = ", ".join(f"{n}={s}" for n, s in zip(mesh.axis_names, mesh.shape, strict=True))
    text = f"mesh {mesh.name} = [{axes}]"
    if not numbered_from_zero(mesh.ranks):
        text += " ranks " + format_ranks(mesh.ranks)
    hints = decl.hints
    if hints.bandwidth is not None:
        text += "  bandwidth " + _per_axis([format_number(b) for b in hints.bandwidth])
    if hints.latency is not None:
        text += "  latency " + _per_axis([format_duration(t) for t in hints.latency])
    return text


def _per_axis(values: list[str]) -> str:
    return values[0] if len(set(values)) == 1 else "[" + ", ".join(values) + "]"


def format_entries(layouts: Layouts, indent: str = "  ", ellipses: Sequence[tuple[str, int]] = ()) -> list[str]:
    """``param = ...``, then ``grad`` and ``state`` where they differ from their default (the
    param layout), then every state kept in a layout of its own; a rule's layouts with their
    ``...`` where ``ellipses`` (``Rule.ellipses``) puts one."""
    at = dict(ellipses)

    def entry(key: str, layout: Layout) -> tuple[Layout, int | None]:
        return layout, at.get(key)

    def text(key: str, layout: Layout) -> str:
        return format_layout(layout, ellipsis=at.get(key))

    param = entry("param", layouts.param)
    lines = [f"param = {text('param', layouts.param)}"]
    if entry("grad", layouts.grad) != param:
        lines.append(f"grad  = {text('grad', layouts.grad)}")
    default = layouts.state()
    if entry("state", default) != param:
        lines.append(f"state = {text('state', default)}")
    for name, layout in layouts.states:
        if name != STATE_DEFAULT:
            lines.append(f"{state_entry_key(name)} = {text(state_entry_key(name), layout)}")
    return [indent + line for line in lines]


def format_spec(spec: Spec, comment: Comment | None = None, header: Sequence[str] = ()) -> str:
    """The text of ``spec``: ``header`` lines as comments, the meshes, the tensors (grouped,
    each group after ``comment(first tensor, group size)`` when that gives one), the rules."""
    out = [f"# {line}".rstrip() for line in header]
    if header:
        out.append("")
    out += [format_mesh_decl(decl) for decl in spec.meshes]
    groups: dict[tuple, list[TensorSpec]] = {}
    for t in spec.tensors:
        groups.setdefault((t.dtype, t.shape, t.layouts), []).append(t)
    for (dtype, shape, layouts), members in groups.items():
        for pattern in fold_names([t.name for t in members]):
            out.append("")
            note = comment(members[0], len(expand_braces(pattern))) if comment is not None else None
            if note:
                out.append(f"# {note}")
            out.append(f"tensor {pattern} : {dtype}[{', '.join(map(str, shape))}] {{")
            out += format_entries(layouts)
            out.append("}")
    out += [line for rule in spec.rules for line in ("", *_rule_lines(rule))]
    return "\n".join(out) + "\n"


def _rule_lines(rule: Rule) -> list[str]:
    return [f'rule "{rule.pattern}" {{', *format_entries(rule.layouts, ellipses=rule.ellipses), "}"]
