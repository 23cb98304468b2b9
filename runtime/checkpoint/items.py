"""What the calling rank stores or reads: every tensor as a list of boxes of the global tensor.

A checkpoint keeps values in global coordinates, whatever layout held them, so that any other
layout can read them back:

- a tensor in a layout is the box ``Layout.rank_piece`` of each rank; of the ranks holding
  the same box (replicas: they differ only on mesh axes that split no dim), exactly one
  stores it, chosen by the tensor's name so that replicated tensors spread over the replicas;
- a flat chunk (flat ZeRO over axis ``a``) is a range of the row-major order of the block the
  rank holds without ``a``; it is stored as the boxes that range covers (``Box.flat_range``);
- CAME's row and column statistics are tensors of their own (``[*batch, H]`` and
  ``[*batch, W]``), in the layouts the optimizer gives them;
- a partial layout is never stored as addends: the tensor is reduced first (resharded to the
  layout whose dim 0 is also split over the partial axes: a reduce-scatter) and its value
  stored. Loaded into a partial layout, the value goes where ``runtime.shard`` puts it: at
  coordinate 0 of every ``sum`` axis (zeros elsewhere), everywhere for ``avg``, ``max``, ``min``.

Keys: a tensor given by name and a parameter of an optimizer are stored under their names,
an optimizer state under :func:`state_key`.
"""

from __future__ import annotations

import datetime
import math
import zlib
from collections.abc import Mapping

import attrs
import torch

from runtime.checkpoint.errors import CheckpointError
from runtime.execution.executor import reshard
from runtime.memory.dtypes import dtype_name
from runtime.optim.base import StateWhere
from shardlang.box import Box
from shardlang.errors import ShardlangError
from shardlang.layout import Layout


@attrs.frozen(eq=False)
class LocalPiece:
    """The calling rank's piece ``tensor`` of a global tensor of ``shape`` in ``layout``;
    ``None`` on ranks outside the layout's mesh. Saving stores it; loading fills it in place."""

    tensor: torch.Tensor | None
    layout: Layout
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(n) for n in s))


@attrs.frozen(eq=False)
class Item:
    """One stored tensor as the calling rank holds it (save) or needs it (load). ``data``
    (saved data, or a new buffer that reading fills) holds the row-major elements of
    ``boxes`` one box after the other; ``stores``: this rank is the replica that writes them."""

    key: str
    layout: Layout  # its mesh anonymous (as stored); for a flat chunk that of its block
    flat_axis: str | None
    shape: tuple[int, ...]
    dtype: str
    boxes: tuple[Box, ...]
    data: torch.Tensor
    stores: bool = False

    def header(self) -> dict[str, object]:
        return {"layout": str(self.layout), "flat_axis": self.flat_axis, "shape": list(self.shape), "dtype": self.dtype}


def state_key(tensor: str, state: str) -> str:
    return f"optimizer/{tensor}/{state}"


def stored_layout(layout: Layout) -> Layout:
    """The layout as a checkpoint stores it: over its mesh without the declared name, so that
    its text stands alone and ranks with differently named meshes of one grid agree."""
    return attrs.evolve(layout, mesh=layout.mesh.anonymous())


def stores(key: str, layout: Layout, replicated: tuple[int, ...] | frozenset[int], rank: int) -> bool:
    """Whether ``rank`` is the one of its replicas (ranks differing only on ``replicated``
    axes) that stores the tensor ``key``."""
    mesh = layout.mesh
    axes = sorted(replicated)
    copies = math.prod(mesh.shape[a] for a in axes)
    if copies == 1:
        return True
    coordinate = mesh.coordinate(rank)
    index = 0
    for a in axes:
        index = index * mesh.shape[a] + coordinate[a]
    return index == zlib.crc32(key.encode()) % copies


# --- tensors in a layout -----------------------------------------------------------------
def check_piece(key: str, piece: LocalPiece, rank: int) -> bool:
    """Whether ``rank`` holds a piece of the tensor; a :class:`CheckpointError` unless it
    passes a tensor of its piece's shape exactly when it is in the layout's mesh."""
    if not isinstance(piece, LocalPiece):
        raise CheckpointError(f"tensor '{key}': expected a LocalPiece, got {type(piece).__name__}")
    inside = rank in piece.layout.mesh.ranks
    if not inside:
        if piece.tensor is not None:
            raise CheckpointError(
                f"tensor '{key}': rank {rank} is not in {piece.layout.mesh.describe()} and holds no piece; pass None"
            )
        return False
    if piece.tensor is None:
        raise CheckpointError(f"tensor '{key}': rank {rank} is in {piece.layout.mesh.describe()}; pass its piece")
    try:
        expected = piece.layout.rank_piece(piece.shape, rank).shape
        dtype_name(piece.tensor.dtype)
    except ShardlangError as e:
        raise CheckpointError(f"tensor '{key}': {e.message}") from None
    if tuple(piece.tensor.shape) != expected:
        raise CheckpointError(
            f"tensor '{key}': rank {rank} passes a piece of shape {list(piece.tensor.shape)}, but "
            f"'{piece.layout}' gives it {list(expected)} of {list(piece.shape)}"
        )
    return True


