"""What each rank holds of a global tensor, what a target rank lacks, and the receive lower bound.

A layout cuts every tensor dim into intervals (``Layout.piece``): the leaves of its nested
``torch.chunk`` splits, which are disjoint and cover the dim. A block is one interval per dim;
every combination occurs, distinct blocks are disjoint and together they cover the tensor.
The ranks that differ only on axes splitting no dim hold the same block: its holders.

Receive lower bound: a target rank must receive every element of its target piece that it
does not already hold. It holds an element when it is in the source mesh, the element is in
its source piece, and the source holds final values (no pending reduction over an axis of size
greater than 1). The bound of a pair is the largest, over the target ranks, of those bytes;
where the layouts' structure decides it, it is computed from that, whatever the rank count
(:func:`structural_receive_lower_bound`).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Iterator, Sequence

from shardlang.box import Box, row_major_strides
from shardlang.dtypes import itemsize as dtype_itemsize
from shardlang.layout import Layout


def holds_values(layout: Layout) -> bool:
    """Whether each rank's piece holds final values: no pending reduction over an axis of size > 1."""
    return all(layout.mesh.shape[axis] == 1 for axis, _ in layout.partial)


class Blocks:
    """The nonempty blocks of a layout for one tensor shape, with their holders.

    ``intervals[d]``: the distinct nonempty intervals of dim ``d``, ascending. ``holders[box]``:
    the ranks holding block ``box``, in mesh order. ``of_rank[rank]``: each rank's block, for the
    ranks that hold a nonempty one, in mesh order.

    Built from the mesh's structure, not rank by rank: per dim, the nonempty intervals its axes
    cut and the part of the mesh position their coordinates make (:func:`_dim_pieces`); a
    block's holders are then its dims' positions plus every position of the axes that split no
    dim. The work follows the ranks that hold data, not the mesh's size (a 32000-row tensor on
    131,072 ranks lists 32000 holders).
    """

    def __init__(self, layout: Layout, shape: tuple[int, ...]) -> None:
        mesh = layout.mesh
        strides = row_major_strides(mesh.shape)
        per_dim = [
            _dim_pieces(length, axes, mesh.shape, strides) for length, axes in zip(shape, layout.dims, strict=True)
        ]
        splitting = {a for axes in layout.dims for a in axes}
        others = [0]
        for a in range(mesh.ndim):
            if a not in splitting:
                others = [o + c * strides[a] for o in others for c in range(mesh.shape[a])]
        others.sort()
        ranks = mesh.ranks
        found = []
        for combo in itertools.product(*per_dim):
            base = sum(offset for _, offset in combo)
            found.append((base, Box.trusted(interval for interval, _ in combo)))
        found.sort(key=lambda entry: entry[0])
        self.holders: dict[Box, tuple[int, ...]] = {}
        owned = []
        for base, box in found:
            positions = [base + o for o in others]
            self.holders[box] = tuple(ranks[p] for p in positions)
            owned.extend(zip(positions, self.holders[box], itertools.repeat(box)))
        owned.sort(key=lambda entry: entry[0])
        self.of_rank: dict[int, Box] = {rank: box for _, rank, box in owned}
        self.intervals = tuple(tuple(sorted({box[d] for box in self.holders})) for d in range(len(shape)))
        self._starts = tuple(tuple(lo for lo, _ in dim) for dim in self.intervals)

    def _overlapping_intervals(self, box: Box) -> list[list[tuple[int, int]]]:
        """Per dim, the intervals that share elements with ``box`` (none anywhere if it is empty)."""
        if not box.numel:
            return [[] for _ in box]
        per_dim = []
        for (lo, hi), intervals, starts in zip(box, self.intervals, self._starts, strict=True):
            first = max(bisect.bisect_right(starts, lo) - 1, 0)
            last = bisect.bisect_left(starts, hi)
            per_dim.append([iv for iv in intervals[first:last] if iv[1] > lo and iv[0] < hi])
        return per_dim

    def overlapping(self, box: Box) -> Iterator[tuple[Box, Box]]:
        """Each block sharing elements with ``box``, with the shared part: ``(block, part)``, in
        ascending block order. The parts partition ``box``."""
        for block in itertools.product(*self._overlapping_intervals(box)):
            part = ((max(lo, blo), min(hi, bhi)) for (lo, hi), (blo, bhi) in zip(box, block, strict=True))
            yield Box.trusted(block), Box.trusted(part)

    def count_overlapping(self, box: Box) -> int:
        """How many blocks share elements with ``box``."""
        return math.prod(len(dim) for dim in self._overlapping_intervals(box))


