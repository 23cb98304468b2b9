"""Cross-mesh reshards on 2 gloo ranks: bad calls, mismatched plans, group naming, and a
peer that never sends. One spawn runs the phases in order; rank 0 is the source mesh
``mesh[1]`` (printed without ``ranks [0]``) and rank 1 the target mesh ``mesh[1] ranks [1]`` throughout.

1. Bad calls raise a ReshardError before any communication.
2. Group naming: rank 0 alone creates a group first (a verified reshard on its own mesh), then
   both create the group of the union. torch's default names would differ between the two
   (they count the groups a process already has) and the creation would time out.
3. ``verify=True`` with the ranks planning for different dtypes: both raise PlanMismatchError.
4. Rank 0 never posts its send: rank 1 raises DistributedError within the timeout, naming the
   tensor, the step and the peer. (A timed-out receive closes gloo's connection to the
   peer, so this phase is last and the ranks skip the closing barrier.)
"""

from __future__ import annotations

import functools
import re
import time

import pytest
import torch

from runtime import DistributedError, PlanMismatchError, ReshardError, reshard
from runtime.testing import attempt, run_ranks
from shardlang import parse_layout

SHORT = 2.0  # seconds: the timeout of the phase where a peer never sends
SLACK = 4.0  # scheduling on a loaded 2-core machine

SRC = parse_layout("S0 over mesh[1] ranks [0]")
DST = parse_layout("S0 over mesh[1] ranks [1]")
FULL = torch.arange(6.0)


def _phases(rank: int, world_size: int) -> dict[str, object]:
    local = FULL.clone() if rank == 0 else None
    out: dict[str, object] = {}
    # Each bad call only on the ranks where it fails, so that no rank starts a real transfer.
    calls = {
        "local on a target-only rank": (1, lambda: reshard(torch.zeros(6), SRC, DST, global_shape=(6,), dtype="f32")),
        "no local on a source rank": (0, lambda: reshard(None, SRC, DST, global_shape=(6,), dtype="f32")),
        "no dtype": (1, lambda: reshard(None, SRC, DST, global_shape=(6,))),
        "unknown dtype": (None, lambda: reshard(local, SRC, DST, global_shape=(6,), dtype="f31")),
        "a DeviceMesh across meshes": (
            None,
            lambda: reshard(local, SRC, DST, global_shape=(6,), dtype="f32", mesh=object(), name="d"),
        ),
        "outside both meshes": (
            1,
            lambda: reshard(None, SRC, parse_layout("S0 over mesh[1] ranks [5]"), global_shape=(6,), dtype="f32"),
        ),
    }
    out["bad"] = {what: attempt(call) for what, (only, call) in calls.items() if only in (None, rank)}

    if rank == 0:  # a group of its own first: now rank 0 holds one more group than rank 1
        gathered = reshard(local, SRC, parse_layout("R over mesh[1] ranks [0]"), global_shape=(6,), verify=True)
        out["alone"] = torch.equal(gathered, FULL)
    moved = attempt(
        lambda: out.__setitem__(
            "moved", reshard(local, SRC, DST, global_shape=(6,), dtype="f32", verify=True, timeout=30, name="m")
        )
    )
    out["union"] = moved

    dtype = "f32" if rank == 0 else "f64"
    out["mismatch"] = attempt(
        lambda: reshard(local, SRC, DST, global_shape=(6,), dtype=dtype, verify=True, timeout=30, name="w")
    )

    if rank == 1:  # rank 0 never sends
        out["silent_peer"] = attempt(
            lambda: reshard(None, SRC, DST, global_shape=(6,), dtype="f32", timeout=SHORT, name="x")
        )
    else:
        time.sleep(SHORT + SLACK)  # alive, connected, silent: rank 1 must time out, not see a closed socket
    return out


@functools.cache
def _results() -> list:
    # allow_missing: no closing barrier (the timed-out pair is closed); both ranks still report.
    return run_ranks(_phases, 2, timeout=90, collective_timeout=30, allow_missing=(0,))


@pytest.mark.slow
def test_bad_cross_mesh_calls_raise_before_communicating() -> None:
    expected = {
        "local on a target-only rank": (1, r"not in the source mesh mesh\[1\] and holds no piece; pass local=None"),
        "no local on a source rank": (0, r"rank 0 is in the source mesh .*; pass its piece as local"),
        "no dtype": (1, r"rank 1 holds no piece \(it is not in the source mesh\); pass dtype="),
        "unknown dtype": (None, r"unknown dtype 'f31'"),
        "a DeviceMesh across meshes": (None, r"tensor 'd': a DeviceMesh describes one mesh, but .* spans two"),
        "outside both meshes": (1, r"rank 1 is in neither mesh\[1\] nor mesh\[1\] ranks \[5\]"),
    }
    results = _results()
    for what, (only, pattern) in expected.items():
        for rank in (0, 1) if only is None else (only,):
            kind, message, _ = results[rank]["bad"][what]
            assert kind == ReshardError.__name__ and re.search(pattern, message), f"rank {rank}, {what}: {message}"


@pytest.mark.slow
def test_ranks_with_different_group_histories_meet_in_a_new_group() -> None:
    results = _results()
    assert results[0]["alone"] is True
    for rank in (0, 1):
        kind, message, elapsed = results[rank]["union"]
        assert kind == "ok", f"rank {rank}: {message}"
        assert elapsed < SLACK
    assert results[0]["moved"] is None and torch.equal(results[1]["moved"], FULL)


@pytest.mark.slow
def test_mismatched_cross_mesh_plans_raise_on_both_ranks() -> None:
    results = _results()
    for rank in (0, 1):
        kind, message, _ = results[rank]["mismatch"]
        assert kind == PlanMismatchError.__name__, message
        assert "tensor 'w'" in message and "the ranks of mesh[1] and mesh[1] ranks [1] disagree on the plan" in message
        assert "ranks [0] hold plan" in message and "ranks [1] hold plan" in message


@pytest.mark.slow
def test_a_peer_that_never_sends_times_out_naming_tensor_step_and_peer() -> None:
    kind, message, elapsed = _results()[1]["silent_peer"]
    assert kind == DistributedError.__name__, message
    assert "tensor 'x'" in message and "step 1 of 1 (point_to_point(messages=1)" in message
    assert "the receive from rank 0" in message and "timed out after 2 s" in message
    assert SHORT - 0.5 <= elapsed < SHORT + SLACK
