"""One rank's part in a point-to-point step: what it sends, receives and copies, per peer.

A ``point_to_point`` step (``planner.plans.Step``) lists its messages as transfers of boxes of
the global tensor. For one rank they become: per peer it sends to, the boxes relative to its
source piece; per peer it receives from, the boxes relative to its target piece; and the
boxes it copies from its own source piece to its own target piece (never sent).

Every pair of ranks exchanges ONE message per step, its boxes concatenated in transfer order
(both ends read the same transfers, so they agree on the layout of the message). A box that is
a contiguous run of the sender's piece is sent without a copy, and a single box that is a
contiguous run of the receiver's output is received in place; other boxes go through one
buffer per peer. Both executors use these methods: the distributed one posts the buffers with
``torch.distributed.batch_isend_irecv``, the simulator copies them from sender to receiver.

``check_point_to_point`` validates a step once per plan: sources not partial, every transfer
inside its sender's source piece and its receiver's target piece, and every target piece
covered exactly once (boxes contained, pairwise disjoint, volumes adding up to the piece). A
pattern-valued step (``planner.pattern``) makes its transfers from the layouts, which cover
every piece by construction: it is checked to describe the step's own layouts and shape, and
each rank makes only its own transfers (``Step.transfers_of``).
"""

from __future__ import annotations

import functools
from collections import defaultdict

import attrs
import torch

from planner.pattern import ExchangePattern
from planner.plans import Plan, Step, Transfer
from runtime.errors import ReshardError
from runtime.memory.packing import region
from shardlang.box import Box
from shardlang.layout import Layout

PeerBoxes = tuple[tuple[int, tuple[Box, ...]], ...]  # (peer rank, its boxes in transfer order), peers ascending


