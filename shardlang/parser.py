"""Text to values: layouts and spec files.

Lark parses (grammar in ``grammar.lark``); this module turns its trees into :mod:`attrs`
values and every failure into a :class:`~shardlang.errors.ShardlangError` that points at the
offending text. Nothing from lark escapes.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path

import attrs
from lark import Token, Tree

from shardlang.dtypes import itemsize
from shardlang.errors import LayoutError, LineIndex, ParseError, ShardlangError, SourcePosition, SpecError
from shardlang.layout import REDUCE_OPS, Layout, axis_used_twice, check_reduce_op
from shardlang.mesh import Mesh, RowMajorRanks, StridedRanks, check_identifier
from shardlang.spec import (
    STATE_DEFAULT,
    CostHints,
    Layouts,
    MeshDecl,
    Rule,
    Spec,
    TensorSpec,
    brace_choices,
    expand_braces,
)
from shardlang.syntax import grammar, parse_tree

# Guards against text that is valid but would exhaust memory (a mesh of 10^12 ranks).
MAX_MESH_SIZE = 1 << 20
MAX_EXPANDED_NAMES = 100_000  # per declaration
MAX_TENSORS = 1_000_000  # per file
MAX_INT = 2**63 - 1
_TENSOR_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
MAX_SOURCE_BYTES = 16 << 20
"""The largest spec file :func:`load_spec` reads: 16 MiB (the bundled Llama 7B example,
226 tensors, has 2 KiB). A larger file is refused with a :class:`SpecError` naming it, unread."""
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)  # a FIFO opens at once

_TIME_UNITS = {"s": Decimal(1), "ms": Decimal("1e-3"), "us": Decimal("1e-6"), "ns": Decimal("1e-9")}


class _Reader:
    """Walks lark trees of one text, building values and placing every error."""

    def __init__(self, lines: LineIndex, filename: str | None, meshes: Mapping[str, Mesh]) -> None:
        self.lines = lines
        self.filename = filename
        self.meshes = dict(meshes)

    def pos(self, node: Tree | Token) -> SourcePosition:
        offset = node.start_pos if isinstance(node, Token) else getattr(node.meta, "start_pos", 0)
        return self.lines.at_offset(offset or 0, self.filename)

    def pos_in_token(self, token: Token, offset: int) -> SourcePosition:
        return self.lines.at_offset((token.start_pos or 0) + offset, self.filename)

    def int(self, token: Token) -> int:
        # Python refuses to convert integers of more than 4300 digits; no count, size or rank
        # of ours is meaningful beyond int64 anyway.
        digits = str(token).lstrip("0")
        if len(digits) > 19 or (digits and int(digits) > MAX_INT):
            shown = digits if len(digits) <= 24 else digits[:20] + "..."
            raise ParseError(f"the integer {shown} is too large (at most {MAX_INT})", self.pos(token))
        return int(token)

    # --- meshes ----------------------------------------------------------------------
    def mesh_axes(self, tree: Tree) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
        sizes: list[int] = []
        names: list[str] = []
        for axis in tree.children:
            assert isinstance(axis, Tree)
            if axis.data == "named_axis":
                name = str(axis.children[0])
                if name in names:
                    raise LayoutError(f"mesh axis name '{name}' is used twice", self.pos(axis))
                try:
                    check_identifier(name, "axis")
                except LayoutError as e:
                    raise e.at(self.pos(axis)) from None
                names.append(name)
            sizes.append(self.int(axis.children[-1]))  # type: ignore[arg-type]
        if names and len(names) != len(sizes):
            raise LayoutError("name every mesh axis or none of them", self.pos(tree))
        for axis, size in zip(tree.children, sizes, strict=True):
            if size < 1:
                raise LayoutError(f"mesh axis size {size} must be at least 1", self.pos(axis))
        if math.prod(sizes) > MAX_MESH_SIZE:
            raise LayoutError(f"a mesh of {math.prod(sizes)} ranks is larger than {MAX_MESH_SIZE}", self.pos(tree))
        return tuple(sizes), (tuple(names) if names else None)

    def ranks(self, tree: Tree) -> tuple[int, ...] | StridedRanks:
        values = [self.int(t) for t in tree.children]  # type: ignore[arg-type]
        if tree.data in ("rank_range", "rank_stride"):
            lo, hi, step = (*values, 1)[:3]
            text = f"{lo}..{hi}" + (f" step {step}" if tree.data == "rank_stride" else "")
            if hi < lo:
                raise LayoutError(f"rank range {text} is empty", self.pos(tree))
            if step < 1 or (hi - lo) % step:
                raise LayoutError(f"rank range {text}: {hi} is not {lo} plus a multiple of a step >= 1", self.pos(tree))
            if (hi - lo) // step + 1 > MAX_MESH_SIZE:
                raise LayoutError(f"rank range {text} is larger than {MAX_MESH_SIZE}", self.pos(tree))
            # O(1), whatever the range's length
            return RowMajorRanks(hi - lo + 1, lo) if step == 1 else StridedRanks((hi - lo) // step + 1, lo, step)
        return tuple(values)

    def mesh(self, axes: Tree, ranks: Tree | None, name: str | None, at: Tree | Token) -> Mesh:
        shape, names = self.mesh_axes(axes)
        try:
            mesh = Mesh(shape=shape, axis_names=names, name=name)
        except LayoutError as e:
            raise e.at(self.pos(at)) from None
        if ranks is None:
            return mesh
        try:
            return attrs.evolve(mesh, ranks=self.ranks(ranks))
        except LayoutError as e:
            raise e.at(self.pos(ranks)) from None

    def mesh_ref(self, tree: Tree) -> Mesh:
        if tree.data == "mesh_name":
            token = tree.children[0]
            assert isinstance(token, Token)
            if str(token) not in self.meshes:
                known = ", ".join(sorted(self.meshes)) or "none declared"
                raise LayoutError(f"unknown mesh '{token}' (meshes: {known})", self.pos(token))
            return self.meshes[str(token)]
        return self.mesh_text(tree)

    def mesh_text(self, tree: Tree) -> Mesh:
        """An inline mesh, or a named one (``mesh world = [...]``) that must agree with a
        declared mesh of that name."""
        if tree.data == "inline_mesh":
            axes, *ranks = tree.children
            assert isinstance(axes, Tree)
            return self.mesh(axes, ranks[0] if ranks else None, None, tree)  # type: ignore[arg-type]
        name, axes, *ranks = tree.children
        assert isinstance(name, Token) and isinstance(axes, Tree)
        mesh = self.mesh(axes, ranks[0] if ranks else None, str(name), name)  # type: ignore[arg-type]
        declared = self.meshes.get(str(name))
        if declared is not None and declared != mesh:
            raise LayoutError(f"mesh '{name}' is declared as {declared.text()}, not as {mesh.text()}", self.pos(tree))
        return mesh

    # --- layouts ---------------------------------------------------------------------
    def axes(self, mesh: Mesh, node: Tree | Token) -> list[tuple[int, SourcePosition]]:
        """Axis indices with their positions, from ``S01``/``P01`` tokens or ``(dp,tp)`` lists."""
        refs: list[tuple[int, SourcePosition]] = []
        if isinstance(node, Token):  # S01 or P01: one digit per axis
            for i, ch in enumerate(str(node)[1:]):
                pos = self.pos_in_token(node, i + 1)
                try:
                    refs.append((mesh.axis_index(int(ch)), pos))
                except LayoutError as e:
                    raise e.at(pos) from None
            return refs
        for token in node.children:
            assert isinstance(token, Token)
            try:
                refs.append((mesh.axis_index(self.int(token) if token.type == "INT" else str(token)), self.pos(token)))
            except LayoutError as e:
                raise e.at(self.pos(token)) from None
        return refs

    def op_in_axes(self, mesh: Mesh, node: Tree | Token, op: str) -> None:
        """A reduce op written among a partial's axes (``P(dp, avg)``): where it goes instead."""
        if isinstance(node, Token):
            return
        names = [str(t) for t in node.children]
        last = node.children[-1]
        ops = {**{o: o for o in REDUCE_OPS}, "mean": "avg"}  # torch's ReduceOp.AVG is 'avg' here
        if len(names) > 1 and names[-1] in ops and names[-1] not in (mesh.axis_names or ()):
            assert isinstance(last, Token)
            meant = f"P({','.join(names[:-1])}):{ops[names[-1]]}"
            raise LayoutError(
                f"'{names[-1]}' is a reduce op, not a mesh axis: it follows the partial's ')' after ':' "
                f"(did you mean '{meant}'?)" + (f"; this one already says ':{op}'" if op != "sum" else ""),
                self.pos(last),
            )

    def layout(self, tree: Tree) -> Layout:
        """A layout that names every dim (no ``...``: it has no tensor to stand for dims of)."""
        layout, _, ellipsis = self.layout_parts(tree)
        if ellipsis is not None:
            raise ParseError(
                "'...' stands for the dims of a tensor that a layout does not name: it is for a spec's "
                "rules and tensor entries, not a layout on its own",
                self.pos(ellipsis),
            )
        return layout

    def layout_parts(self, tree: Tree) -> tuple[Layout, int | None, Token | None]:
        """The layout of the dims named, how many of them come before its ``...`` (``None``
        without one) and the ``...`` token."""
        dims_tree, *rest = tree.children
        mesh = self.mesh_ref(rest[-1])  # type: ignore[arg-type]
        used: dict[int, str] = {}

        def claim(axis: int, by: str, pos: SourcePosition) -> None:
            if axis in used:
                raise axis_used_twice(mesh, axis, used[axis], by).at(pos)
            used[axis] = by

        dims: list[tuple[int, ...]] = []
        at: int | None = None
        ellipsis: Token | None = None
        assert isinstance(dims_tree, Tree)
        if dims_tree.data == "dims":
            for dim in dims_tree.children:
                assert isinstance(dim, Tree)
                if dim.data == "ellipsis":
                    token = dim.children[0]
                    assert isinstance(token, Token)
                    if ellipsis is not None:
                        raise ParseError(
                            f"a layout has at most one '...' (its first is at column {ellipsis.column}): "
                            "which dims each stands for would be a guess",
                            self.pos(token),
                        )
                    at, ellipsis = len(dims), token
                    continue
                if dim.data == "replicated":
                    dims.append(())
                    continue
                refs = self.axes(mesh, dim.children[0])
                for axis, pos in refs:
                    claim(axis, f"dim {len(dims)}", pos)
                dims.append(tuple(a for a, _ in refs))
        partial: list[tuple[int, str]] = []
        for p in rest[:-1]:
            assert isinstance(p, Tree)
            op = "sum"
            if len(p.children) == 2:
                op_token = p.children[1]
                assert isinstance(op_token, Token)
                op = str(op_token)
                try:
                    check_reduce_op(op)
                except LayoutError as e:
                    raise e.at(self.pos(op_token)) from None
            self.op_in_axes(mesh, p.children[0], op)
            for axis, pos in self.axes(mesh, p.children[0]):
                claim(axis, "a partial", pos)
                partial.append((axis, op))
        try:
            layout = Layout(dims=tuple(dims), mesh=mesh, partial=tuple(partial))
        except LayoutError as e:
            raise e.at(self.pos(tree)) from None
        return layout, at, ellipsis

    # --- spec files ------------------------------------------------------------------
    def spec(self, tree: Tree) -> Spec:
        decls: list[MeshDecl] = []
        for item in tree.children:
            assert isinstance(item, Tree)
            if item.data == "mesh_decl":
                decl = self.mesh_decl(item)
                if decl.mesh.name in self.meshes:
                    first = next(d for d in decls if d.mesh.name == decl.mesh.name)
                    where = f" (first declared at line {first.position.line})" if first.position else ""
                    raise SpecError(f"mesh '{decl.mesh.name}' is declared twice{where}", self.pos(item))
                self.meshes[decl.mesh.name] = decl.mesh  # type: ignore[index]
                decls.append(decl)
        tensors: dict[str, TensorSpec] = {}
        rules: list[Rule] = []
        for item in tree.children:
            assert isinstance(item, Tree)
            if item.data == "tensor_decl":
                declared = self.tensor_decl(item)
                if len(tensors) + len(declared) > MAX_TENSORS:
                    raise SpecError(f"the file declares more than {MAX_TENSORS} tensors", self.pos(item))
                for t in declared:
                    if t.name in tensors:
                        first = tensors[t.name].position
                        where = f" (first declared at line {first.line})" if first else ""
                        raise SpecError(f"tensor '{t.name}' is declared twice{where}", self.pos(item))
                    tensors[t.name] = t
            elif item.data == "rule_decl":
                rules.append(self.rule_decl(item))
        return Spec(meshes=tuple(decls), tensors=tuple(tensors.values()), rules=tuple(rules), filename=self.filename)

    def mesh_decl(self, tree: Tree) -> MeshDecl:
        name_token, axes, *rest = tree.children
        ranks = next((t for t in rest if isinstance(t, Tree) and t.data.startswith("rank")), None)
        mesh = self.mesh(axes, ranks, str(name_token), name_token)  # type: ignore[arg-type]
        bandwidth = latency = None
        for hint in rest:
            assert isinstance(hint, Tree)
            if hint.data == "bandwidth":
                if bandwidth is not None:
                    raise SpecError("bandwidth is given twice", self.pos(hint))
                values = [self.bandwidth(t) for t in hint.children[0].children]
                bandwidth = self.per_axis(hint, mesh, "bandwidth", values)
            elif hint.data == "latency":
                if latency is not None:
                    raise SpecError("latency is given twice", self.pos(hint))
                latency = self.per_axis(hint, mesh, "latency", [self.duration(t) for t in hint.children[0].children])
        return MeshDecl(mesh=mesh, hints=CostHints(bandwidth=bandwidth, latency=latency), position=self.pos(tree))

    def bandwidth(self, token: Token) -> float:
        value = float(token)
        if not 0 < value < math.inf:
            raise SpecError(f"bandwidth {token} must be a positive finite number (bytes per second)", self.pos(token))
        return value

    def duration(self, token: Token) -> float:
        value = parse_duration(str(token))  # a DURATION token is always well formed
        if not value < math.inf:
            raise SpecError(f"latency {token} is out of range (a finite number of seconds)", self.pos(token))
        return value

    def per_axis(self, hint: Tree, mesh: Mesh, what: str, values: list[float]) -> tuple[float, ...]:
        if len(values) == 1:
            return tuple(values * mesh.ndim)
        if len(values) != mesh.ndim:
            raise SpecError(
                f"{what} gives {len(values)} values for a {mesh.ndim}-axis mesh (give one, or one per axis)",
                self.pos(hint),
            )
        return tuple(values)

    def entries(
        self, entries: list[Tree], owner: str, at: Tree, shape: tuple[int, ...] | None
    ) -> tuple[Layouts, dict[str, int]]:
        """The layouts of a tensor (``shape`` given: a ``...`` is filled in) or of a rule, and
        for a rule where each entry's ``...`` stands (before its last dim; see ``Rule.ellipses``)."""
        seen: dict[str, Layout] = {}
        ellipses: dict[str, int] = {}
        for entry in entries:
            key_token, layout_tree = entry.children
            assert isinstance(key_token, Token) and isinstance(layout_tree, Tree)
            key = str(key_token)
            if not (key in ("param", "grad", "state") or (key.startswith("state.") and key.count(".") == 1)):
                raise SpecError(
                    f"unknown entry '{key}' in {owner}; expected param, grad, state or state.<name>",
                    self.pos(key_token),
                )
            if key in seen:
                raise SpecError(f"{owner} gives '{key}' twice", self.pos(key_token))
            layout, before, ellipsis = self.layout_parts(layout_tree)
            if shape is not None and ellipsis is not None:
                if layout.ndim > len(shape):
                    raise SpecError(
                        f"{owner} has shape {list(shape)} ({len(shape)} dims) but its {key} layout names "
                        f"{layout.ndim} dims besides its '...'",
                        self.pos(ellipsis),
                    )
                extra = ((),) * (len(shape) - layout.ndim)
                layout = attrs.evolve(layout, dims=layout.dims[:before] + extra + layout.dims[before:])
            elif before is not None and before < layout.ndim:
                ellipses[key] = before
            if shape is not None and layout.ndim != len(shape):
                raise SpecError(
                    f"{owner} has shape {list(shape)} ({len(shape)} dims) but its {key} layout has {layout.ndim} dims",
                    self.pos(layout_tree),
                )
            if seen:
                # A rule has no shape: its layouts must at least agree with each other.
                first_key, first = next(iter(seen.items()))
                # Without a '...', which dims the shorter one leaves out would be a guess.
                fixed = next(((k, v) for k, v in seen.items() if k not in ellipses), None)
                if fixed is not None and key not in ellipses and layout.ndim != fixed[1].ndim:
                    raise SpecError(
                        f"{owner}: its {key} layout has {layout.ndim} dims but its {fixed[0]} layout has "
                        f"{fixed[1].ndim}; write '...' where a layout's unnamed dims go",
                        self.pos(layout_tree),
                    )
                # Layouts of one tensor are resharded into each other: one grid of ranks.
                if (layout.mesh.shape, layout.mesh.ranks) != (first.mesh.shape, first.mesh.ranks):
                    raise SpecError(
                        f"{owner}: its {key} layout is over {layout.mesh.describe()} but its {first_key} layout "
                        f"is over {first.mesh.describe()}; the layouts of a tensor share one mesh",
                        self.pos(layout_tree),
                    )
            seen[key] = layout
        if "param" not in seen:
            raise SpecError(f"{owner} has no param layout", self.pos(at))
        # Defaults: the gradient arrives in the param layout, states live in the param layout.
        param = seen["param"]
        states = [(STATE_DEFAULT, seen.get("state", param))]
        states += sorted((k.split(".", 1)[1], v) for k, v in seen.items() if k.startswith("state."))
        for key in ("grad", "state"):  # a default is the param layout, its '...' included
            if key not in seen and "param" in ellipses:
                ellipses[key] = ellipses["param"]
        return Layouts(param=param, grad=seen.get("grad", param), states=tuple(states)), ellipses

    def tensor_decl(self, tree: Tree) -> list[TensorSpec]:
        name_token, dtype_token, *rest = tree.children
        assert isinstance(name_token, Token) and isinstance(dtype_token, Token)
        dtype = str(dtype_token)
        try:
            itemsize(dtype)
        except LayoutError as e:
            raise SpecError(e.message, self.pos(dtype_token)) from None
        shape = tuple(self.int(t) for t in rest if isinstance(t, Token))
        entries = [t for t in rest if isinstance(t, Tree)]
        try:
            names = expand_braces(str(name_token), limit=MAX_EXPANDED_NAMES)
        except ShardlangError as e:
            raise e.at(self.pos(name_token)) from None
        for name in names:  # a brace's alternatives may hold any character but a space
            if not _TENSOR_NAME.fullmatch(name):
                raise ParseError(
                    f"tensor name '{name}' (from '{name_token}') may hold only letters, digits, '_', '.' and '-'",
                    self.pos(name_token),
                )
        layouts, _ = self.entries(entries, f"tensor '{name_token}'", tree, shape)
        position = self.pos(tree)
        return [TensorSpec(name=n, dtype=dtype, shape=shape, layouts=layouts, position=position) for n in names]

    def rule_decl(self, tree: Tree) -> Rule:
        pattern_token, *entries = tree.children
        assert isinstance(pattern_token, Token)
        pattern = str(pattern_token)[1:-1]
        if not pattern:
            raise SpecError("a rule needs a non-empty pattern", self.pos(pattern_token))
        try:
            brace_choices(pattern, limit=MAX_EXPANDED_NAMES)  # checked, never expanded (spec.pattern_regex)
        except ShardlangError as e:
            raise e.at(self.pos(pattern_token)) from None
        layouts, ellipses = self.entries(entries, f'rule "{pattern}"', tree, None)  # type: ignore[arg-type]
        return Rule(pattern=pattern, layouts=layouts, ellipses=tuple(ellipses.items()), position=self.pos(tree))


