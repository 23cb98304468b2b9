"""Ranks agree on a plan before its first use, without ``verify`` (README: the runtime).

One spawn of 4 gloo ranks:
1. Ranks 0,1 hold ``S0,S1`` and ranks 2,3 ``S1,S0`` of one 8x8 tensor on mesh[2,2]: the same
   piece shape and the same bytes on every collective, so without the check every rank would
   return wrong values. Every rank raises PlanMismatchError.
2. Rank 3 passes an f64 piece where the others pass f32 (gloo would abort a peer on the size
   mismatch): every rank raises PlanMismatchError.
3. A plan all ranks agree on runs; its second use exchanges no fingerprint.
"""

from __future__ import annotations

import functools

import pytest
import torch

from runtime import PlanMismatchError, reshard, shard
from runtime.testing import attempt, run_ranks
from shardlang import parse_layout

FULL = torch.arange(64.0).reshape(8, 8)
RR = parse_layout("R,R over mesh[2,2]")


def _phases(rank: int, world_size: int) -> dict[str, object]:
    from runtime.execution import executor

    exchanges = []
    real = executor._verify
    executor._verify = lambda *a: exchanges.append(a[0]) or real(*a)  # type: ignore[assignment]
    out: dict[str, object] = {}
    mine = parse_layout("S0,S1 over mesh[2,2]" if rank < 2 else "S1,S0 over mesh[2,2]")
    out["same bytes"] = attempt(
        lambda: reshard(shard(FULL, mine, rank), mine, RR, global_shape=(8, 8), name="w", timeout=30)
    )
    s0 = parse_layout("S0,R over mesh[2,2]")
    piece = shard(FULL, s0, rank).to(torch.float64 if rank == 3 else torch.float32)
    out["dtype"] = attempt(lambda: reshard(piece, s0, RR, global_shape=(8, 8), name="d", timeout=30))
    before = len(exchanges)
    good = shard(FULL, s0, rank)
    first = reshard(good, s0, RR, global_shape=(8, 8), timeout=30)
    second = reshard(good, s0, RR, global_shape=(8, 8), timeout=30)
    out["values"] = torch.equal(first, FULL) and torch.equal(second, FULL)
    out["exchanges"] = len(exchanges) - before
    return out


@functools.cache
def _results() -> list:
    return run_ranks(_phases, 4, timeout=120, collective_timeout=30)


@pytest.mark.slow
def test_same_byte_layouts_that_disagree_raise_on_every_rank() -> None:
    for rank, result in enumerate(_results()):
        kind, message, _ = result["same bytes"]
        assert kind == PlanMismatchError.__name__, f"rank {rank}: {kind}: {message}"
        assert "tensor 'w'" in message and "ranks [0, 1] hold plan" in message and "ranks [2, 3] hold plan" in message


@pytest.mark.slow
def test_a_rank_with_another_dtype_makes_every_rank_raise() -> None:
    for rank, result in enumerate(_results()):
        kind, message, _ = result["dtype"]
        assert kind == PlanMismatchError.__name__, f"rank {rank}: {kind}: {message}"
        assert "tensor 'd'" in message and "ranks [3] hold plan" in message
        assert ("f64" if rank == 3 else "f32") in message


@pytest.mark.slow
def test_an_agreed_plan_is_checked_once() -> None:
    for result in _results():
        assert result["values"] is True
        assert result["exchanges"] == 1
