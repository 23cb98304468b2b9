"""Execute a plan for every rank at once, in one process, with real tensors.

Every rank walks its compiled moves (``runtime.execution.program``) with the walk that
``runtime.execution.executor`` drives (``runtime.execution.run``): the same padding, the same
blocks, the same trimming. Only the communication is emulated, step by step over the ranks
that wait at it: a collective group by group over its members' send buffers, a point-to-point
step by copying every packed message into its receiver's buffer. A point-to-point step may
hand the tensor to another mesh: pieces come in keyed by the source mesh's ranks and go out
keyed by the target mesh's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from planner.plans import Plan
from runtime.comm.exchange import RankExchange
from runtime.errors import ReshardError
from runtime.execution.program import CollectiveMove, compile_plan
from runtime.execution.run import Exchange, Post, walk
from runtime.memory.dtypes import dtype_name, torch_dtype
from runtime.memory.pieces import check_pieces, reduce_stacked


def simulate(plan: Plan, pieces_by_rank: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every rank's piece in ``plan.dst``, keyed by the ranks of the target mesh, given every
    rank's piece in ``plan.src``, keyed by the ranks of the source mesh (each with the piece
    shape ``plan.src`` gives it). No result shares memory with an input or another result."""
    check_pieces(pieces_by_rank, plan.src, plan.shape)
    like = next(iter(pieces_by_rank.values()))
    if dtype_name(like.dtype) != plan.dtype:
        raise ReshardError(
            f"the plan {plan.src} -> {plan.dst} is for {plan.dtype} but the pieces are {dtype_name(like.dtype)}"
        )
    ranks = (*plan.src.mesh.ranks, *(r for r in plan.dst.mesh.ranks if r not in plan.src.mesh.ranks))
    dtype = torch_dtype(plan.dtype)
    walks = {
        rank: walk(compile_plan(plan, rank), pieces_by_rank.get(rank), dtype=dtype, device=like.device)
        for rank in ranks
    }
    received: dict[int, torch.Tensor | None] = dict.fromkeys(ranks)  # what each rank resumes with
    waiting: dict[int, Post] = {}
    out: dict[int, torch.Tensor] = {}
    while True:
        for rank, result in received.items():
            try:
                waiting[rank] = walks[rank].send(result)
            except StopIteration as done:
                if done.value is not None:  # None: only in the source mesh, it sent and holds nothing
                    out[rank] = done.value
        if not waiting:
            return out
        # Ranks walk the same steps in order, so every rank of the earliest step waited at is
        # there; the others wait on.
        index = min(post[0].index for post in waiting.values())
        here = {rank: post for rank, post in waiting.items() if post[0].index == index}
        for rank in here:
            del waiting[rank]
        received = _emulate(here)


def _emulate(here: dict[int, Post]) -> dict[int, torch.Tensor | None]:
    """What each rank of ``here``, all waiting at one step, receives from its communication."""
    if isinstance(next(iter(here.values()))[0], RankExchange):
        exchanges = {rank: Exchange([post]) for rank, post in here.items()}  # type: ignore[list-item]
        messages = {(rank, peer): message for rank, ex in exchanges.items() for peer, message in ex.sends}
        for rank, ex in exchanges.items():
            for peer, buffer, _ in ex.receives:
                buffer.copy_(messages[peer, rank])
            ex.copy_local()
            ex.land()
        return dict.fromkeys(exchanges)
    received: dict[int, torch.Tensor | None] = {}
    for members in dict.fromkeys(post[0].members for post in here.values()):  # type: ignore[union-attr]
        move = here[members[0]][0]
        assert isinstance(move, CollectiveMove)
        received.update(zip(members, _collective(move, [here[r][1] for r in members]), strict=True))  # type: ignore[misc]
    return received


def _collective(move: CollectiveMove, sends: list[torch.Tensor]) -> list[torch.Tensor]:
    """What each member of a group receives from the collective of ``move``'s step (a tensor
    of its own: results never share memory)."""
    op, n = move.step.op, move.n
    if op == "all_gather":
        gathered = torch.cat(sends)
        return [gathered.clone() for _ in range(n)]
    if op == "all_to_all":
        blocks = [s.view(n, -1) for s in sends]
        return [torch.cat([b[i] for b in blocks]) for i in range(n)]
    reduced = reduce_stacked(torch.stack(sends), move.step.reduce_op)
    if op == "all_reduce":
        return [reduced.clone() for _ in range(n)]
    return [block.clone() for block in reduced.view(n, -1)]
