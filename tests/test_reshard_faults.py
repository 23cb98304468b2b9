"""Faults: ranks that disagree on the plan, never arrive, or die make the others raise a
DistributedError naming the tensor and the step, within the timeout; never a hang.

One spawn of 4 gloo ranks runs the phases in order:
0. Bad input raises a ReshardError on the rank that passes it, before any communication.
1. ``verify=True`` with ranks 0,1 and ranks 2,3 planning different targets: all four raise
   PlanMismatchError; then a matching ``verify=True`` call succeeds.
2. Rank 1 never arrives at a collective of an existing group: rank 0 times out. Rank 3 never
   arrives at the creation of a new group (for the agreement on a new plan): rank 2 times out.
3. Rank 3 exits before a collective: ranks 0, 1, 2 raise.
"""

from __future__ import annotations

import functools
import os
import re

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import planner
from runtime import DistributedError, PlanMismatchError, ReshardError, reshard, shard
from runtime.testing import attempt, run_ranks
from shardlang import parse_layout

SHORT = 2.0  # seconds: the timeout of the phases where a peer never arrives
DEATH_TIMEOUT = 5.0
SLACK = 4.0  # scheduling on a loaded 2-core machine

S0R = parse_layout("S0,R over mesh[4]")
FULL = torch.arange(32.0).reshape(8, 4)


def _bad_inputs(rank: int, piece: torch.Tensor) -> dict[str, tuple[str, str, float]]:
    rr = parse_layout("R,R over mesh[4]")
    device_mesh = init_device_mesh("cpu", (2, 2))  # ranks [[0, 1], [2, 3]]
    shuffled = parse_layout("S0,R over mesh[2,2] ranks [2,0,3,1]")
    three = parse_layout("R over mesh[3] ranks 1..3")
    other_plan = planner.plan(S0R, parse_layout("R,S0 over mesh[4]"), (8, 4))
    return {
        "wrong piece": attempt(lambda: reshard(piece[:1], S0R, rr, global_shape=(8, 4), name="w")),
        "wrong plan": attempt(lambda: reshard(piece, S0R, rr, global_shape=(8, 4), plan=other_plan)),
        "not a tensor": attempt(lambda: reshard(piece.tolist(), S0R, rr, global_shape=(8, 4))),
        "text layout": attempt(lambda: reshard(piece, str(S0R), rr, global_shape=(8, 4))),
        "wrong rank count": attempt(lambda: reshard(piece, S0R, rr, global_shape=(8,), name="w")),
        "outside the mesh": attempt(lambda: reshard(torch.zeros(2), three, three, global_shape=(2,))),
        "integer average": attempt(
            lambda: reshard(
                torch.zeros(4, 4, dtype=torch.int64),
                parse_layout("S0,R | P1:avg over mesh[2,2]"),
                parse_layout("S0,R over mesh[2,2]"),
                global_shape=(8, 4),
            )
        ),
        "bad timeout": attempt(lambda: reshard(piece, S0R, rr, global_shape=(8, 4), timeout=-1)),
        "unreadable timeout": attempt(lambda: reshard(piece, S0R, rr, global_shape=(8, 4), timeout="soon", name="w")),
        "wrong device mesh": attempt(
            lambda: reshard(
                shard(FULL, shuffled, rank),
                shuffled,
                parse_layout("R,R over mesh[2,2] ranks [2,0,3,1]"),
                global_shape=(8, 4),
                mesh=device_mesh,
                name="w",
            )
        ),
    }


