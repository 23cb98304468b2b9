"""Layouts to and from other frameworks' descriptions: DTensor, Paddle, ColossalAI.

Each framework expresses a subset of the language; a layout outside it is an
:class:`~shardlang.errors.InteropError` naming the layout, never a different layout.

- DTensor placements are mesh-axis-major: one ``Shard(d)``, ``_StridedShard(d, sf)``,
  ``Replicate()`` or ``Partial(op)`` per mesh axis. A dim split over several axes by
  ``Shard`` is nested left to right (lower mesh axis outer: ``S01``). Other nesting orders
  (``S10``, as FSDP2 over TP gives) come as a DTensor spec's ``shard_order``, exact for
  every shape, or as ``_StridedShard``, whose split factor names the order but whose
  slicing equals the nesting only for some shapes: those are read and written with the
  tensor's shape and checked against DTensor's slicing (docs/tutorials/fsdp2-tp.md, "DTensor
  nesting orders"). DTensor rejects mixed partial ops other than sum with avg; its ``product``
  partial is refused (docs/tutorials/fsdp2-tp.md, "Partial products").
- Paddle ``dims_mapping`` gives one mesh axis (or -1) per tensor dim, so a dim split over
  several axes is not expressible; ``partial_status`` maps mesh axis to Paddle's ReduceType
  name (``kRedSum``, ``kRedAvg``, ``kRedMax``, ``kRedMin``); Paddle does not say in which
  order it reduces mixed ops, so only commuting mixes (sum with avg) convert.
- ColossalAI sharding sequences give ``"R"`` or ``"S"`` plus the mesh axes, outer first
  (``"S01"``, ``"S10"``), per tensor dim; they have no partial state.

torch is imported inside the DTensor functions only, so the language core does not need it.
"""

from __future__ import annotations

import itertools
import math
import operator
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

from shardlang.errors import InteropError, LayoutError
from shardlang.layout import REDUCE_OPS, Layout, chunk_bounds, reduce_ops_commute
from shardlang.mesh import Mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Placement


def _layout(dims: Sequence[Sequence[int]], mesh: Mesh, partial: Sequence[tuple[int, str]], source: str) -> Layout:
    """The layout, with a language error (axis used twice, ...) reported as an interop error."""
    try:
        return Layout(dims=tuple(tuple(d) for d in dims), mesh=mesh, partial=tuple(partial))
    except LayoutError as e:
        raise InteropError(f"{source} is not a valid layout: {e.message}") from None


def _check_partial_ops_commute(ops: Iterable[str], what: str, framework: str) -> None:
    # Neither DTensor nor Paddle says in which order partial axes with non-commuting ops are
    # reduced (DTensor raises on them): any order we picked would be a guess.
    distinct = sorted(set(ops))
    if any(not reduce_ops_commute(a, b) for a in distinct for b in distinct):
        raise InteropError(
            f"{what} mixes partial reduce ops {', '.join(distinct)}, which do not commute; "
            f"{framework} mixes only sum with avg"
        )


def _mesh_axis(value: object, mesh: Mesh, source: str) -> int:
    """``value`` as a mesh axis: any integer (numpy's too) in range, but not a bool."""
    try:
        axis = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        axis = None
    if axis is None or not 0 <= axis < mesh.ndim:
        raise InteropError(f"{source}: {value!r} is not a mesh axis of {mesh.describe()}")
    return axis


# --- DTensor ---------------------------------------------------------------------------
def _split_factors(layout: Layout) -> dict[int, int]:
    """Per mesh axis that splits a dim, DTensor's split factor for it: the product of the
    sizes of the axes that split the same dim before it (outer) but come later in the mesh."""
    factors = {}
    for axes in layout.dims:
        for k, axis in enumerate(axes):
            factors[axis] = math.prod(layout.mesh.shape[b] for b in axes[:k] if b > axis)
    return factors


