"""Boxes: a block of a global tensor, ``[start, stop)`` per dim.

The one home of box arithmetic: what ``Layout.piece`` returns, what a point-to-point transfer
moves, what a checkpoint stores. A :class:`Box` is a tuple of ``(start, stop)`` pairs (it
compares and hashes as one, so it can key a dict and index a tensor's dims alike), with the
operations every layer needs.

Contiguous runs: a piece stored row-major is one box. A sub-box of it lies in one contiguous
run of elements per index of the dims before the innermost dim that the sub-box does not cover
whole (:meth:`Box.runs`); a flat range of a box's row-major order is at most ``2 * ndim - 1``
boxes, each a contiguous part of the range (:meth:`Box.flat_range`). For example, in the
stored box ``((0, 4), (0, 6))`` the sub-box ``((1, 3), (2, 5))`` is the runs ``(8, 3)`` and
``(14, 3)`` (offset, length in elements), and elements ``[4, 15)`` are the boxes
``((0, 1), (4, 6))``, ``((1, 2), (0, 6))``, ``((2, 3), (0, 3))``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Each dim's step, in elements, through ``shape`` stored row-major (torch's contiguous
    strides: an empty dim steps as one of length 1); ``(12, 4, 1)`` for ``(2, 3, 4)``. Of a
    mesh's shape: each axis's step in the row-major position of its ranks."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


class Box(tuple[tuple[int, int], ...]):
    """``box[d]`` is ``(start, stop)`` of dim ``d``; the empty tuple is a scalar's box."""

    __slots__ = ()

    def __new__(cls, bounds: Iterable[Iterable[int]] = ()) -> Box:
        return tuple.__new__(cls, tuple((int(lo), int(hi)) for lo, hi in bounds))  # type: ignore[misc]

    @classmethod
    def trusted(cls, bounds: Iterable[tuple[int, int]]) -> Box:
        """A box from ``(int, int)`` pairs already, without converting them: boxes are made on
        the planner's and runtime's hot paths."""
        return tuple.__new__(cls, bounds)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self)

    @property
    def numel(self) -> int:
        return math.prod(hi - lo for lo, hi in self)

    @property
    def empty(self) -> bool:
        return any(hi <= lo for lo, hi in self)

    def intersect(self, other: Iterable[tuple[int, int]]) -> Box | None:
        """The common block of two boxes, or ``None`` when they share no element."""
        out = []
        for (alo, ahi), (blo, bhi) in zip(self, other, strict=True):
            lo, hi = max(alo, blo), min(ahi, bhi)
            if lo >= hi:
                return None
            out.append((lo, hi))
        return Box.trusted(out)

    def contains(self, other: Iterable[tuple[int, int]]) -> bool:
        """Whether ``other`` lies inside this box."""
        return all(lo <= start and stop <= hi for (start, stop), (lo, hi) in zip(other, self, strict=True))

    def relative_to(self, within: Iterable[tuple[int, int]]) -> Box:
        """This box placed relative to a piece that holds the box ``within``."""
        return Box.trusted(
            (start - origin, stop - origin) for (start, stop), (origin, _) in zip(self, within, strict=True)
        )

    def runs(self, sub: Box) -> Iterator[tuple[int, int]]:
        """``(offset, length)`` in elements, from the start of this box's row-major data, of
        the contiguous runs that hold ``sub`` (inside this box), in ``sub``'s row-major order."""
        shape = self.shape
        rel = sub.relative_to(self)
        if any(lo >= hi for lo, hi in rel):
            return
        strides = row_major_strides(shape)
        whole = len(shape)  # dims from ``whole`` on are covered entirely
        while whole > 0 and rel[whole - 1] == (0, shape[whole - 1]):
            whole -= 1
        if whole == 0:
            yield 0, math.prod(shape)
            return
        lo, hi = rel[whole - 1]
        length = (hi - lo) * strides[whole - 1]
        first = lo * strides[whole - 1]
        for index in itertools.product(*(range(a, b) for a, b in rel[: whole - 1])):
            yield first + sum(i * s for i, s in zip(index, strides[: whole - 1], strict=True)), length

    def is_run(self, sub: Box) -> bool:
        """Whether ``sub`` (inside this box) is one contiguous run of this box's row-major data,
        or empty: whether a view of it in a contiguous piece is contiguous (every dim before the
        innermost one ``sub`` does not cover whole has length 1 in ``sub``)."""
        return next(itertools.islice(self.runs(sub), 1, None), None) is None

    def flat_range(self, lo: int, hi: int) -> tuple[Box, ...]:
        """The boxes that elements ``[lo, hi)`` of this box flattened row-major cover, in order."""
        return tuple(
            Box.trusted((start + a, start + b) for (a, b), (start, _) in zip(rel, self, strict=True))
            for rel in _flat_range(self.shape, lo, hi)
        )

    def text(self) -> str:
        """``[0:4, 2:6]``: ``start:stop`` per dim."""
        return "[" + ", ".join(f"{start}:{stop}" for start, stop in self) + "]"

    def __repr__(self) -> str:
        return f"Box({list(self)!r})"


def _flat_range(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, int], ...]]:
    if lo >= hi:
        return []
    if not shape:
        return [()]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    rest = shape[1:]
    if first == last:
        return [((first, first + 1), *box) for box in _flat_range(rest, lo - first * inner, hi - first * inner)]
    out: list[tuple[tuple[int, int], ...]] = []
    whole_from, whole_to = -(-lo // inner), hi // inner
    if lo % inner:
        out += [((first, first + 1), *box) for box in _flat_range(rest, lo % inner, inner)]
    if whole_to > whole_from:
        out.append(((whole_from, whole_to), *((0, n) for n in rest)))
    if hi % inner:
        out += [((last, last + 1), *box) for box in _flat_range(rest, 0, hi % inner)]
    return out
