"""Pieces of a layout as numpy arrays: the vectorized form of ``planner.holdings.Blocks``.

Per tensor dim, the nonempty intervals its axes cut (nested, as ``Layout.piece`` cuts it) with
the part of the mesh position their coordinates make; the offsets of the axes that split no
dim; and the map between mesh positions and global ranks. From these, the ranks holding a
nonempty piece, each position's block, and the table of a point-to-point exchange
(:func:`exchange_table`) are a few array operations per dim, however many ranks there are:
what point-to-point patterns (``planner.pattern``) and their pricing (``planner.p2p``) are
computed from. numpy is imported with this module, which only point-to-point planning loads
(the planning commands start without it: tests/test_startup.py).
"""

from __future__ import annotations

import functools
import math

import attrs
import numpy as np

from shardlang.box import row_major_strides
from shardlang.layout import Layout
from shardlang.mesh import StridedRanks

Array = np.ndarray


def _expand(counts: Array) -> tuple[Array, Array]:
    """For entries with ``counts[i]`` children each: per child, its entry and its index among its
    entry's children (entries in order, children ascending)."""
    entry = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts
    return entry, np.arange(len(entry)) - starts[entry]


@attrs.frozen(eq=False)
class DimCut:
    """The nonempty intervals ``[lo, hi)`` of one dim, ascending, and each one's part of the mesh position."""

    lo: Array
    hi: Array
    offset: Array

    def __len__(self) -> int:
        return len(self.lo)

    def overlapping(self, lo: Array, hi: Array) -> tuple[Array, Array]:
        """Per nonempty interval ``[lo, hi)``: the first interval of this cut sharing elements with
        it and how many do (the cut covers the dim, so they are consecutive)."""
        first = np.maximum(np.searchsorted(self.lo, lo, side="right") - 1, 0)
        last = np.searchsorted(self.lo, hi, side="left")
        return first, last - first