def resolved(key: str, piece: LocalPiece, rank: int, timeout: datetime.timedelta) -> LocalPiece:
    """The same tensor in a layout without pending reductions (see the module doc); every
    rank of the mesh takes part in the reduce-scatter."""
    layout = piece.layout
    if not layout.is_partial:
        return piece
    mesh = layout.mesh
    reduced = tuple(a for a, _ in layout.partial if mesh.shape[a] > 1)
    dims = layout.dims if not layout.dims else ((*layout.dims[0], *reduced), *layout.dims[1:])
    target = Layout(dims=dims, mesh=mesh)
    if not reduced:  # partial over axes of one rank: every local value is the value
        return LocalPiece(piece.tensor, target, piece.shape)
    local = None
    if piece.tensor is not None:
        local = reshard(piece.tensor, layout, target, global_shape=piece.shape, timeout=timeout, name=key)
    return LocalPiece(local, target, piece.shape)


def _block_item(key: str, layout: Layout, shape: tuple[int, ...], data: torch.Tensor, rank: int) -> Item:
    """``data``, the rank's block of a tensor of ``shape`` in ``layout`` (not partial)."""
    return Item(
        key=key,
        layout=stored_layout(layout),
        flat_axis=None,
        shape=shape,
        dtype=dtype_name(data.dtype),
        boxes=(layout.rank_piece(shape, rank),),
        data=data,
        stores=stores(key, layout, layout.replicated_axes(), rank),
    )


def saved_piece(key: str, piece: LocalPiece, rank: int) -> Item:
    assert piece.tensor is not None and not piece.layout.is_partial
    return _block_item(key, piece.layout, piece.shape, piece.tensor, rank)


def wanted_piece(key: str, piece: LocalPiece, rank: int) -> Item:
    """The boxes ``rank`` reads for its piece: none on a nonzero coordinate of a sum axis."""
    layout = piece.layout
    assert piece.tensor is not None
    coordinate = layout.mesh.coordinate(rank)
    summed_away = any(op == "sum" and coordinate[a] != 0 for a, op in layout.partial)
    data = torch.zeros_like(piece.tensor, device="cpu", memory_format=torch.contiguous_format)
    return Item(
        key=key,
        layout=stored_layout(layout),
        flat_axis=None,
        shape=piece.shape,
        dtype=dtype_name(piece.tensor.dtype),
        boxes=() if summed_away else (layout.rank_piece(piece.shape, rank),),
        data=data,
    )


# --- optimizer states --------------------------------------------------------------------
def state_item(key: str, where: StateWhere, tensor_shape: tuple[int, ...], data: torch.Tensor, rank: int) -> Item:
    """An optimizer state (``data``: its local data, saved or to be filled) lying ``where``
    says; ``tensor_shape`` is its parameter's (what a flat chunk is a part of)."""
    layout = where.layout
    if where.flat_of is None:
        return _block_item(key, layout, where.shape, data, rank)
    (axis,) = layout.dims[0]
    ((lo, hi),) = layout.rank_piece(where.shape, rank)
    block = where.flat_of.rank_piece(tensor_shape, rank)
    return Item(
        key=key,
        layout=stored_layout(where.flat_of),
        flat_axis=layout.mesh.axis_label(axis),
        shape=tensor_shape,
        dtype=dtype_name(data.dtype),
        boxes=block.flat_range(lo, hi),
        data=data,
        stores=stores(key, where.flat_of, frozenset(where.flat_of.replicated_axes()) - {axis}, rank),
    )


def param_groups_json(groups: list[dict[str, object]]) -> list[dict[str, object]]:
    """An optimizer's param groups (hyperparameters and parameter names) as JSON values."""
    out = []
    for i, group in enumerate(groups):
        entry = {}
        for name, value in group.items():
            if name == "params":
                continue
            if isinstance(value, tuple):
                value = list(value)
            if not _is_json(value):
                raise CheckpointError(
                    f"hyperparameter '{name}' of param group {i} is a {type(value).__name__}, which a checkpoint "
                    "cannot store (numbers, strings, booleans, lists only)"
                )
            entry[name] = value
        out.append(entry)
    return out


def param_groups_from_json(saved: list[Mapping[str, object]], current: list[dict[str, object]]) -> list[dict]:
    """Saved param groups with tuples where the optimizer has tuples (JSON has only lists)."""
    out = []
    for group, now in zip(saved, current, strict=True):
        out.append(
            {k: tuple(v) if isinstance(now.get(k), tuple) and isinstance(v, list) else v for k, v in group.items()}
        )
    return out


def _is_json(value: object) -> bool:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list):
        return all(_is_json(v) for v in value)
    return False
