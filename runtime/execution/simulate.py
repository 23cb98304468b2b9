"""Execute a plan for every rank at once, in one process, with real tensors.

Each rank runs its compiled moves (``runtime.execution.program``), exactly as under
``runtime.execution.executor``; only the collectives are emulated, group by group, over the ranks'
send buffers: the same padding, the same blocks, the same trimming. A point-to-point step
packs, receives and places the same per-peer messages as the executor (``runtime.comm.exchange``),
and may hand the tensor to another mesh: pieces come in keyed by the source mesh's ranks and
go out keyed by the target mesh's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from planner.records import Plan
from runtime.comm.exchange import RankExchange
from runtime.errors import ReshardError
from runtime.execution.program import CollectiveMove, compile_plan
from runtime.memory.dtypes import dtype_name
from runtime.memory.pieces import check_pieces, reduce_stacked


def simulate(plan: Plan, pieces_by_rank: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every rank's piece in ``plan.dst``, keyed by the ranks of the target mesh, given every
    rank's piece in ``plan.src``, keyed by the ranks of the source mesh (each with the piece
    shape ``plan.src`` gives it)."""
    check_pieces(pieces_by_rank, plan.src, plan.shape)
    dtype = dtype_name(next(iter(pieces_by_rank.values())).dtype)
    if dtype != plan.dtype:
        raise ReshardError(f"the plan {plan.src} -> {plan.dst} is for {plan.dtype} but the pieces are {dtype}")
    ranks = (*plan.src.mesh.ranks, *(r for r in plan.dst.mesh.ranks if r not in plan.src.mesh.ranks))
    programs = {rank: compile_plan(plan, rank) for rank in ranks}
    pieces = dict(pieces_by_rank)
    for index, step in enumerate(plan.steps):
        moves = {rank: programs[rank][index] for rank in ranks if programs[rank][index] is not None}
        if step.op == "point_to_point":
            pieces = _point_to_point(moves, pieces)
            continue
        mesh = step.layout.mesh
        if moves[mesh.ranks[0]].is_local:
            pieces = {rank: moves[rank].local(pieces[rank]) for rank in mesh.ranks}
            continue
        for members in mesh.axis_groups(step.axis):
            # The simulator never writes into a send buffer, so the caller's pieces are safe.
            sends = [moves[r].send(pieces[r], writable=True) for r in members]
            for r, received in zip(members, _exchange(moves[members[0]], sends), strict=True):
                pieces[r] = moves[r].finish(received)
    # Fresh tensors: no result aliases an input or another rank's result.
    return {rank: piece.clone(memory_format=torch.contiguous_format) for rank, piece in pieces.items()}


def _point_to_point(moves: dict[int, RankExchange], pieces: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The target mesh's pieces after a point-to-point step: each message copied from its
    sender's packed buffer into its receiver's buffer, then placed as the executor does."""
    messages = {
        (rank, peer): message for rank, move in moves.items() if move.sends for peer, message in move.pack(pieces[rank])
    }
    like = next(iter(pieces.values()))
    out = {}
    for rank, move in moves.items():
        if move.after is None:
            continue  # only in the source mesh: it sent and holds nothing after the step
        target = like.new_empty(move.after)
        buffers = move.receive_buffers(target)
        for peer, buffer, _ in buffers:
            buffer.copy_(messages[peer, rank])
        if move.copies:
            move.copy_local(pieces[rank], target)
        move.place(target, buffers)
        out[rank] = target
    return out


def _exchange(move: CollectiveMove, sends: list[torch.Tensor]) -> list[torch.Tensor]:
    """What each member of a group receives from the collective of ``move``'s step."""
    op, n = move.step.op, move.n
    if op == "all_gather":
        gathered = torch.cat(sends)
        return [gathered] * n
    if op == "all_to_all":
        blocks = [s.view(n, -1) for s in sends]
        return [torch.cat([b[i] for b in blocks]) for i in range(n)]
    reduced = reduce_stacked(torch.stack(sends), move.step.reduce_op)
    if op == "all_reduce":
        return [reduced] * n
    return list(reduced.view(n, -1))