def dim_cut(length: int, axes: tuple[int, ...], sizes: tuple[int, ...], strides: tuple[int, ...]) -> DimCut:
    """The nonempty intervals ``axes`` cut a dim of ``length`` into (``holdings._dim_pieces``, as arrays)."""
    lo = np.zeros(1 if length else 0, dtype=np.int64)
    hi = np.full(len(lo), length, dtype=np.int64)
    offset = np.zeros(len(lo), dtype=np.int64)
    for a in axes:
        span = hi - lo
        size = -(-span // sizes[a])
        entry, c = _expand(-(-span // size))
        lo, hi, offset = (
            lo[entry] + c * size[entry],
            np.minimum(lo[entry] + (c + 1) * size[entry], hi[entry]),
            offset[entry] + c * strides[a],
        )
    return DimCut(lo, hi, offset)


class Pieces:
    """A layout's pieces for one tensor shape (module docstring). ``cuts[d]``: dim ``d``'s
    :class:`DimCut`; ``free``: the position offsets of the axes that split no dim, ascending (a
    block's holders are its base position plus each, in mesh order)."""

    def __init__(self, layout: Layout, shape: tuple[int, ...]) -> None:
        mesh = layout.mesh
        self.layout, self.shape = layout, shape
        self.sizes, self.strides = mesh.shape, row_major_strides(mesh.shape)
        self.cuts = tuple(
            dim_cut(length, axes, self.sizes, self.strides) for length, axes in zip(shape, layout.dims, strict=True)
        )
        free = np.zeros(1, dtype=np.int64)
        splitting = {a for axes in layout.dims for a in axes}
        for a in range(mesh.ndim):
            if a not in splitting:
                free = (free[:, None] + np.arange(mesh.shape[a]) * self.strides[a]).reshape(-1)
        self.free = np.sort(free)
        # Block ids: the per-dim interval indices, mixed radix (ascending id = ascending box).
        self.radix = tuple(math.prod(len(c) for c in self.cuts[d + 1 :]) for d in range(len(shape)))
        ranks = mesh.ranks
        self._strided = (ranks.start, ranks.step) if isinstance(ranks, StridedRanks) else None
        self._ranks = None if self._strided else np.asarray(ranks, dtype=np.int64)
        self._sorted = None

    @property
    def holders_per_block(self) -> int:
        return len(self.free)

    def rank_of(self, positions: Array) -> Array:
        if self._strided is not None:
            start, step = self._strided
            return start + positions * step
        return self._ranks[positions]

    def position_of(self, ranks: Array) -> Array:
        """Each global rank's mesh position, -1 off the mesh."""
        n = math.prod(self.sizes)
        if self._strided is not None:
            start, step = self._strided
            rel = ranks - start
            position = rel // step
            inside = (rel >= 0) & (rel % step == 0) & (position < n)
            return np.where(inside, position, -1)
        if self._sorted is None:
            order = np.argsort(self._ranks, kind="stable")
            self._sorted = (self._ranks[order], order)
        values, order = self._sorted
        at = np.minimum(np.searchsorted(values, ranks), max(n - 1, 0))
        return np.where(values[at] == ranks, order[at], -1) if n else np.full(len(ranks), -1)

    def intervals(self, positions: Array) -> tuple[list[Array], list[Array]]:
        """Per dim, ``lo`` and ``hi`` of the piece at each mesh position (``Layout.piece``, vectorized)."""
        los, his = [], []
        for length, axes in zip(self.shape, self.layout.dims, strict=True):
            lo = np.zeros(len(positions), dtype=np.int64)
            hi = np.full(len(positions), length, dtype=np.int64)
            for a in axes:
                c = (positions // self.strides[a]) % self.sizes[a]
                span = hi - lo
                size = -(-span // self.sizes[a])
                lo, hi = lo + np.minimum(c * size, span), lo + np.minimum((c + 1) * size, span)
            los.append(lo)
            his.append(hi)
        return los, his

    def block_of(self, positions: Array) -> Array:
        """The block id of each mesh position's piece; -1 for an empty piece or a position of -1."""
        los, his = self.intervals(np.maximum(positions, 0))
        block = np.zeros(len(positions), dtype=np.int64)
        empty = positions < 0
        for cut, lo, hi, radix in zip(self.cuts, los, his, self.radix, strict=True):
            empty |= hi <= lo
            block += np.searchsorted(cut.lo, lo) * radix if len(cut) else 0
        return np.where(empty, -1, block)

    def holders(self) -> tuple[Array, list[Array]]:
        """The positions holding a nonempty piece, ascending, and per dim each one's interval index."""
        base = np.zeros(1, dtype=np.int64)
        per_dim: list[Array] = []
        for cut in self.cuts:
            per_dim = [np.repeat(i, len(cut)) for i in per_dim]
            per_dim.append(np.tile(np.arange(len(cut)), len(base)))
            base = (base[:, None] + cut.offset[None, :]).reshape(-1)
        positions = (base[:, None] + self.free[None, :]).reshape(-1)
        per_dim = [np.repeat(i, len(self.free)) for i in per_dim]
        order = np.argsort(positions, kind="stable")
        return positions[order], [i[order] for i in per_dim]

    def base(self, per_dim: list[Array]) -> Array:
        """The first holder's position of the blocks with these per-dim interval indices."""
        out = np.zeros(len(per_dim[0]) if per_dim else 1, dtype=np.int64)
        for cut, index in zip(self.cuts, per_dim, strict=True):
            out = out + cut.offset[index]
        return out


@functools.lru_cache(maxsize=64)
def pieces_of(layout: Layout, shape: tuple[int, ...]) -> Pieces:
    return Pieces(layout, shape)


@attrs.frozen(eq=False)
class ExchangeTable:
    """Every transfer of a point-to-point exchange, one row each, in the order of the explicit
    list (receivers in target mesh order, then source blocks ascending): ``sender`` and
    ``receiver`` (global ranks), ``receiver_position`` (in the target mesh), ``block`` (the source
    block id), ``lo``/``hi`` per dim (the box) and ``source``/``target`` per dim as interval
    indices of the sender's and the receiver's pieces."""

    sender: Array
    receiver: Array
    receiver_position: Array
    block: Array
    lo: list[Array]
    hi: list[Array]
    source: list[Array]
    target: list[Array]

    @property
    def numel(self) -> Array:
        out = np.ones(len(self.sender), dtype=np.int64)
        for lo, hi in zip(self.lo, self.hi, strict=True):
            out = out * (hi - lo)
        return out


def cyclic_senders_hold(before: Layout, after: Layout, shape: tuple[int, ...]) -> bool:
    """Whether every source block's messages all have one size, or it has one holder: then the
    planner's largest-first choice of senders (``planner.p2p``) is the round robin
    :func:`exchange_table` makes, given links that do not tell holders apart."""
    source, target = pieces_of(before, shape), pieces_of(after, shape)
    if source.holders_per_block == 1:
        return True
    for s, t in zip(source.cuts, target.cuts, strict=True):
        first, count = t.overlapping(s.lo, s.hi)
        if not len(first):
            continue
        entry, k = _expand(count)
        index = first[entry] + k
        length = np.minimum(t.hi[index], s.hi[entry]) - np.maximum(t.lo[index], s.lo[entry])
        least = np.minimum.reduceat(length, np.cumsum(count) - count)
        most = np.maximum.reduceat(length, np.cumsum(count) - count)
        if (least != most).any():
            return False
    return True


def exchange_rows(before: Layout, after: Layout, shape: tuple[int, ...]) -> int:
    """How many rows :func:`exchange_table` makes (the transfers, local copies included), from the cuts."""
    source, target = pieces_of(before, shape), pieces_of(after, shape)
    rows = target.holders_per_block
    for s, t in zip(source.cuts, target.cuts, strict=True):
        rows *= int(s.overlapping(t.lo, t.hi)[1].sum())
    return rows


def exchange_table(before: Layout, after: Layout, shape: tuple[int, ...]) -> ExchangeTable:
    """The transfers of the point-to-point exchange ``before -> after`` (neither partial): per
    target rank holding a nonempty piece and per source block overlapping it, the overlap, from
    the rank itself when it holds that block, else from the block's holders in turn (round robin
    in mesh order, over its messages in target mesh order: ``planner.pattern``)."""
    source, target = pieces_of(before, shape), pieces_of(after, shape)
    positions, target_index = target.holders()
    per_receiver = np.ones(len(positions), dtype=np.int64)
    ranges = []
    for s, t, index in zip(source.cuts, target.cuts, target_index, strict=True):
        first, count = (x[index] for x in s.overlapping(t.lo, t.hi))  # per interval, then per rank
        ranges.append((first, count))
        per_receiver = per_receiver * count
    row, k = _expand(per_receiver)
    source_index: list[Array] = [np.empty(0, dtype=np.int64)] * len(ranges)
    for d in reversed(range(len(ranges))):
        first, count = ranges[d]
        source_index[d] = first[row] + k % count[row]
        k = k // count[row]
    target_rows = [index[row] for index in target_index]
    block = np.zeros(len(row), dtype=np.int64)
    for index, radix in zip(source_index, source.radix, strict=True):
        block = block + index * radix
    lo = [
        np.maximum(s.lo[i], t.lo[j])
        for s, t, i, j in zip(source.cuts, target.cuts, source_index, target_rows, strict=True)
    ]
    hi = [
        np.minimum(s.hi[i], t.hi[j])
        for s, t, i, j in zip(source.cuts, target.cuts, source_index, target_rows, strict=True)
    ]
    receiver_position = positions[row]
    receiver = target.rank_of(receiver_position)
    local = source.block_of(source.position_of(receiver)) == block
    # Remote rows, grouped by block (stably: in target order within a block): the j-th goes to holder j mod m.
    remote = np.flatnonzero(~local)
    order = remote[np.argsort(block[remote], kind="stable")]
    grouped = block[order]
    starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]]) if len(order) else np.empty(0, dtype=np.int64)
    group = np.cumsum(np.r_[0, (grouped[1:] != grouped[:-1]).astype(np.int64)]) if len(order) else grouped
    turn = np.arange(len(order)) - starts[group] if len(order) else grouped
    sender = receiver.copy()
    holder = source.base([i[order] for i in source_index]) + source.free[turn % source.holders_per_block]
    sender[order] = source.rank_of(holder)
    return ExchangeTable(sender, receiver, receiver_position, block, lo, hi, source_index, target_rows)


def is_run(piece_lo: list[Array], piece_hi: list[Array], lo: list[Array], hi: list[Array]) -> Array:
    """Per row, whether the box ``lo, hi`` is one contiguous run of the piece ``piece_lo, piece_hi``
    (``Box.is_run``: every dim before the innermost one the box does not cover whole has length 1)."""
    rows = len(lo[0]) if lo else 0
    run = np.ones(rows, dtype=bool)
    thin_before = [np.ones(rows, dtype=bool)]  # thin_before[d]: every dim before d has length 1
    for low, high in zip(lo, hi, strict=True):
        thin_before.append(thin_before[-1] & (high - low == 1))
    whole_after = np.ones(rows, dtype=bool)  # every dim after d covered whole
    for d in reversed(range(len(lo))):
        covered = (lo[d] == piece_lo[d]) & (hi[d] == piece_hi[d])
        run &= covered | ~whole_after | thin_before[d]
        whole_after &= covered
    return run


def copied_elements(before: Layout, after: Layout, shape: tuple[int, ...], table: ExchangeTable) -> tuple[Array, Array]:
    """Per rank that copies, the elements an exchange's table makes it copy locally
    (``planner.copies.exchange_copy_elements``, vectorized): every box it keeps, and each message
    (one box per rank pair: a sender holds one block) on each side where the box is not one run
    of that side's piece. Ranks ascending, and their elements."""
    source, target = pieces_of(before, shape), pieces_of(after, shape)
    numel = table.numel
    local = table.sender == table.receiver
    source_lo = [c.lo[i] for c, i in zip(source.cuts, table.source, strict=True)]
    source_hi = [c.hi[i] for c, i in zip(source.cuts, table.source, strict=True)]
    target_lo = [c.lo[i] for c, i in zip(target.cuts, table.target, strict=True)]
    target_hi = [c.hi[i] for c, i in zip(target.cuts, table.target, strict=True)]
    packed = ~local & ~is_run(source_lo, source_hi, table.lo, table.hi)
    placed = ~local & ~is_run(target_lo, target_hi, table.lo, table.hi)
    ranks = np.concatenate([table.receiver[local], table.sender[packed], table.receiver[placed]])
    counts = np.concatenate([numel[local], numel[packed], numel[placed]])
    unique, inverse = np.unique(ranks, return_inverse=True)
    return unique, np.bincount(inverse, weights=counts, minlength=len(unique)).astype(np.int64)


def distinct_rows(rows: Array) -> list[tuple[int, ...]]:
    """The distinct rows of a 2-d integer array, as tuples (by one sort: ``np.unique(axis=0)`` is slower)."""
    if not len(rows):
        return []
    ordered = rows[np.lexsort(rows.T[::-1])]
    first = np.r_[True, (ordered[1:] != ordered[:-1]).any(axis=1)]
    return [tuple(row) for row in ordered[first].tolist()]


def near_largest(estimate: Array) -> Array:
    """The rows whose float ``estimate`` (of an exact integer figure, e.g. a time in the
    planner's integer units) is within a millionth of the largest: among them is every row
    whose exact figure is largest, which the caller then computes exactly on these rows alone."""
    if not len(estimate):
        return np.empty(0, dtype=np.int64)
    return np.flatnonzero(estimate >= estimate.max() * (1 - 1e-6))


def target_needs(
    before: Layout, after: Layout, shape: tuple[int, ...], held: bool = True
) -> tuple[Array, Array, Array]:
    """Per rank holding a nonempty target piece: how many source blocks overlap its piece, its
    elements, and how many of them it holds in its source piece (0 unless ``held``: a source
    that holds no final values holds nothing)."""
    source, target = pieces_of(before, shape), pieces_of(after, shape)
    positions, index = target.holders()
    held_at = source.position_of(target.rank_of(positions)) if held else np.full(len(positions), -1)
    held_lo, held_hi = source.intervals(np.maximum(held_at, 0))
    messages = np.ones(len(positions), dtype=np.int64)
    elements = np.ones(len(positions), dtype=np.int64)
    kept = (held_at >= 0).astype(np.int64)
    for s, t, i, lo, hi in zip(source.cuts, target.cuts, index, held_lo, held_hi, strict=True):
        messages = messages * s.overlapping(t.lo, t.hi)[1][i]  # per interval, then per rank
        elements = elements * (t.hi[i] - t.lo[i])
        kept = kept * np.maximum(np.minimum(hi, t.hi[i]) - np.maximum(lo, t.lo[i]), 0)
    return messages, elements, kept