@attrs.frozen
class RankExchange:
    """One rank's part in the point-to-point step ``index`` of a plan.

    ``sends``: per peer, boxes relative to this rank's source piece; ``receives``: per peer,
    boxes relative to its target piece; ``copies``: (box in the source piece, the same box in
    the target piece). ``after`` is the target piece's shape, ``None`` off the target mesh.
    """

    index: int
    step: Step
    sends: PeerBoxes
    receives: PeerBoxes
    copies: tuple[tuple[Box, Box], ...]
    after: tuple[int, ...] | None

    @property
    def peers(self) -> tuple[int, ...]:
        """The ranks this rank sends to or receives from (itself excluded)."""
        return tuple(sorted({peer for peer, _ in self.sends} | {peer for peer, _ in self.receives}))

    @property
    def elements_sent(self) -> int:
        return sum(box.numel for _, boxes in self.sends for box in boxes)

    def pack(self, x: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """Per peer, the flat contiguous message to send, cut from the source piece ``x``."""
        messages = []
        for peer, boxes in self.sends:
            if len(boxes) == 1 and (block := region(x, boxes[0])).is_contiguous():
                messages.append((peer, block.reshape(-1)))  # a view: no copy
                continue
            message = x.new_empty(sum(box.numel for box in boxes))
            offset = 0
            for box in boxes:
                block = region(x, box)
                message[offset : offset + block.numel()].view(block.shape).copy_(block)
                offset += block.numel()
            messages.append((peer, message))
        return messages

    def receive_buffers(self, out: torch.Tensor) -> list[tuple[int, torch.Tensor, bool]]:
        """Per peer, the flat buffer its message lands in, and whether that buffer is a view of
        ``out`` (the message is then already in place)."""
        buffers = []
        for peer, boxes in self.receives:
            if len(boxes) == 1 and (block := region(out, boxes[0])).is_contiguous():
                buffers.append((peer, block.view(-1), True))
            else:
                buffers.append((peer, out.new_empty(sum(box.numel for box in boxes)), False))
        return buffers

    def place(self, out: torch.Tensor, buffers: list[tuple[int, torch.Tensor, bool]]) -> None:
        """Copy the received messages that did not land in place into their boxes of ``out``."""
        for (_, boxes), (_, buffer, in_place) in zip(self.receives, buffers, strict=True):
            if in_place:
                continue
            offset = 0
            for box in boxes:
                block = region(out, box)
                block.copy_(buffer[offset : offset + block.numel()].view(block.shape))
                offset += block.numel()

    def copy_local(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """The boxes this rank keeps: from its source piece ``x`` into its target piece ``out``."""
        for source_box, target_box in self.copies:
            region(out, target_box).copy_(region(x, source_box))


def compile_exchange(plan: Plan, index: int, rank: int) -> RankExchange | None:
    """``rank``'s part in the point-to-point step ``index`` of ``plan``; ``None`` when the rank
    is in neither the step's source mesh nor its target mesh."""
    check_point_to_point(plan, index)
    step = plan.steps[index]
    source, target = plan.layouts()[index], step.layout
    in_source, in_target = rank in source.mesh.ranks, rank in target.mesh.ranks
    if not (in_source or in_target):
        return None
    source_bounds = source.rank_piece(plan.shape, rank) if in_source else None
    target_bounds = target.rank_piece(plan.shape, rank) if in_target else None
    sends: dict[int, list[Box]] = defaultdict(list)
    receives: dict[int, list[Box]] = defaultdict(list)
    copies = []
    for t in step.transfers_of(rank):  # a pattern-valued step makes this rank's alone (planner.pattern)
        if t.box.numel == 0:
            continue
        if t.src_rank == t.dst_rank:
            copies.append((t.box.relative_to(source_bounds), t.box.relative_to(target_bounds)))
        elif t.src_rank == rank:
            sends[t.dst_rank].append(t.box.relative_to(source_bounds))
        else:
            receives[t.src_rank].append(t.box.relative_to(target_bounds))
    return RankExchange(
        index=index,
        step=step,
        sends=tuple((peer, tuple(boxes)) for peer, boxes in sorted(sends.items())),
        receives=tuple((peer, tuple(boxes)) for peer, boxes in sorted(receives.items())),
        copies=tuple(copies),
        after=None if target_bounds is None else target_bounds.shape,
    )


@functools.lru_cache(maxsize=256)
def check_point_to_point(plan: Plan, index: int) -> None:
    """A :class:`ReshardError` naming the step unless its transfers are executable: see the
    module's docstring."""
    step = plan.steps[index]
    source, target = plan.layouts()[index], step.layout
    where = f"step {index + 1} of {len(plan.steps)} ({step.describe()} -> {target})"
    for layout, when in ((source, "before"), (target, "after")):
        axes = [layout.mesh.axis_label(a) for a, _ in layout.partial if layout.mesh.shape[a] > 1]
        if axes:
            raise ReshardError(
                f"{where}: the state {when} a point_to_point step must not be partial ('{layout}' is partial over "
                f"mesh axes {', '.join(axes)}); reduce on the source mesh first, or add partial steps after"
            )
    if not isinstance(step.transfers, tuple):
        _check_pattern(plan, step.transfers, source, target, where)
        return
    received: dict[int, list[Box]] = defaultdict(list)
    for k, t in enumerate(step.transfers):
        _check_transfer(plan, t, source, target, f"{where}: transfer {k} (rank {t.src_rank} -> rank {t.dst_rank}")
        if t.box.numel:
            received[t.dst_rank].append(t.box)
    for rank in target.mesh.ranks:
        _check_cover(received[rank], target.rank_piece(plan.shape, rank), f"{where}: rank {rank}'s target piece")


def _check_pattern(plan: Plan, pattern: ExchangePattern, source: Layout, target: Layout, where: str) -> None:
    """A pattern makes every target piece's transfers from the layouts (planner.pattern): it is
    executable when it describes this step, from the state before it to the state after it."""
    for mine, theirs, what in ((pattern.source, source, "before"), (pattern.target, target, "after")):
        if mine.dims != theirs.dims or not mine.mesh.same_geometry(theirs.mesh):
            raise ReshardError(
                f"{where}: its transfers' pattern takes the state {what} the step to be '{mine}', "
                f"the plan has '{theirs}'; plan the pair again (the plan was edited or is corrupt)"
            )
    if pattern.shape != plan.shape:
        raise ReshardError(
            f"{where}: its transfers' pattern is for a tensor of shape {list(pattern.shape)}, the plan's is "
            f"{list(plan.shape)}; plan the pair again (the plan was edited or is corrupt)"
        )


def _check_transfer(plan: Plan, t: Transfer, source: Layout, target: Layout, what: str) -> None:
    shape = plan.shape
    if len(t.box) != len(shape) or any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(t.box, shape, strict=True)):
        raise ReshardError(f"{what}, box {t.box.text()}) is not a box of the tensor of shape {list(plan.shape)}")
    for rank, layout, role in ((t.src_rank, source, "source"), (t.dst_rank, target, "target")):
        if rank not in layout.mesh.ranks:
            raise ReshardError(f"{what}): rank {rank} is not in the {role} mesh {layout.mesh.describe()}")
        bounds = layout.rank_piece(plan.shape, rank)
        if t.box.numel and not bounds.contains(t.box):
            raise ReshardError(f"{what}): box {t.box.text()} is not inside rank {rank}'s {role} piece {bounds.text()}")


def _check_cover(boxes: list[Box], bounds: Box, what: str) -> None:
    """Boxes inside ``bounds`` (checked before) cover it exactly once: disjoint, volumes adding up."""
    covered, needed = sum(b.numel for b in boxes), bounds.numel
    ordered = sorted(boxes)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b and b[0][0] >= a[0][1]:
                break  # sorted by start along dim 0: no later box reaches back into ``a``
            if a.intersect(b) is not None:
                raise ReshardError(f"{what} {bounds.text()} receives {a.text()} and {b.text()}, which overlap")
    if covered != needed:
        raise ReshardError(f"{what} {bounds.text()} has {needed} elements but its transfers bring {covered}")