def to_dtensor_placements(layout: Layout, shape: Sequence[int] | None = None) -> tuple[Placement, ...]:
    """One DTensor placement per mesh axis: ``Shard(d)``, ``Replicate()`` or ``Partial(op)``;
    a dim nested in another order than ascending gets ``_StridedShard(d, sf)`` on the axes
    that come early, which needs ``shape``: the placements must slice that shape as the
    layout does (see :func:`to_dtensor_shard_order` for a form exact for every shape)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    factors = _split_factors(layout)
    nested = [d for d, axes in enumerate(layout.dims) if list(axes) != sorted(axes)]
    if nested and shape is None:
        d = nested[0]
        raise InteropError(
            f"layout '{layout}' nests dim {d} over mesh axes in the order "
            f"{', '.join(layout.mesh.axis_label(a) for a in layout.dims[d])}; DTensor placements write "
            "that with _StridedShard, whose slicing depends on the tensor's shape: pass shape=, or use "
            "to_dtensor_shard_order"
        )
    _check_partial_ops_commute(layout.partial_ops.values(), f"layout '{layout}'", "DTensor")
    placements: list[Placement] = []
    for axis in range(layout.mesh.ndim):
        dim = layout.dim_of_axis(axis)
        if dim is not None:
            placements.append(Shard(dim) if factors[axis] == 1 else _StridedShard(dim, split_factor=factors[axis]))
        elif axis in layout.partial_ops:
            placements.append(Partial(layout.partial_ops[axis]))
        else:
            placements.append(Replicate())
    if nested:
        assert shape is not None
        layout.check_shape(tuple(shape))
        _check_strided_slicing(layout, nested, factors, tuple(shape), f"layout '{layout}' as {tuple(placements)!r}")
    return tuple(placements)


def to_dtensor_shard_order(layout: Layout) -> tuple[tuple[Placement, ...], tuple[Any, ...]]:
    """DTensor placements with plain ``Shard`` on every splitting axis, and the ``shard_order``
    (torch's ``ShardOrderEntry`` per split dim: the mesh axes, outer first) that a
    ``DTensorSpec`` takes with them; exact for every shape."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import ShardOrderEntry

    _check_partial_ops_commute(layout.partial_ops.values(), f"layout '{layout}'", "DTensor")
    placements: list[Placement] = []
    for axis in range(layout.mesh.ndim):
        dim = layout.dim_of_axis(axis)
        if dim is not None:
            placements.append(Shard(dim))
        elif axis in layout.partial_ops:
            placements.append(Partial(layout.partial_ops[axis]))
        else:
            placements.append(Replicate())
    order = tuple(ShardOrderEntry(tensor_dim=d, mesh_dims=axes) for d, axes in enumerate(layout.dims) if axes)
    return tuple(placements), order


def from_dtensor_placements(
    placements: Sequence[Placement],
    ndim: int,
    mesh: Mesh,
    *,
    shape: Sequence[int] | None = None,
    shard_order: Sequence[Any] | None = None,
) -> Layout:
    """The layout of a ``ndim``-d DTensor with ``placements`` on ``mesh``: with a
    ``shard_order`` (a ``DTensorSpec``'s: ``(tensor_dim, mesh_dims)`` entries), dims nest in
    that order; ``_StridedShard`` placements give the order by their split factors and need
    ``shape``, which they must slice as the layout does."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = tuple(placements)
    source = f"DTensor placements {placements!r}"
    if len(placements) != mesh.ndim:
        raise InteropError(f"{source} have {len(placements)} entries for the {mesh.ndim}-axis {mesh.describe()}")
    splits: list[list[tuple[int, int]]] = [[] for _ in range(ndim)]  # per dim: (axis, split factor)
    partial: list[tuple[int, str]] = []
    for axis, p in enumerate(placements):
        # Exact types: _MaskPartial subclasses Partial and does not mean what Partial means.
        if type(p) is Shard or type(p) is _StridedShard:
            dim = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= dim < ndim:
                raise InteropError(f"{source}: mesh axis {axis} shards dim {p.dim} of a {ndim}-d tensor")
            factor = int(p.split_factor) if type(p) is _StridedShard else 1
            splits[dim].append((axis, factor))
        elif type(p) is Partial:
            partial.append((axis, _reduce_op_from_dtensor(p.reduce_op, f"{source}: mesh axis {axis}")))
        elif type(p) is not Replicate:
            raise InteropError(f"{source}: mesh axis {axis} has placement {p!r}, which shardlang cannot express")
    _check_partial_ops_commute((op for _, op in partial), source, "DTensor")
    strided = [d for d, split in enumerate(splits) if any(f != 1 for _, f in split)]
    if shard_order is not None:
        if strided:
            raise InteropError(f"{source} hold _StridedShard and a shard_order; DTensor allows one of them only")
        dims = _dims_from_shard_order(splits, shard_order, f"{source} with shard_order {tuple(shard_order)!r}")
    else:
        dims = [_nesting_order(split, mesh, source) for split in splits]
    layout = _layout(dims, mesh, partial, source)
    if strided:
        if shape is None:
            raise InteropError(
                f"{source}: _StridedShard slices a dim as a nesting order only for some lengths; "
                "reading it needs the tensor's shape (shape=)"
            )
        layout.check_shape(tuple(shape))
        factors = {axis: f for split in splits for axis, f in split}
        _check_strided_slicing(layout, strided, factors, tuple(shape), source)
    return layout


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """Whether ``value`` is a DTensor, without importing ``torch.distributed.tensor`` (about a
    second): a DTensor exists only once that module is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def from_dtensor(tensor: DTensor) -> Layout:
    """The layout of a DTensor: its placements on its device mesh, nested in its spec's
    ``shard_order`` (or as its ``_StridedShard`` placements say, for its shape)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    spec = tensor._spec  # the shard order is kept only there
    mesh = mesh_from_device_mesh(tensor.device_mesh)
    strided = any(type(p) is _StridedShard for p in spec.placements)
    if strided and not spec.use_strided_shard_as_shard_order:
        raise InteropError(
            f"DTensor placements {tuple(spec.placements)!r}: its spec reads _StridedShard as a plain Shard "
            "(use_strided_shard_as_shard_order=False), which is no layout of its shape"
        )
    order = None if strided else spec.shard_order
    return from_dtensor_placements(spec.placements, tensor.ndim, mesh, shape=tuple(tensor.shape), shard_order=order)


def _reduce_op_from_dtensor(op: str, where: str) -> str:
    if op in REDUCE_OPS:
        return op
    if op == "product":
        raise InteropError(
            f"{where} is partial with reduce op 'product', which shardlang refuses: a float product "
            "reduced in another order can overflow or underflow where DTensor's does not "
            "(README, 'Partial products')"
        )
    raise InteropError(f"{where} is partial with reduce op '{op}'; shardlang knows {', '.join(REDUCE_OPS)}")


def _nesting_order(split: Sequence[tuple[int, int]], mesh: Mesh, source: str) -> list[int]:
    """The mesh axes of one dim, outer first, from their split factors: walking the axes from
    the last, each goes where the axes before it in the order multiply to its split factor."""
    order: list[int] = []
    for axis, factor in reversed(split):
        product, place = 1, None
        for k in range(len(order) + 1):
            if product == factor:
                place = k
                break
            if k < len(order):
                product *= mesh.shape[order[k]]
        if place is None:
            raise InteropError(
                f"{source}: mesh axis {axis} is _StridedShard with split factor {factor}, which is not the "
                "product of the sizes of the axes splitting the dim after it: not a nesting order"
            )
        order.insert(place, axis)
    return order


def _dims_from_shard_order(
    splits: Sequence[Sequence[tuple[int, int]]], shard_order: Sequence[Any], source: str
) -> list[list[int]]:
    dims: list[list[int]] = [[] for _ in splits]
    for entry in shard_order:
        dim, axes = entry
        if not 0 <= dim < len(splits) or dims[dim]:
            raise InteropError(f"{source}: entry {tuple(entry)!r} names dim {dim} twice or out of range")
        if sorted(axes) != sorted(a for a, _ in splits[dim]):
            raise InteropError(
                f"{source}: dim {dim} is nested over mesh axes {list(axes)}, but the placements shard it "
                f"over {[a for a, _ in splits[dim]]}"
            )
        dims[dim] = list(axes)
    missing = [d for d, split in enumerate(splits) if split and not dims[d]]
    if missing:
        raise InteropError(f"{source}: the shard_order leaves out the sharded dims {missing}")
    return dims


def _take(pieces: Sequence[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """Elements ``[start, stop)`` of the concatenation of index ranges ``pieces``."""
    out, at = [], 0
    for lo, hi in pieces:
        first, last = max(start - at, 0), min(stop - at, hi - lo)
        if first < last:
            out.append((lo + first, lo + last))
        at += hi - lo
    return out


def _dtensor_indices(length: int, splits: Sequence[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The index ranges of a dim of ``length`` that DTensor gives the rank at ``splits``'
    coordinates: placements taken left to right, each ``(size, coordinate, split factor)``;
    a split factor ``f`` cuts the piece in ``f`` (torch.chunk) and takes chunk ``coordinate``
    of each, concatenated (as ``_StridedShard`` does; ``f = 1`` is ``Shard``)."""
    pieces = [(0, length)]
    for size, coordinate, factor in splits:
        total = sum(hi - lo for lo, hi in pieces)
        cut = [_take(pieces, *chunk_bounds(total, factor, k)) for k in range(factor)]
        pieces = []
        for part in cut:
            part_length = sum(hi - lo for lo, hi in part)
            pieces += _take(part, *chunk_bounds(part_length, size, coordinate))
    return pieces


def _check_strided_slicing(
    layout: Layout, dims: Sequence[int], factors: Mapping[int, int], shape: tuple[int, ...], source: str
) -> None:
    """That DTensor's ``_StridedShard`` slicing of ``shape`` gives every rank the block the
    layout gives it, on the dims it nests out of mesh order."""
    mesh = layout.mesh
    for d in dims:
        axes = sorted(layout.dims[d])
        for coordinates in itertools.product(*(range(mesh.shape[a]) for a in axes)):
            at = dict(zip(axes, coordinates, strict=True))
            splits = [(mesh.shape[a], at[a], factors[a]) for a in axes]
            theirs = _dtensor_indices(shape[d], splits)
            start, stop = 0, shape[d]
            for a in layout.dims[d]:
                lo, hi = chunk_bounds(stop - start, mesh.shape[a], at[a])
                start, stop = start + lo, start + hi
            ours = [(start, stop)] if start < stop else []
            merged = _merged(theirs)
            if merged != ours:
                where = ", ".join(f"{mesh.axis_label(a)}={at[a]}" for a in axes)
                raise InteropError(
                    f"{source}: for length {shape[d]} of dim {d}, DTensor gives mesh coordinate {where} the "
                    f"elements {_ranges_text(theirs)}, but the nesting order "
                    f"{', '.join(mesh.axis_label(a) for a in layout.dims[d])} gives {_ranges_text(ours)}; "
                    "there _StridedShard is no nesting order (a DTensor spec's shard_order is)"
                )


def _merged(pieces: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in pieces:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _ranges_text(pieces: Sequence[tuple[int, int]]) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in pieces) + "]" if pieces else "none"


def mesh_from_device_mesh(device_mesh: DeviceMesh) -> Mesh:
    """The mesh of a ``torch.distributed.device_mesh.DeviceMesh``: its shape, its global ranks
    in row-major order, and its dim names as axis names when it has them."""
    ranks = device_mesh.mesh
    names = device_mesh.mesh_dim_names
    try:
        return Mesh(shape=tuple(ranks.shape), ranks=tuple(ranks.flatten().tolist()), axis_names=names)
    except LayoutError as e:
        raise InteropError(f"device mesh {device_mesh!r} cannot be a shardlang mesh: {e.message}") from None


def lift_layout(layout: Layout, mesh: Mesh) -> Layout:
    """A layout on a sub-mesh of ``mesh`` (a DeviceMesh slice such as ``mesh["tp"]``: some of
    its named axes, through one coordinate of the others) as a layout on ``mesh``, replicated
    over the axes the sub-mesh leaves out."""
    sub = layout.mesh
    if sub.same_geometry(mesh):
        return Layout(dims=layout.dims, mesh=mesh, partial=layout.partial)
    source = f"layout '{layout}' on {sub.describe()} within {mesh.describe()}"
    if sub.axis_names is None or mesh.axis_names is None or any(n not in mesh.axis_names for n in sub.axis_names):
        raise InteropError(f"{source}: a sub-mesh is found by its axis names, and these do not name it")
    axes = [mesh.axis_names.index(n) for n in sub.axis_names]
    if any(mesh.shape[a] != n for a, n in zip(axes, sub.shape, strict=True)) or sub.ranks[0] not in mesh.ranks:
        raise InteropError(f"{source}: the sub-mesh is not a slice of the mesh")
    through = list(mesh.coordinate(sub.ranks[0]))
    for coordinate in itertools.product(*(range(n) for n in sub.shape)):
        for a, c in zip(axes, coordinate, strict=True):
            through[a] = c
        if mesh.rank_at(tuple(through)) != sub.rank_at(coordinate):
            raise InteropError(f"{source}: the sub-mesh is not a slice of the mesh (rank {sub.rank_at(coordinate)})")
    dims = [[axes[a] for a in dim] for dim in layout.dims]
    return _layout(dims, mesh, [(axes[a], op) for a, op in layout.partial], source)


# --- Paddle ----------------------------------------------------------------------------
_PADDLE_REDUCE = {"sum": "kRedSum", "avg": "kRedAvg", "max": "kRedMax", "min": "kRedMin"}
_FROM_PADDLE_REDUCE = {paddle: ours for ours, paddle in _PADDLE_REDUCE.items()}


def to_paddle(layout: Layout) -> tuple[list[int], dict[int, str]]:
    """Paddle's ``(dims_mapping, partial_status)``: the mesh axis splitting each dim (-1 for
    none), and Paddle's ReduceType name per partial mesh axis."""
    mapping = []
    for d, axes in enumerate(layout.dims):
        if len(axes) > 1:
            raise InteropError(
                f"layout '{layout}' splits dim {d} over {len(axes)} mesh axes; "
                "Paddle's dims_mapping gives one mesh axis per dim"
            )
        mapping.append(axes[0] if axes else -1)
    _check_partial_ops_commute(layout.partial_ops.values(), f"layout '{layout}'", "Paddle")
    return mapping, {axis: _PADDLE_REDUCE[op] for axis, op in layout.partial}


def from_paddle(dims_mapping: Sequence[int], mesh: Mesh, partial_status: Mapping[int, str] | None = None) -> Layout:
    """The layout of Paddle's ``dims_mapping`` (-1 = replicated) and ``partial_status`` (mesh
    axis to a ReduceType name such as ``kRedSum``, or ours: ``sum``) on ``mesh``."""
    source = f"Paddle dims_mapping {list(dims_mapping)!r}"
    dims = [[] if value == -1 else [_mesh_axis(value, mesh, source)] for value in dims_mapping]
    partial = []
    for axis, reduce_type in (partial_status or {}).items():
        partial.append((_mesh_axis(axis, mesh, "Paddle partial_status"), _reduce_op_from_paddle(reduce_type)))
    if partial_status:
        source += f" with partial_status {dict(partial_status)!r}"
    _check_partial_ops_commute((op for _, op in partial), source, "Paddle")
    return _layout(dims, mesh, partial, source)


def _reduce_op_from_paddle(reduce_type: object) -> str:
    name = getattr(reduce_type, "name", reduce_type)  # a ReduceType enum member, or its name
    if isinstance(name, str):
        if name in _FROM_PADDLE_REDUCE:
            return _FROM_PADDLE_REDUCE[name]
        if name in REDUCE_OPS:
            return name
    known = ", ".join([*_FROM_PADDLE_REDUCE, *REDUCE_OPS])
    raise InteropError(f"Paddle partial_status: reduce type {reduce_type!r} is not one of {known}")


# --- ColossalAI ------------------------------------------------------------------------
_COLOSSAL_DIM = re.compile(r"(R|S([0-9]+))\Z")


def to_colossalai(layout: Layout) -> list[str]:
    """ColossalAI's sharding sequence: ``"R"`` or ``"S"`` + the mesh axes (outer first) per dim."""
    if layout.partial:
        raise InteropError(f"layout '{layout}' is partial; ColossalAI sharding sequences cannot express partials")
    if any(a >= 10 for axes in layout.dims for a in axes):
        raise InteropError(f"layout '{layout}' splits over a mesh axis above 9; ColossalAI writes one digit per axis")
    return ["S" + "".join(str(a) for a in axes) if axes else "R" for axes in layout.dims]


def from_colossalai(sequence: Sequence[str], mesh: Mesh) -> Layout:
    """The layout of a ColossalAI sharding sequence such as ``["S01", "R"]`` on ``mesh``."""
    if isinstance(sequence, str):
        raise InteropError(f"a ColossalAI sharding sequence is a list of dim specs, not the string {sequence!r}")
    source = f"ColossalAI sharding sequence {list(sequence)!r}"
    dims = []
    for d, spec in enumerate(sequence):
        m = _COLOSSAL_DIM.match(spec) if isinstance(spec, str) else None
        if m is None:
            raise InteropError(f"{source}: dim {d} is {spec!r}; expected 'R' or 'S' and mesh axes such as 'S01'")
        dims.append([_mesh_axis(int(ch), mesh, source) for ch in m.group(2) or ""])
    return _layout(dims, mesh, (), source)
