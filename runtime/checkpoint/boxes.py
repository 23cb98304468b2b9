"""Boxes of a global tensor (``((start, stop), ...)`` per dim) and how they lie in memory.

A stored piece is one box, its elements row-major. Reading a sub-box of it touches one
contiguous byte run per index of the dims before the innermost dim the sub-box does not
cover whole: :func:`byte_runs`. A flat chunk of a block (flat ZeRO) is a run of the block's
row-major order; :func:`flat_range_boxes` cuts it into at most ``2 * ndim - 1`` boxes, each a
contiguous part of the run, in order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from planner.plan import Box
from runtime.blocks import piece_shape, relative


def byte_runs(stored: Box, sub: Box, itemsize: int) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` in bytes, from the start of ``stored``'s data, of the contiguous
    runs that hold ``sub`` (inside ``stored``), in ``sub``'s row-major order."""
    shape = piece_shape(stored)
    rel = relative(sub, stored)
    if any(lo >= hi for lo, hi in rel):
        return
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    whole = len(shape)  # dims from ``whole`` on are covered entirely
    while whole > 0 and rel[whole - 1] == (0, shape[whole - 1]):
        whole -= 1
    if whole == 0:
        yield 0, math.prod(shape) * itemsize
        return
    lo, hi = rel[whole - 1]
    length = (hi - lo) * strides[whole - 1] * itemsize
    first = lo * strides[whole - 1]
    for index in itertools.product(*(range(a, b) for a, b in rel[: whole - 1])):
        yield (first + sum(i * s for i, s in zip(index, strides[: whole - 1], strict=True))) * itemsize, length


def flat_range_boxes(block: Box, lo: int, hi: int) -> tuple[Box, ...]:
    """The boxes that elements ``[lo, hi)`` of ``block`` flattened row-major cover, in order."""
    shape = piece_shape(block)
    return tuple(
        tuple((start + a, start + b) for (a, b), (start, _) in zip(rel, block, strict=True))
        for rel in _flat_range(shape, lo, hi)
    )


def _flat_range(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    if lo >= hi:
        return []
    if not shape:
        return [()]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    rest = shape[1:]
    if first == last:
        return [((first, first + 1), *box) for box in _flat_range(rest, lo - first * inner, hi - first * inner)]
    out: list[Box] = []
    whole_from, whole_to = -(-lo // inner), hi // inner
    if lo % inner:
        out += [((first, first + 1), *box) for box in _flat_range(rest, lo % inner, inner)]
    if whole_to > whole_from:
        out.append(((whole_from, whole_to), *((0, n) for n in rest)))
    if hi % inner:
        out += [((last, last + 1), *box) for box in _flat_range(rest, 0, hi % inner)]
    return out
