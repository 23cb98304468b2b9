"""Layouts to and from other frameworks' descriptions: DTensor, Paddle, ColossalAI.

Each framework expresses a subset of the language; a layout outside it is an
:class:`~shardlang.errors.InteropError` naming the layout, never a different layout.

- DTensor placements are mesh-axis-major: one ``Shard(d)``, ``Replicate()`` or
  ``Partial(op)`` per mesh axis. A dim split over several axes is nested left to right
  (lower mesh axis outer), so only ascending nestings (``S01``, not ``S10``) are expressible,
  and DTensor rejects mixed partial ops other than sum with avg.
- Paddle ``dims_mapping`` gives one mesh axis (or -1) per tensor dim, so a dim split over
  several axes is not expressible; ``partial_status`` maps mesh axis to Paddle's ReduceType
  name (``kRedSum``, ``kRedAvg``, ``kRedMax``, ``kRedMin``); Paddle does not say in which
  order it reduces mixed ops, so only commuting mixes (sum with avg) convert.
- ColossalAI sharding sequences give ``"R"`` or ``"S"`` plus the mesh axes, outer first
  (``"S01"``, ``"S10"``), per tensor dim; they have no partial state.

torch is imported inside the DTensor functions only, so the language core does not need it.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from shardlang.errors import InteropError, LayoutError
from shardlang.layout import REDUCE_OPS, Layout, reduce_ops_commute
from shardlang.mesh import Mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement


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
def to_dtensor_placements(layout: Layout) -> tuple[Placement, ...]:
    """One DTensor placement per mesh axis: ``Shard(d)``, ``Replicate()`` or ``Partial(op)``."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    for d, axes in enumerate(layout.dims):
        if list(axes) != sorted(axes):
            raise InteropError(
                f"layout '{layout}' nests dim {d} over mesh axes in the order "
                f"{', '.join(layout.mesh.axis_label(a) for a in axes)}; DTensor placements nest a dim "
                "over mesh axes in ascending order only"
            )
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
    return tuple(placements)


def from_dtensor_placements(placements: Sequence[Placement], ndim: int, mesh: Mesh) -> Layout:
    """The layout of a ``ndim``-d DTensor with ``placements`` on ``mesh``."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = tuple(placements)
    source = f"DTensor placements {placements!r}"
    if len(placements) != mesh.ndim:
        raise InteropError(f"{source} have {len(placements)} entries for the {mesh.ndim}-axis {mesh.describe()}")
    dims: list[list[int]] = [[] for _ in range(ndim)]
    partial: list[tuple[int, str]] = []
    for axis, p in enumerate(placements):
        # Exact types: _StridedShard subclasses Shard's base, _MaskPartial subclasses Partial,
        # and neither means what its base means.
        if isinstance(p, _StridedShard):
            raise InteropError(
                f"{source}: mesh axis {axis} is {p!r}, a nesting DTensor encodes by split factor; "
                "shardlang does not read it (write the nesting order in the layout text, e.g. S10)"
            )
        if type(p) is Shard:
            dim = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= dim < ndim:
                raise InteropError(f"{source}: mesh axis {axis} shards dim {p.dim} of a {ndim}-d tensor")
            dims[dim].append(axis)
        elif type(p) is Partial:
            if p.reduce_op not in REDUCE_OPS:
                raise InteropError(
                    f"{source}: mesh axis {axis} is partial with reduce op '{p.reduce_op}'; "
                    f"shardlang knows {', '.join(REDUCE_OPS)}"
                )
            partial.append((axis, p.reduce_op))
        elif type(p) is not Replicate:
            raise InteropError(f"{source}: mesh axis {axis} has placement {p!r}, which shardlang cannot express")
    _check_partial_ops_commute((op for _, op in partial), source, "DTensor")
    return _layout(dims, mesh, partial, source)


def mesh_from_device_mesh(device_mesh: DeviceMesh) -> Mesh:
    """The mesh of a ``torch.distributed.device_mesh.DeviceMesh``: its shape, its global ranks
    in row-major order, and its dim names as axis names when it has them."""
    ranks = device_mesh.mesh
    names = device_mesh.mesh_dim_names
    try:
        return Mesh(shape=tuple(ranks.shape), ranks=tuple(ranks.flatten().tolist()), axis_names=names)
    except LayoutError as e:
        raise InteropError(f"device mesh {device_mesh!r} cannot be a shardlang mesh: {e.message}") from None


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
