"""Local copies of plan steps: the cost model's copy table (``planner.cost`` prices the bytes
at its copy bandwidth; the search and the step records count them with these functions).

Local copies (``copied``, :func:`copy_elements` times the itemsize). A collective's blocks must
lie in one contiguous buffer, one block per peer; the executor (``runtime/execution/program.py``,
``CollectiveMove.send`` and ``finish``) makes that buffer a view of the piece where it can and
copies otherwise. With ``P`` the padded local shape before the step and ``Q`` after it, ``d``
the step's dim, ``j`` an all_to_all's ``to_dim``, and "``k`` leads ``S``" meaning
``prod(S[:k]) == 1`` (every dim before ``k`` has length 1, so ``S``'s blocks along ``k`` are runs
of memory), the elements copied are (0 on an axis of size 1, which sends nothing):

=============== ============================================================ ========================
op              pack, before the collective                                  unpack, after it
=============== ============================================================ ========================
all_gather      prod(P) if Q[d] != n * P[d] (a short piece is padded)        prod(Q) unless d leads P
reduce_scatter  n * prod(Q) unless P[d] == n * Q[d] and d leads P            0 (a view of the result)
all_to_all      n * prod(B), B = P with B[j] = Q[j], unless P[j] == n * Q[j] prod(Q) unless d leads B
                and Q[d] == n * P[d] and j leads P
all_reduce      0 (reduced in place)                                         0
=============== ============================================================ ========================

Example: ``R,R | P0 -> R,R`` of 765x1024 f32 on [4]. One all_reduce copies nothing by the table.
A reduce_scatter of dim 1 (1024 columns split evenly, but 765 rows before them) packs
``4 * 765 * 256`` elements (3,133,440 bytes: every row's four column blocks apart), and the
all_gather of dim 1 back unpacks as many; the same two of dim 0 pack 786,432 elements (765 rows
pad to 768) and 196,608 (the short last piece), and unpack nothing (dim 0 leads). At a copy
bandwidth of 2 GB/s that is 3.13 ms for the pair of dim 1 and 1.97 ms for the pair of dim 0.

What the rule leaves out, and why. It is the copies of the rank at coordinate 0's group, whose
pieces are the padded shapes the table counts (a group of another coordinate, with a shorter
piece, may pad where this one does not). It takes the step's input to be contiguous, as the
caller's piece and every collective's result are; a slice of a dim that does not lead, or a
reduce_scatter or all_to_all whose short last piece is cut from a dim that does not lead, leaves
a strided view, which whatever reads it next copies (the next pack, or the executor's copy of
its result), unpriced. The all_reduce of the caller's own piece (no collective before it) copies
it first, because the caller's tensor is never written: that copy is in the fitted all_reduce
line, since the calibration's all_reduce is such a step (docs/calibration.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence

from shardlang.box import Box


def copy_elements(
    op: str, n: int, dim: int | None, to_dim: int | None, before: Sequence[int], after: Sequence[int]
) -> int:
    """The elements a collective step copies locally to pack its blocks and unpack its result
    (module docstring): ``op`` on an axis of size ``n``, of ``dim`` (and ``to_dim``), between
    the padded local shapes ``before`` and ``after``; 0 for other steps."""
    if n == 1 or op not in ("all_gather", "reduce_scatter", "all_to_all"):
        return 0
    assert dim is not None
    if op == "all_gather":
        pack = math.prod(before) if after[dim] != n * before[dim] else 0
        return pack + (0 if _leads(dim, before) else math.prod(after))
    if op == "reduce_scatter":
        even = before[dim] == n * after[dim] and _leads(dim, before)
        return 0 if even else n * math.prod(after)
    assert to_dim is not None
    block = [*before]
    block[to_dim] = after[to_dim]
    fit = before[to_dim] == n * after[to_dim] and after[dim] == n * before[dim] and _leads(to_dim, before)
    return (0 if fit else n * math.prod(block)) + (0 if _leads(dim, block) else math.prod(after))


def exchange_copy_elements(
    transfers: Iterable[tuple[int, int, Box]], source_piece: Callable[[int], Box], target_piece: Callable[[int], Box]
) -> dict[int, int]:
    """Per rank, the elements a point-to-point step copies locally (``runtime/comm/exchange.py``), from
    its ``(sender, receiver, box)`` transfers and each rank's source and target piece: every box it
    keeps (sender and receiver alike, never sent), and on each side of a message (all the boxes
    between one pair of ranks) the whole message, unless it is one box that is a contiguous run
    of that side's piece (sent from it, or received into it, in place). Empty boxes move nothing.
    E.g. ``S0,R -> R,S0`` of 4x4 on [2]: rank 0 keeps rows 0-1 x columns 0-1 (4 elements copied),
    packs rows 0-1 x columns 2-3 for rank 1 (not a run of its rows: 4 more), and receives rows 2-3
    x columns 0-1 into its columns in place (a run of them): 8 in all."""
    source_piece, target_piece = functools.cache(source_piece), functools.cache(target_piece)  # per message
    copied: dict[int, int] = {}
    messages: dict[tuple[int, int], list[Box]] = {}
    for sender, receiver, box in transfers:
        if box.empty:
            continue
        if sender == receiver:
            copied[sender] = copied.get(sender, 0) + box.numel
        else:
            messages.setdefault((sender, receiver), []).append(box)
    for (sender, receiver), boxes in messages.items():
        elements = sum(box.numel for box in boxes)
        for rank, piece in ((sender, source_piece(sender)), (receiver, target_piece(receiver))):
            if len(boxes) > 1 or not piece.is_run(boxes[0]):
                copied[rank] = copied.get(rank, 0) + elements
    return copied


def _leads(dim: int, shape: Sequence[int]) -> bool:
    """Whether blocks of ``shape`` along ``dim`` are runs of its memory: no dim before it is longer than 1."""
    return math.prod(shape[:dim]) == 1
