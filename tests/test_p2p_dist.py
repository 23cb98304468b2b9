"""Point-to-point and cross-mesh reshards on 8 gloo ranks: ONE spawn runs every shared case.

The cases (``tests.test_p2p_support.CASES``): swaps and row-block permutations on one mesh,
mesh[2,2] ranks 0..3 -> mesh[4] ranks 4..7, mesh[2,2] -> mesh[2,2] with permuted ranks,
overlapping rank sets, uneven shapes with empty pieces and a zero-length dim, partial sources
(collectives on the source mesh first), partial targets and a scalar; hand-made plans, the
planner's with point-to-point steps allowed, and plans ``reshard`` makes itself. Ranks in
neither mesh of a case never call ``reshard`` (and the others finish without them).

Each target rank's piece must equal the torch.chunk block of the full tensor; each rank's
recorded bytes must equal what the plan's transfers say it sends; ranks outside the target
mesh get ``None``.
"""

from __future__ import annotations

import functools

import pytest
import torch

import planner
from planner.plans import Plan
from runtime import recording, reshard, torch_dtype
from runtime.testing import run_ranks
from shardlang import parse_layout
from shardlang.dtypes import ITEMSIZE
from tests.test_p2p_support import CASES, Case, case_plan, traffic
from tests.test_runtime_support import full_tensor, reference_piece, source_pieces

COLLECTIVES = ("all_gather", "all_to_all", "reduce_scatter", "all_reduce")


def _plan(case: Case) -> Plan:
    src_text, dst_text, shape, dtype, how = case
    if how == "auto":  # what reshard plans by itself
        return planner.plan(parse_layout(src_text), parse_layout(dst_text), shape, dtype)
    return case_plan(case)


def _run_cases(rank: int, world_size: int, cases: list[Case]) -> list:
    results = []
    for i, case in enumerate(cases):
        src_text, dst_text, shape, dtype, how = case
        src, dst = parse_layout(src_text), parse_layout(dst_text)
        if rank not in src.mesh.ranks and rank not in dst.mesh.ranks:
            results.append(None)  # outside both meshes: does nothing
            continue
        full = full_tensor(shape, torch_dtype(dtype), seed=i)
        local = source_pieces(full, src, seed=i)[rank] if rank in src.mesh.ranks else None
        with recording() as log:
            out = reshard(
                local,
                src,
                dst,
                global_shape=shape,
                plan=case_plan(case) if how == "hand" else None,
                dtype=None if how == "hand" else dtype,  # a given plan says the dtype
                point_to_point=how == "p2p",
                timeout=60,
                verify=i % 4 == 0,
                name=f"case{i}",
            )
        records = [(r.step, r.op, r.bytes_sent, r.planned_bytes, r.ranks) for r in log.records]
        results.append((out, records))
    return results


@functools.cache
def _results() -> list:
    return run_ranks(_run_cases, 8, (CASES,), timeout=150)


def _check_case(i: int, case: Case, per_rank: dict[int, tuple | None]) -> None:
    plan = _plan(case)
    src, dst, shape, dtype = plan.src, plan.dst, plan.shape, plan.dtype
    full = full_tensor(shape, torch_dtype(dtype), seed=i)
    union = {*src.mesh.ranks, *dst.mesh.ranks}
    assert all(per_rank[r] is None for r in range(8) if r not in union), "a rank outside both meshes took part"
    for rank in union:
        out = per_rank[rank][0]
        if rank in dst.mesh.ranks:
            assert out.dtype == full.dtype and out.is_contiguous()
            assert torch.equal(out, reference_piece(full, dst, rank)), f"rank {rank} holds the wrong block"
        else:
            assert out is None, f"rank {rank} is not in the target mesh but got a piece"
    (index,) = [k for k, s in enumerate(plan.steps) if s.op == "point_to_point"]
    step = plan.steps[index]
    sent, received = traffic(step.transfers, ITEMSIZE[dtype])
    busiest = 0
    for rank in union:
        records = per_rank[rank][1]
        # Collectives: on the meshes the rank is in, exactly the plan's communicating steps.
        expected = [
            k for k, s in enumerate(plan.steps)
            if s.op in COLLECTIVES and rank in s.layout.mesh.ranks and s.layout.mesh.shape[s.axis] > 1
        ]  # fmt: skip
        assert [r[0] for r in records if r[1] != "point_to_point"] == expected
        exchanges = [r for r in records if r[1] == "point_to_point"]
        peers = {
            t.dst_rank if t.src_rank == rank else t.src_rank
            for t in step.transfers
            if rank in (t.src_rank, t.dst_rank) and t.src_rank != t.dst_rank and all(hi > lo for lo, hi in t.box)
        }
        if not peers:
            assert exchanges == [], f"rank {rank} exchanged nothing but recorded {exchanges}"
            continue
        ((k, _, nbytes, planned, ranks),) = exchanges
        assert k == index and ranks == tuple(sorted(peers)) and planned == step.bytes
        assert nbytes == sent.get(rank, 0), f"rank {rank} sent {nbytes} bytes, the transfers say {sent.get(rank, 0)}"
        busiest = max(busiest, nbytes, received.get(rank, 0))
    assert busiest == step.bytes, f"the busiest rank moved {busiest} bytes, the plan says {step.bytes}"


@pytest.mark.slow
def test_point_to_point_reshards_on_eight_ranks() -> None:
    results = _results()
    for i, case in enumerate(CASES):
        try:
            _check_case(i, case, {rank: results[rank][i] for rank in range(8)})
        except AssertionError as e:
            raise AssertionError(f"case {i} {case}: {e}") from None
