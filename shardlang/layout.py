"""Layouts: how a tensor lies on a device mesh.

A layout is tensor-dim-major: for every tensor dimension, the mesh axes that split it (outer
to inner), then the mesh axes over which the tensor is a pending reduction (partial), then
the mesh. Mesh axes used by neither are replicated.

Chunking follows ``torch.chunk``: a dim of length L split n ways gives pieces of
``ceil(L/n)``; piece i covers ``[min(i*c, L), min((i+1)*c, L))``, so trailing pieces may be
smaller or empty. A nested split (``S01``) splits the piece again with the same rule.

Partial axes: the global tensor is the reduction of the local tensors over every partial
axis, taken in ascending mesh-axis order. ``sum`` and ``avg`` commute with each other (both
are linear), ``max`` commutes with ``max`` and ``min`` with ``min``; any other pair must be
reduced in that order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal, get_args

import attrs

from shardlang.box import Box
from shardlang.errors import LayoutError
from shardlang.mesh import Mesh

ReduceOp = Literal["sum", "avg", "max", "min"]
REDUCE_OPS: tuple[ReduceOp, ...] = get_args(ReduceOp)
_COMMUTING_CLASS = {"sum": "linear", "avg": "linear", "max": "max", "min": "min"}


def reduce_ops_commute(a: str, b: str) -> bool:
    """Whether reducing over one axis with ``a`` and another with ``b`` can be done in
    either order with the same result."""
    return _COMMUTING_CLASS[a] == _COMMUTING_CLASS[b]


def check_reduce_op(op: str) -> None:
    """A :class:`LayoutError` unless ``op`` is a reduce op of the language."""
    if op not in REDUCE_OPS:
        raise LayoutError(f"unknown reduce op '{op}' (expected one of {', '.join(REDUCE_OPS)})")


def axis_used_twice(mesh: Mesh, axis: int, first: str, second: str) -> LayoutError:
    """The error for a mesh axis that two parts of one layout claim (``dim 0``, ``a partial``)."""
    return LayoutError(f"mesh axis {mesh.axis_label(axis)} is used twice (by {first} and by {second})")


def chunk_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of piece ``index`` when ``length`` is cut in ``parts`` as torch.chunk."""
    size = -(-length // parts)
    return min(index * size, length), min((index + 1) * size, length)


def padded_length(length: int, splits: Iterable[int]) -> int:
    """The padded piece length of a dim split successively into ``splits`` parts."""
    for n in splits:
        length = -(-length // n)
    return length


def _as_dims(value: object) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(a) for a in dim) for dim in value)  # type: ignore[union-attr]


def _as_partial(value: object) -> tuple[tuple[int, str], ...]:
    pairs = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((int(a), str(op)) for a, op in pairs))  # type: ignore[union-attr]


