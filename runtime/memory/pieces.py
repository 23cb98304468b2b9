"""Ground truth: the piece each rank holds of a full tensor, and the full tensor from pieces.

Partial layouts need a convention for which addends the ranks hold. ``shard`` uses:

* ``sum``: the full value at coordinate 0 of each sum axis, zeros at every other coordinate;
* ``avg``, ``max``, ``min``: the full value at every coordinate.

Reducing these over the partial axes in any allowed order gives the full value back, and the
runtime's ``partial`` step (replicated -> partial) produces exactly this form. ``unshard``
accepts any addends: it reduces over the partial axes in ascending mesh-axis order (the
layout's meaning), in float64 for floating dtypes, and reads replicated axes at coordinate 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch

from runtime.errors import ReshardError
from shardlang.errors import ShardlangError
from shardlang.layout import Layout


def shard(full: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """The piece of ``full`` that ``rank`` holds in ``layout`` (a new contiguous tensor)."""
    shape = tuple(full.shape)
    try:
        coordinate = layout.mesh.coordinate(rank)
        bounds = layout.piece(shape, coordinate)
    except ShardlangError as e:
        raise ReshardError(f"cannot shard a tensor of shape {list(shape)} as '{layout}': {e.message}") from None
    if any(op == "sum" and coordinate[axis] != 0 for axis, op in layout.partial):
        return full.new_zeros(bounds.shape)
    return full[tuple(slice(start, stop) for start, stop in bounds)].clone(memory_format=torch.contiguous_format)


def reduce_stacked(stacked: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce dim 0 with a layout reduce op (avg is the sum divided by the count)."""
    if op == "sum":
        return stacked.sum(0, dtype=stacked.dtype)
    if op == "avg":
        if stacked.is_floating_point() or stacked.is_complex():
            return stacked.sum(0) / stacked.shape[0]
        raise ReshardError(f"cannot average a tensor of {stacked.dtype} exactly")
    if stacked.is_complex() and op in ("max", "min"):
        raise ReshardError(f"complex values have no order: a '{op}' partial of {stacked.dtype} means nothing")
    if op == "max":
        return stacked.amax(0)
    if op == "min":
        return stacked.amin(0)
    raise ReshardError(f"unknown reduce op '{op}'")


def global_shape(pieces_by_rank: Mapping[int, torch.Tensor], layout: Layout) -> tuple[int, ...]:
    """The full shape the pieces describe: per dim, the lengths of the distinct pieces
    along the axes that split it, summed."""
    mesh = layout.mesh
    _check_ranks(pieces_by_rank, layout)
    ndim = pieces_by_rank[mesh.ranks[0]].dim()
    if ndim != layout.ndim:
        raise ReshardError(f"layout '{layout}' describes a {layout.ndim}-d tensor but the pieces have {ndim} dims")
    shape = []
    for d, axes in enumerate(layout.dims):
        length = 0
        for position in itertools.product(*(range(mesh.shape[a]) for a in axes)):
            coordinate = [0] * mesh.ndim
            for a, c in zip(axes, position, strict=True):
                coordinate[a] = c
            length += pieces_by_rank[mesh.rank_at(tuple(coordinate))].shape[d]
        shape.append(length)
    return tuple(shape)


def _check_ranks(pieces_by_rank: Mapping[int, torch.Tensor], layout: Layout) -> None:
    ranks = set(layout.mesh.ranks)
    if set(pieces_by_rank) != ranks:
        missing, extra = sorted(ranks - set(pieces_by_rank)), sorted(set(pieces_by_rank) - ranks)
        raise ReshardError(
            f"pieces for '{layout}' must be given for exactly the mesh's ranks "
            f"(missing {missing}, not in the mesh {extra})"
        )


def check_pieces(pieces_by_rank: Mapping[int, torch.Tensor], layout: Layout, shape: tuple[int, ...]) -> None:
    """A :class:`ReshardError` unless every rank of the mesh has a piece of its true shape
    and all pieces share one dtype."""
    _check_ranks(pieces_by_rank, layout)
    dtypes = {p.dtype for p in pieces_by_rank.values()}
    if len(dtypes) != 1:
        raise ReshardError(f"the pieces of '{layout}' mix dtypes {sorted(map(str, dtypes))}")
    for rank, piece in pieces_by_rank.items():
        expected = layout.rank_piece(shape, rank).shape
        if tuple(piece.shape) != expected:
            raise ReshardError(
                f"rank {rank} holds a piece of shape {list(piece.shape)}, but '{layout}' gives it "
                f"{list(expected)} of {list(shape)}"
            )


def unshard(pieces_by_rank: Mapping[int, torch.Tensor], layout: Layout) -> torch.Tensor:
    """The full tensor that every rank's piece in ``layout`` describes (pending reductions
    applied in ascending mesh-axis order)."""
    mesh = layout.mesh
    shape = global_shape(pieces_by_rank, layout)
    check_pieces(pieces_by_rank, layout, shape)
    dtype = pieces_by_rank[mesh.ranks[0]].dtype
    work_dtype = torch.float64 if dtype.is_floating_point else torch.complex128 if dtype.is_complex else dtype
    split_axes = [a for axes in layout.dims for a in axes]
    partial_axes = [a for a, _ in layout.partial]
    addends = []
    for partial_position in itertools.product(*(range(mesh.shape[a]) for a in partial_axes)):
        full = torch.empty(shape, dtype=work_dtype)
        for split_position in itertools.product(*(range(mesh.shape[a]) for a in split_axes)):
            coordinate = [0] * mesh.ndim
            for a, c in zip(split_axes + partial_axes, split_position + partial_position, strict=True):
                coordinate[a] = c
            bounds = layout.piece(shape, tuple(coordinate))
            full[tuple(slice(start, stop) for start, stop in bounds)] = pieces_by_rank[mesh.rank_at(tuple(coordinate))]
        addends.append(full)
    if not partial_axes:
        return addends[0].to(dtype)
    # Stacked with the lowest partial axis outermost, so reducing dim 0 repeatedly reduces
    # the axes in ascending order.
    result = torch.stack(addends).unflatten(0, [mesh.shape[a] for a in partial_axes])
    for _, op in layout.partial:
        result = reduce_stacked(result, op)
    return result.to(dtype)