def parse_layout(text: str, meshes: Mapping[str, Mesh] | None = None, *, filename: str | None = None) -> Layout:
    """Parse one layout, e.g. ``"S0,R over mesh[2,2]"``.

    ``meshes`` gives the declared meshes that ``over NAME`` may refer to.
    """
    lines = LineIndex(text) if isinstance(text, str) else LineIndex("")
    return _Reader(lines, filename, meshes or {}).layout(parse_tree(text, "layout", filename, lines))


def parse_mesh(text: str, *, filename: str | None = None) -> Mesh:
    """Parse one mesh in its canonical text (:meth:`Mesh.text`): ``"mesh[dp=2,tp=2]"``, or
    ``"mesh world = [dp=2,tp=2] ranks 4..7"`` for a mesh with a name."""
    lines = LineIndex(text) if isinstance(text, str) else LineIndex("")
    return _Reader(lines, filename, {}).mesh_text(parse_tree(text, "mesh_text", filename, lines))


def parse_duration(text: str) -> float:
    """Seconds from a duration as the language writes it: a number and an optional unit, ``s``
    (the default), ``ms``, ``us`` or ``ns``: ``5us``, ``1.5e-3``. Like ``float``, ``math.inf``
    when it is beyond a float; a :class:`ParseError` (without a position) when it is no duration."""
    if not re.fullmatch(grammar().get_terminal("DURATION").pattern.to_regexp(), text):
        raise ParseError(f"'{text}' is not a duration; write seconds like 5e-6, or a number and a unit like 5us")
    unit = next((u for u in ("ms", "us", "ns", "s") if text.endswith(u)), "s")
    try:
        # Decimal keeps 5us exactly 5e-06 (a float product would give 4.9999...e-06).
        return float(Decimal(text.removesuffix(unit)) * _TIME_UNITS[unit])
    except ArithmeticError:  # decimal's Overflow, and InvalidOperation on absurd exponents
        return math.inf


