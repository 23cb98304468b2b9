"""runtime.execution.run.Exchange: a bucket of point-to-point moves sends one message per peer
(the members' blocks one after another) and cuts what arrives back into every member's piece,
as Muon's matrix moves bucket them; a reshard's one-step plan, compiled per rank, gives the members. The messages
are copied between ranks here as ``runtime.execution.simulate`` emulates them.
"""

from __future__ import annotations

import pytest
import torch

from runtime import torch_dtype
from runtime.comm.exchange import RankExchange
from runtime.execution.program import compile_plan
from runtime.execution.run import Exchange
from tests.test_p2p_support import CASES, Case, case_plan
from tests.test_runtime_support import full_tensor, reference_piece

ONE_STEP = [case for case in CASES if [s.op for s in case_plan(case).steps] == ["point_to_point"]]


@pytest.mark.parametrize("case", ONE_STEP, ids=lambda c: f"{c[0]} -> {c[1]} {list(c[2])} {c[4]}")
def test_two_members_travel_in_one_message_per_peer_and_land_exactly(case: Case) -> None:
    plan = case_plan(case)
    dtype = torch_dtype(plan.dtype)
    fulls = [full_tensor(plan.shape, dtype, seed) for seed in (1, 2)]
    ranks = (*plan.src.mesh.ranks, *(r for r in plan.dst.mesh.ranks if r not in plan.src.mesh.ranks))
    buckets, outs = {}, {}
    for rank in ranks:
        posts = []
        for full in fulls:
            x = reference_piece(full, plan.src, rank) if rank in plan.src.mesh.ranks else None
            (move,) = compile_plan(plan, rank)
            assert isinstance(move, RankExchange)
            posts.append((move, x, None if move.after is None else torch.empty(move.after, dtype=dtype)))
        buckets[rank] = Exchange(posts)  # type: ignore[arg-type]
        outs[rank] = [out for _, _, out in posts]
        move = posts[0][0]
        assert [peer for peer, _ in buckets[rank].sends] == [peer for peer, _ in move.sends]
        assert buckets[rank].elements_sent == 2 * move.elements_sent
    messages = {(rank, peer): message for rank, bucket in buckets.items() for peer, message in bucket.sends}
    for rank, bucket in buckets.items():
        for peer, landing, _ in bucket.receives:
            landing.copy_(messages[peer, rank])
        bucket.copy_local()
        bucket.land()
    for rank in plan.dst.mesh.ranks:
        for full, out in zip(fulls, outs[rank], strict=True):
            assert torch.equal(out, reference_piece(full, plan.dst, rank)), f"rank {rank}"