def _phases(rank: int, world_size: int) -> dict[str, object]:
    piece = shard(FULL, S0R, rank)
    out: dict[str, object] = {"bad": _bad_inputs(rank, piece)}
    wrong = "R,R over mesh[4]" if rank < 2 else "R,S0 over mesh[4]"
    out["mismatch"] = attempt(
        lambda: reshard(piece, S0R, parse_layout(wrong), global_shape=(8, 4), verify=True, name="w", timeout=30)
    )
    gathered = reshard(piece, S0R, parse_layout("R,R over mesh[4]"), global_shape=(8, 4), verify=True, timeout=30)
    out["verified"] = torch.equal(gathered, FULL)

    pair = parse_layout("S0 over mesh[2] ranks 0..1")
    if rank in (0, 1):
        half = shard(torch.arange(4.0), pair, rank)
        reshard(half, pair, parse_layout("R over mesh[2] ranks 0..1"), global_shape=(4,), timeout=SHORT)
        if rank == 0:  # rank 1 never comes to the second call
            out["absent_peer"] = attempt(
                lambda: reshard(
                    half, pair, parse_layout("R over mesh[2] ranks 0..1"), global_shape=(4,), timeout=SHORT, name="x"
                )
            )
    new_pair = parse_layout("S0 over mesh[2] ranks [3,2]")
    if rank == 2:  # rank 3 never comes to create the group
        half = shard(torch.arange(4.0), new_pair, rank)
        out["absent_creator"] = attempt(
            lambda: reshard(
                half, new_pair, parse_layout("R over mesh[2] ranks [3,2]"), global_shape=(4,), timeout=SHORT, name="z"
            )
        )

    if rank == 3:
        os._exit(0)  # dies without a word, its sockets closed
    out["dead_peer"] = attempt(
        lambda: reshard(
            piece, S0R, parse_layout("R,R over mesh[4]"), global_shape=(8, 4), timeout=DEATH_TIMEOUT, name="y"
        )
    )
    return out


@functools.cache
def _results() -> list:
    return run_ranks(_phases, 4, timeout=120, collective_timeout=30, allow_missing=(3,))


@pytest.mark.slow
def test_bad_input_raises_before_communicating() -> None:
    results = _results()
    expected = {
        "wrong piece": r"tensor 'w': rank \d holds a piece of shape \[1, 4\], but 'S0,R over mesh\[4\]' gives it \[2",
        "wrong plan": r"the plan given is for S0,R over mesh\[4\] -> R,S0 over mesh\[4\]",
        "not a tensor": "reshard takes this rank's piece as a plain torch.Tensor, not list",
        "text layout": "src must be a shardlang Layout",
        "wrong rank count": r"tensor 'w': cannot plan .* 2-d tensor but the shape \[8\] has 1 dims",
        "integer average": "cannot average a tensor of i64",
        "bad timeout": "timeout must be positive",
        "unreadable timeout": r"tensor 'w': timeout must be positive .*'soon'",
        "wrong device mesh": r"tensor 'w': step 1 of 1 .* the DeviceMesh \[\[0, 1\], \[2, 3\]\] is not the layout's",
    }
    for rank in range(3):
        bad = results[rank]["bad"]
        for what, pattern in expected.items():
            kind, message, _ = bad[what]
            assert kind != "ok" and re.search(pattern, message), f"rank {rank}, {what}: {kind}: {message}"
            assert kind in (ReshardError.__name__, "PlanError", "LayoutError"), (what, kind)
        kind, message, _ = bad["outside the mesh"]
        if rank == 0:
            assert kind == ReshardError.__name__ and "rank 0 is not in mesh[3] ranks 1..3" in message
        else:
            assert kind == "ok"


@pytest.mark.slow
def test_mismatched_plans_raise_on_every_rank() -> None:
    results = _results()
    for rank in range(3):  # rank 3 died later, but it also reported nothing
        kind, message, _ = results[rank]["mismatch"]
        assert kind == PlanMismatchError.__name__
        assert "tensor 'w'" in message and "disagree on the plan" in message
        assert "ranks [0, 1] hold plan" in message and "ranks [2, 3] hold plan" in message
        assert results[rank]["verified"] is True


@pytest.mark.slow
def test_a_peer_that_never_arrives_times_out() -> None:
    results = _results()
    kind, message, elapsed = results[0]["absent_peer"]
    assert kind == DistributedError.__name__
    assert "tensor 'x'" in message and "step 1 of 1 (all_gather" in message and "timed out" in message
    assert SHORT - 0.5 <= elapsed < SHORT + SLACK
    kind, message, elapsed = results[2]["absent_creator"]
    assert kind == DistributedError.__name__
    # The group is first needed by the agreement on the plan before its first use.
    assert "tensor 'z'" in message and "verifying the plan" in message and "on ranks [3, 2]" in message
    assert elapsed < SHORT + SLACK


@pytest.mark.slow
def test_a_dead_peer_makes_the_others_raise() -> None:
    results = _results()
    assert results[3] is None
    for rank in range(3):
        kind, message, elapsed = results[rank]["dead_peer"]
        assert kind == DistributedError.__name__, message
        assert "tensor 'y'" in message and "step 1 of 1 (all_gather" in message
        assert elapsed < DEATH_TIMEOUT + SLACK