def parse_spec(text: str, filename: str | None = None) -> Spec:
    """Parse the text of a spec file."""
    lines = LineIndex(text) if isinstance(text, str) else LineIndex("")
    return _Reader(lines, filename, {}).spec(parse_tree(text, "spec", filename, lines))


def load_spec(path: str | Path) -> Spec:
    """Read and parse a spec file; errors name the file (and the line and column where the
    text is at fault). The file is read as it is, lines ending at ``"\\n"`` as in
    :func:`parse_spec` (no newline translation; every line break ``str.splitlines`` knows ends a
    line, :data:`shardlang.errors.LINE_BREAK`)."""
    path = Path(path)
    return parse_spec(read_source(path), filename=str(path))


def read_source(path: Path) -> str:
    """The text of the spec file ``path``: a regular file of at most :data:`MAX_SOURCE_BYTES`,
    in UTF-8. Anything else is a :class:`ShardlangError` naming the file, before more than the
    limit is read (a FIFO or a device such as ``/dev/zero`` is never read at all)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        mode, size = info.st_mode, info.st_size
        if not stat.S_ISREG(mode):
            raise SpecError(f"{path}: cannot read: it is {file_kind(mode)}, not a spec file")
        if size > MAX_SOURCE_BYTES:
            raise SpecError(f"{path}: the file has {size} bytes; a spec file may have at most {MAX_SOURCE_BYTES}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_SOURCE_BYTES + 1)
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_SOURCE_BYTES:  # it grew while being read
        raise SpecError(f"{path}: the file has more than {MAX_SOURCE_BYTES} bytes, the most a spec file may have")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        # The bytes before the bad one are valid UTF-8: their characters are its offset.
        offset = len(data[: e.start].decode("utf-8"))
        position = SourcePosition.at_offset(data.decode("utf-8", errors="replace"), offset, str(path))
        raise ParseError(f"the file is not valid UTF-8 here (byte 0x{data[e.start]:02x})", position) from None


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, from its ``st_mode``: ``a folder``, ``a FIFO``,
    ``a device`` or ``a special file``."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"