@attrs.frozen(repr=False)
class Layout:
    """``dims[d]`` lists the mesh axes that split tensor dim ``d``, outermost first;
    ``partial`` holds ``(axis, reduce_op)`` pairs, sorted by axis."""

    dims: tuple[tuple[int, ...], ...] = attrs.field(converter=_as_dims)
    mesh: Mesh
    partial: tuple[tuple[int, str], ...] = attrs.field(default=(), converter=_as_partial)

    @classmethod
    def trusted(cls, dims: tuple[tuple[int, ...], ...], mesh: Mesh, partial: tuple[tuple[int, str], ...]) -> Layout:
        """A layout from parts already in canonical form (tuples of int axes; partial sorted
        by axis) and known to be valid, built without converting or checking them: the
        planner derives every state it reports from valid layouts, and the checks would be a
        fifth of a short plan's planning time."""
        layout = object.__new__(cls)
        object.__setattr__(layout, "dims", dims)
        object.__setattr__(layout, "mesh", mesh)
        object.__setattr__(layout, "partial", partial)
        return layout

    def __attrs_post_init__(self) -> None:
        used: dict[int, str] = {}

        def claim(axis: int, by: str) -> None:
            if not 0 <= axis < self.mesh.ndim:
                raise LayoutError(
                    f"mesh axis {axis} ({by}) is out of range for {self.mesh.describe()}, "
                    f"which has {self.mesh.ndim} axes"
                )
            if axis in used:
                raise axis_used_twice(self.mesh, axis, used[axis], by)
            used[axis] = by

        for d, axes in enumerate(self.dims):
            for a in axes:
                claim(a, f"dim {d}")
        for a, op in self.partial:
            check_reduce_op(op)
            claim(a, "a partial")

    # --- what each axis does ---------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def partial_ops(self) -> dict[int, str]:
        return dict(self.partial)

    def dim_of_axis(self, axis: int) -> int | None:
        """The tensor dim that ``axis`` splits, or ``None``."""
        for d, axes in enumerate(self.dims):
            if axis in axes:
                return d
        return None

    def replicated_axes(self) -> tuple[int, ...]:
        busy = {a for axes in self.dims for a in axes} | {a for a, _ in self.partial}
        return tuple(a for a in range(self.mesh.ndim) if a not in busy)

    @property
    def is_partial(self) -> bool:
        return bool(self.partial)

    # --- geometry --------------------------------------------------------------------
    def check_shape(self, shape: tuple[int, ...]) -> None:
        if len(shape) != self.ndim:
            raise LayoutError(
                f"layout '{self}' describes a {self.ndim}-d tensor but the shape {list(shape)} has {len(shape)} dims"
            )
        if any(s < 0 for s in shape):
            raise LayoutError(f"shape {list(shape)} has a negative length")

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The padded local shape every rank holds (the largest piece, per dim)."""
        self.check_shape(shape)
        return tuple(
            padded_length(length, (self.mesh.shape[a] for a in axes))
            for length, axes in zip(shape, self.dims, strict=True)
        )

    def piece(self, shape: tuple[int, ...], coordinate: tuple[int, ...]) -> Box:
        """``[start, stop)`` per dim of the block held at a mesh coordinate."""
        self.check_shape(shape)
        bounds = []
        for length, axes in zip(shape, self.dims, strict=True):
            start, stop = 0, length
            for a in axes:
                lo, hi = chunk_bounds(stop - start, self.mesh.shape[a], coordinate[a])
                start, stop = start + lo, start + hi
            bounds.append((start, stop))
        return Box.trusted(bounds)

    def rank_piece(self, shape: tuple[int, ...], rank: int) -> Box:
        """``[start, stop)`` per dim of the block a global rank holds."""
        return self.piece(shape, self.mesh.coordinate(rank))

    # --- text ------------------------------------------------------------------------
    def __str__(self) -> str:
        return format_layout(self)

    def __repr__(self) -> str:
        return f"Layout({format_layout(self, mesh_inline=True)!r})"


def format_axes(mesh: Mesh, axes: Iterable[int]) -> str:
    """Axes as written after ``S`` or ``P``: ``01`` for numbered axes below 10, else ``(dp,tp)``."""
    axes = tuple(axes)
    if mesh.axis_names is None and all(a < 10 for a in axes):
        return "".join(str(a) for a in axes)
    return "(" + ",".join(mesh.axis_label(a) for a in axes) + ")"


def format_layout(layout: Layout, *, mesh_inline: bool = False, ellipsis: int | None = None) -> str:
    """The one canonical text of a layout; ``parse_layout`` reads it back to an equal value
    (given the declared meshes it names). With ``mesh_inline``, a declared mesh is written out
    (``over mesh world = [dp=2]``): a text that reads back to an equal value on its own. With
    ``ellipsis``, a rule's ``...`` stands after that many dims (docs/language.md, "Rules")."""
    mesh = layout.mesh
    dims = ["S" + format_axes(mesh, axes) if axes else "R" for axes in layout.dims]
    if ellipsis is not None:
        dims.insert(ellipsis, "...")
    text = ",".join(dims) or "()"
    if layout.partial:
        # One group per op, groups ordered by their first axis, axes ascending within a group.
        groups: dict[str, list[int]] = {}
        for axis, op in layout.partial:
            groups.setdefault(op, []).append(axis)
        parts = []
        for op, axes in groups.items():
            parts.append("P" + format_axes(mesh, axes) + ("" if op == "sum" else f":{op}"))
        text += " | " + ",".join(parts)
    return f"{text} over {mesh.text() if mesh_inline else mesh}"