def _dim_pieces(
    length: int, axes: Sequence[int], sizes: Sequence[int], strides: Sequence[int]
) -> list[tuple[tuple[int, int], int]]:
    """The nonempty intervals a dim of ``length`` is cut into by ``axes`` (nested, as
    ``Layout.piece`` cuts it), each with the part of the mesh position its axes' coordinates
    make. Only nonempty pieces are visited: a piece cut in ``n`` has ``ceil(len / ceil(len / n))``
    nonempty parts, the first ones (``chunk_bounds``)."""
    pieces = [((0, length), 0)] if length else []
    for a in axes:
        n, stride = sizes[a], strides[a]
        cut = []
        for (start, stop), offset in pieces:
            size = -(-(stop - start) // n)
            for c in range(-(-(stop - start) // size)):
                cut.append(((start + c * size, min(start + (c + 1) * size, stop)), offset + c * stride))
        pieces = cut
    return pieces


def holder_count(layout: Layout, shape: tuple[int, ...]) -> int:
    """How many ranks hold a nonempty piece of ``layout`` (the ranks :class:`Blocks` lists),
    from the piece lengths each dim's cuts make, without listing them: what the planner's
    budget charges before building the blocks."""
    count = 1
    splitting = set()
    for length, axes in zip(shape, layout.dims, strict=True):
        lengths = {length: 1} if length else {}
        for a in axes:
            splitting.add(a)
            n, cut = layout.mesh.shape[a], {}
            for piece, times in lengths.items():
                size = -(-piece // n)
                full, rest = divmod(piece, size)
                cut[size] = cut.get(size, 0) + full * times
                if rest:
                    cut[rest] = cut.get(rest, 0) + times
            lengths = cut
        count *= sum(lengths.values())
    return count * math.prod(n for a, n in enumerate(layout.mesh.shape) if a not in splitting)


# Past this many ranks holding a piece, walks over them are numpy's (``planner.pieces``), which
# small plans do not load (the planning commands start without numpy: tests/test_startup.py).
VECTORIZE_FROM = 1024


@functools.lru_cache(maxsize=1024)
def blocks_of(layout: Layout, shape: tuple[int, ...]) -> Blocks:
    return Blocks(layout, shape)


@functools.lru_cache(maxsize=4096)
def most_missing_bytes(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int) -> int:
    """The most bytes of its target piece a target rank does not hold (module docstring), over
    the target ranks that hold a nonempty piece (the others lack nothing); a partial target's
    piece is the block its rank holds addends of. Walks :class:`Blocks`, not the meshes' ranks;
    past :data:`VECTORIZE_FROM` holders, in numpy (``planner.pieces.target_needs``)."""
    if holder_count(dst, shape) > VECTORIZE_FROM:
        from planner.pieces import target_needs  # numpy: loaded only for many holders

        _, elements, kept = target_needs(src, dst, shape, held=holds_values(src))
        return int((elements - kept).max(initial=0)) * itemsize
    source = blocks_of(src, shape).of_rank if holds_values(src) else {}
    most = 0
    for rank, target in blocks_of(dst, shape).of_rank.items():
        own = source.get(rank)
        held = own.intersect(target) if own is not None else None
        most = max(most, target.numel - (held.numel if held else 0))
    return most * itemsize


def receive_lower_bound(src: Layout, dst: Layout, shape: tuple[int, ...], dtype: str = "f32") -> int:
    """The largest, over target ranks, of the bytes a target rank must receive to go from
    ``src`` to ``dst`` (same mesh or not): any plan has a rank that receives at least this.
    From the layouts' structure where it decides the bound (:func:`structural_receive_lower_bound`,
    no walk over the ranks), else block by block (:func:`most_missing_bytes`)."""
    shape = tuple(int(s) for s in shape)
    found = structural_receive_lower_bound(src, dst, shape, dtype_itemsize(dtype))
    if found is not None:
        return found
    return most_missing_bytes(src, dst, shape, dtype_itemsize(dtype))


def _chunk_lengths(length: int, n: int) -> frozenset[int]:
    """The piece lengths that occur when ``length`` is cut in ``n`` as torch.chunk does
    (``shardlang.layout.chunk_bounds``): full pieces, one remainder, empty ones."""
    size = -(-length // n)
    if size == 0:
        return frozenset({0})
    full = min(length // size, n)
    rest = length - full * size
    out = {size} if full else set()
    if rest and full < n:
        out.add(rest)
    if full + (1 if rest else 0) < n:
        out.add(0)
    return frozenset(out)


def _nested_lengths(length: int, sizes: Sequence[int]) -> frozenset[int]:
    """The piece lengths of a dim cut successively in ``sizes`` parts."""
    lengths = frozenset({length})
    for n in sizes:
        lengths = frozenset(x for piece in lengths for x in _chunk_lengths(piece, n))
    return lengths


def structural_receive_lower_bound(src: Layout, dst: Layout, shape: Sequence[int], itemsize: int) -> int | None:
    """The receive lower bound (module docstring: the most bytes of its target piece a target
    rank lacks) computed from the layouts' structure instead of rank by rank; ``None`` where
    this structure does not decide it (two meshes; an axis splitting different dims in the two
    layouts; a dim that both split over axes neither of which lists the other's as its outer
    ones), and :func:`receive_lower_bound` walks the ranks.

    Each dim then contributes a (target, held) pair of piece lengths that depends only on the
    coordinates of its own axes: the target's piece and, where the source holds final values,
    its intersection with the source's, which is the finer of the two nested pieces. Dims use
    disjoint axes, so every combination of the pairs each dim can show occurs on some rank,
    and the bound is the largest product of targets less the product of helds over them. The
    work is a few lengths per dim and axis, whatever the rank count."""
    if not src.mesh.same_geometry(dst.mesh):
        return None
    holds = all(src.mesh.shape[a] == 1 for a, _ in src.partial)
    used: dict[int, int] = {}
    per_dim: list[frozenset[tuple[int, int]]] = []
    for d, length in enumerate(shape):
        t_axes, s_axes = dst.dims[d], src.dims[d]
        for a in (*t_axes, *s_axes):
            if used.setdefault(a, d) != d:
                return None
        sizes = dst.mesh.shape
        if not holds:
            per_dim.append(frozenset((t, 0) for t in _nested_lengths(length, [sizes[a] for a in t_axes])))
        elif s_axes[: len(t_axes)] == t_axes:  # the source piece lies inside the target's
            pairs = set()
            for t in _nested_lengths(length, [sizes[a] for a in t_axes]):
                pairs.update((t, s) for s in _nested_lengths(t, [sizes[a] for a in s_axes[len(t_axes) :]]))
            per_dim.append(frozenset(pairs))
        elif t_axes[: len(s_axes)] == s_axes:  # the target piece lies inside the source's: all held
            per_dim.append(frozenset((t, t) for t in _nested_lengths(length, [sizes[a] for a in t_axes])))
        else:
            return None
    best = 0
    for combo in itertools.product(*per_dim):
        target = math.prod(t for t, _ in combo)
        held = math.prod(h for _, h in combo) if holds else 0
        best = max(best, target - held)
    return best * itemsize
