"""CAME's and Adafactor's statistics, torch-free: over which mesh axes each of their partial
sums is partial (:class:`FactoredAxes`, which ``runtime.optim.shards.StateShard`` is too), the
all-reduces that complete a phase's sums (:func:`group_sums`, which
``runtime.optim.sums.plan_collectives`` runs), and the bytes the statistics keep between steps
(:func:`statistics_bytes`, a part of ``planner.memory.rank_memory``'s scratch; docs/memory.md,
"Statistics").

A tensor of shape ``[*batch, H, W]`` is a batch of ``H x W`` matrices (factored: two dims or
more). The axes splitting dim -1 leave row sums partial, those splitting dim -2 column sums, and
a flat axis both; batch axes never mix matrices.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Sequence
from typing import Protocol

import attrs

from shardlang.dtypes import itemsize
from shardlang.layout import Layout
from shardlang.mesh import Mesh

Axes = frozenset[int]
# What a run's per-element indices of its statistics are (``runtime.optim.came.RunStats``): int32
# while every statistic fits, else int64.
INDEX_LIMIT = 2**31 - 1


class FactoredAxes:
    """The statistics of a rank's part of a tensor, from ``layout`` (the state layout, without
    the flat axis), ``flat_axis`` (an index into its mesh, or ``None``) and ``block_shape`` (the
    rank's block of that layout, which a flat chunk is cut from)."""

    layout: Layout
    flat_axis: int | None
    block_shape: tuple[int, ...]

    @property
    def factored(self) -> bool:
        return len(self.block_shape) >= 2

    @property
    def row_stat_shape(self) -> tuple[int, ...]:
        """``[*batch, h]`` of the block: the rows whose statistics this rank keeps."""
        return self.block_shape[:-1]

    @property
    def col_stat_shape(self) -> tuple[int, ...]:
        return self.block_shape[:-2] + self.block_shape[-1:]

    def _dim_axes(self, dims: slice) -> Axes:
        return frozenset(a for axes in self.layout.dims[dims] for a in axes)

    @property
    def _flat(self) -> Axes:
        return frozenset() if self.flat_axis is None else frozenset({self.flat_axis})

    @property
    def row_axes(self) -> Axes:
        """Axes splitting the rows (dim -2) of the block."""
        return self._dim_axes(slice(-2, -1))

    @property
    def col_axes(self) -> Axes:
        return self._dim_axes(slice(-1, None))

    @property
    def sum_axes(self) -> Axes:
        """A sum over all local data is partial over these axes."""
        return self._dim_axes(slice(None)) | self._flat

    @property
    def row_sum_axes(self) -> Axes:
        return self.col_axes | self._flat

    @property
    def col_sum_axes(self) -> Axes:
        return self.row_axes | self._flat

    @property
    def matrix_sum_axes(self) -> Axes:
        """A sum over each local matrix (per batch entry) is partial over these axes."""
        return self.row_axes | self.col_axes | self._flat

    @property
    def replicated(self) -> Axes:
        """Axes along which every rank holds the same data."""
        return frozenset(range(self.layout.mesh.ndim)) - self.sum_axes

    @property
    def rows_span_ranks(self) -> bool:
        """Whether the row normaliser needs rows other ranks hold."""
        return any(self.layout.mesh.shape[a] > 1 for a in self.row_axes)

    def factored_sums(self) -> tuple[tuple[Axes, int, Axes], ...]:
        """The sums a factored second moment (CAME's and Adafactor's) completes over the ranks,
        as ``(axes, elements, replicated axes)``: of rows, of columns, and where rows span ranks
        the per-matrix sums of the new and the old row statistics (what the row normaliser
        divides by)."""
        replicated = self.replicated
        sums = [
            (self.row_sum_axes, math.prod(self.row_stat_shape), replicated),
            (self.col_sum_axes, math.prod(self.col_stat_shape), replicated),
        ]
        if self.rows_span_ranks:
            batch = math.prod(self.block_shape[:-2])
            # The old row statistics are the same on every rank along the row-sum axes.
            sums += [(self.matrix_sum_axes, batch, replicated), (self.row_axes, batch, replicated | self.row_sum_axes)]
        return tuple(sums)

    def communicated(self, axes: Axes) -> bool:
        """Whether a sum partial over ``axes`` needs an all-reduce (an axis of size above 1)."""
        return any(self.layout.mesh.shape[a] > 1 for a in axes)


@attrs.frozen
class StatisticsShard(FactoredAxes):
    """A tensor's statistics on one rank, as the planner sizes them (:class:`FactoredAxes`)."""

    layout: Layout
    block_shape: tuple[int, ...]
    flat_axis: int | None = None


class SumLike(Protocol):
    """A partial sum (``runtime.optim.sums.SumSpec``): over ``axes`` of ``mesh``, the same on
    every rank along ``replicated``; ``dtype`` any name of its element type."""

    @property
    def mesh(self) -> Mesh: ...
    @property
    def axes(self) -> Axes: ...
    @property
    def numel(self) -> int: ...
    @property
    def dtype(self) -> Hashable: ...
    @property
    def replicated(self) -> Axes: ...


@attrs.frozen
class Sum:
    """A partial sum as the planner sizes it (:class:`SumLike`, ``dtype`` a language name)."""

    mesh: Mesh
    axes: Axes
    numel: int
    dtype: str
    replicated: Axes = frozenset()


def group_sums(
    sums: Sequence[SumLike], rank: int | None
) -> list[tuple[tuple[int, ...], Hashable, list[tuple[int, bool]]]]:
    """The all-reduces that complete ``sums`` on ``rank``, in an order every rank shares: per
    all-reduce its axes, dtype and sums ``(index into sums, masked)``; a masked sum is sent as
    zeros (``rank`` ``None``: none is). A sum over no axis of size above 1 needs none.
    Otherwise it rides the largest group among those the phase needs anyway that contains its
    axes and adds only axes it is replicated along (``runtime.optim.sums``' module doc)."""

    def real(axes: Axes, mesh: Mesh) -> Axes:
        return frozenset(a for a in axes if mesh.shape[a] > 1)

    def geometry(mesh: Mesh) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return mesh.shape, mesh.ranks

    candidates = sorted(
        {(geometry(s.mesh), tuple(sorted(real(s.axes, s.mesh))), s.dtype) for s in sums if real(s.axes, s.mesh)},
        key=lambda k: (-math.prod(k[0][0][a] for a in k[1]), k[0], k[1], str(k[2])),
    )
    chosen: dict[tuple[object, ...], list[tuple[int, bool]]] = {}
    for i, s in enumerate(sums):
        axes = real(s.axes, s.mesh)
        if not axes:
            continue
        allowed = axes | real(s.replicated, s.mesh)
        key = next(
            k for k in candidates if k[0] == geometry(s.mesh) and k[2] == s.dtype and axes <= set(k[1]) <= allowed
        )
        coordinate = None if rank is None else s.mesh.coordinate(rank)
        masked = coordinate is not None and any(coordinate[a] != 0 for a in set(key[1]) - axes)
        chosen.setdefault(key, []).append((i, masked))
    return [(k[1], k[2], chosen[k]) for k in candidates if k in chosen]


def phase_sums(shard: FactoredAxes, optimizer: str) -> tuple[tuple[tuple[Axes, int, Axes], ...], ...]:
    """Per phase, the sums of a tensor's step (``runtime.optim.came.came_sum_specs``,
    ``runtime.optim.adafactor.adafactor_sum_specs``) as ``(axes, elements, replicated)``."""
    whole = ((shard.sum_axes, 1, shard.replicated),)  # an RMS or a norm: one value
    moments = shard.factored_sums() if shard.factored else ()
    if optimizer == "came":
        return moments, whole, moments
    if optimizer == "adafactor":
        return whole + moments, whole
    return ()


def sum_buffer_bytes(shards: Sequence[tuple[FactoredAxes, str]], optimizer: str, *, clip: bool) -> int:
    """Bytes of the buffers the step's all-reduces of sums keep (``runtime.optim.sums.SumReducer``):
    per phase, every communicated sum of ``shards`` (each with its math's dtype) once, and with
    ``clip`` the gradient norm's (one value per tensor)."""
    total = 0
    # By the shard's identity: the tensors of a group repeat one shard (``planner.memory``).
    known: dict[tuple[int, str], int] = {}
    for shard, dtype in shards:
        key = (id(shard), dtype)
        if key not in known:
            phases = list(phase_sums(shard, optimizer))
            if clip:
                phases.append(((shard.sum_axes, 1, shard.replicated),))
            communicated = sum(n for phase in phases for axes, n, _ in phase if shard.communicated(axes))
            known[key] = communicated * itemsize(dtype)
        total += known[key]
    return total


def came_statistics_bytes(runs: Sequence[tuple[str, Sequence[FactoredAxes]]]) -> int:
    """Bytes CAME keeps for the statistics of the step's runs of tensors (each with its math's
    dtype; ``runtime.optim.came``): per run its ``RunStats`` (per row statistic its matrix, per
    matrix its height, width and whether its rows span ranks, per statistic its count, per tensor
    the root of its size) and its buffers of statistics in scratch (the partial sums of each
    factored phase, the factors, the row normalisers, the squares of the RMS), and the completed
    sums it copies into one range where they do not lie so (:func:`_scattered`). Adafactor keeps
    none (its statistics are temporaries of each tensor's math)."""
    copied = _scattered(runs)
    total = 0
    for (dtype, shards), copies in zip(runs, copied, strict=True):
        size, wide = itemsize(dtype), max(itemsize(dtype), 4)
        factored = [s for s in shards if s.factored]
        rows = sum(math.prod(s.row_stat_shape) for s in factored)
        cols = sum(math.prod(s.col_stat_shape) for s in factored)
        matrices = sum(math.prod(s.block_shape[:-2]) for s in factored)
        index = 4 if max(rows, cols, matrices) < INDEX_LIMIT else 8
        total += (rows + 1) * index + (matrices + 1 + len(shards)) * size + matrices
        total += (rows + cols + 2 * matrices) * wide
        scratch = len(shards)  # the squares of the updates (the RMS phase)
        if factored:
            spans = any(s.rows_span_ranks for s in factored)
            scratch += 2 * (rows + cols + 2 + (2 * matrices + 2 if spans else 0))  # per factored phase
            scratch += rows + cols + matrices + 3  # the factors of rows and columns, the row normalisers
            scratch += sum((rows, cols, matrices, matrices)[kind] + 1 for kind in copies)
        total += scratch * size
    return total


def _scattered(runs: Sequence[tuple[str, Sequence[FactoredAxes]]]) -> list[list[int]]:
    """Per run, which kinds of completed sums of its matrices (0 rows, 1 columns, 2 totals, 3
    old rows: the last two of the matrices whose rows span ranks) CAME copies into a buffer of
    their own: all but those that lie one after another in one memory, the run's buffer of
    partial sums (none communicated) or one all-reduce's (whose sums lie in the phase's order:
    by tensor its rows, columns, totals, old rows; :func:`group_sums`)."""
    sums = [
        (r, kind, Sum(shard.layout.mesh, axes, n, dtype, replicated))
        for r, (dtype, shards) in enumerate(runs)
        for shard in shards
        if shard.factored
        for kind, (axes, n, replicated) in enumerate(shard.factored_sums())
    ]
    place: dict[int, tuple[int, int]] = {}  # per communicated sum: its all-reduce and offset there
    for g, (_, _, members) in enumerate(group_sums([s for *_, s in sums], None)):
        offset = 0
        for i, _ in members:
            place[i] = (g, offset)
            offset += sums[i][2].numel
    out = []
    for r, (_, shards) in enumerate(runs):
        spanning = [s.rows_span_ranks for s in shards if s.factored]
        copies = []
        for kind in range(4 if any(spanning) else 2):
            mine = [i for i, (run, k, s) in enumerate(sums) if run == r and k == kind and s.numel]
            if kind < 2 and not any(i in place for i in mine):
                continue  # views of the run's partial sums, one after another
            flat = all(i in place for i in mine) and len({place[i][0] for i in mine}) <= 1
            flat = flat and all(place[b][1] == place[a][1] + sums[a][2].numel for a, b in itertools.pairwise(mine))
            if not (flat and (kind < 2 or all(spanning))):
                copies.append(kind)
        out.append(copies)
    return out
