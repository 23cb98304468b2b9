"""Failed steps of the sharded optimizers on 4 gloo ranks (2 where a peer dies): a step that
fails changes no parameter or state on any rank and names the tensor, ranks that disagree on
the buckets or fail after their last collective refuse the step everywhere, a spec over fewer
ranks is refused where it would idle, and a nonfinite gradient skips the step on every rank.
The cases' data and references are tests/optim_support.py's, the step given a gradient of the
wrong shape tests/failed_step.py's (the other optimizers' tests run it too).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from runtime.testing import run_ranks
from tests.failed_step import check_failed_step, run_failed_step, snapshot, unchanged_since
from tests.optim_support import (
    ADAMW,
    CAME,
    DP4,
    MLP_SPEC,
    SHAPES,
    _optimizer,
    _reference_run,
    _spec,
    _zero_rows,
    failed_step,
    initial_params,
    local_grad,
    mlp,
    mlp_batches,
    step_grads,
)


def _run_mismatched_buckets(rank: int, seed: int) -> dict[str, Any]:
    """Rank 0 cuts its buckets smaller than the others do: every rank must refuse the step
    (not hang, not mix up tensors) and change nothing; a second try refuses again."""
    from runtime.testing import attempt

    spec = _spec(DP4, _zero_rows)
    coordinate = (rank,)
    params = {n: torch.nn.Parameter(t) for n, t in initial_params(torch.float32, seed).items()}
    optimizer = _optimizer("adamw", list(params.items()), spec, bucket_bytes=1 if rank == 0 else None, timeout=30)
    for name, (grad, addends) in step_grads(torch.float32, seed, 0).items():
        params[name].grad = local_grad(grad, addends, spec[name].grad, coordinate)
    before = {n: p.detach().clone() for n, p in params.items()}
    outcomes = [attempt(optimizer.step) for _ in range(2)]
    unchanged = all(torch.equal(before[n], params[n]) for n in SHAPES) and optimizer.state_bytes() == 0
    return {"outcomes": [(kind, message) for kind, message, _ in outcomes], "unchanged": unchanged}


def _run_fails_after_its_last_collective(rank: int, seed: int) -> dict[str, Any]:
    """Rank 1 fails its step after every collective of it has run (as a faulty check at the
    end would): no rank may commit, every rank raises, and the next step runs on all alike."""
    from runtime.optim import OptimizerStepError, ShardedAdamW

    class FailsOnRank1(ShardedAdamW):
        fail = True

        def _stage(self, slots: list, backward: Any = None) -> Any:
            commit = super()._stage(slots, backward)
            if rank == 1 and self.fail:
                self.fail = False
                raise OptimizerStepError("rank 1 fails at the end of its step")
            return commit

    spec = _spec(DP4, _zero_rows)
    params = {n: torch.nn.Parameter(t) for n, t in initial_params(torch.float32, seed).items()}
    optimizer = FailsOnRank1(list(params.items()), spec, **ADAMW, timeout=30)
    message, unchanged = failed_step(optimizer, params, spec, rank, seed)
    optimizer.step()  # the retry succeeds everywhere
    moved = all(not torch.equal(t, params[n]) for n, t in initial_params(torch.float32, seed).items())
    return {"message": message, "unchanged": unchanged, "moved": moved}


def _run_smaller_mesh(rank: int) -> tuple[str, str, float]:
    """A spec over 2 ranks in a 4-rank job: the ranks it leaves out must refuse it."""
    from runtime.testing import attempt

    spec = _spec("mesh[dp=2]", _zero_rows)
    params = {n: torch.nn.Parameter(t) for n, t in initial_params(torch.float32, 16).items()}
    return attempt(lambda: _optimizer("adamw", list(params.items()), spec))


def _run_nonfinite(rank: int, seed: int) -> dict[str, Any]:
    """A NaN in one rank's gradient at step 3: every rank skips that step, and only that one."""
    from shardlang import parse_spec

    model = mlp(seed)
    optimizer = _optimizer("adamw", list(model.named_parameters()), parse_spec(MLP_SPEC), skip_nonfinite=True)
    skipped, unchanged = [], None
    for step in range(5):
        x, y = mlp_batches(seed, step)
        mine = slice(3 * rank, 3 * rank + 3)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        if step == 3 and rank == 2:
            next(model.parameters()).grad[0, 0] = float("nan")
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        skipped.append(optimizer.last_step_skipped)
        if step == 3:
            unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    steps = {entry["step"] for entry in optimizer.state_dict()["tensors"].values()}
    return {"skipped": skipped, "unchanged": unchanged, "steps": steps}


def _came(named: list, spec: Any) -> Any:
    return _optimizer("came", named, spec)


def all_cases(rank: int, world_size: int) -> dict[str, Any]:
    """Every case of this module on this rank."""
    return {
        "failed_step": run_failed_step(rank, _came, 11, "t", (4, 6, 4), config="zero_rows", steps=10),
        "mismatched_buckets": _run_mismatched_buckets(rank, seed=13),
        "nonfinite": _run_nonfinite(rank, seed=15),
        "smaller_mesh": _run_smaller_mesh(rank),
        "late_failure": _run_fails_after_its_last_collective(rank, seed=17),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(all_cases, 4, timeout=300)


@pytest.mark.slow
def test_a_failed_step_changes_nothing_and_names_the_tensor(ranks: list[dict[str, Any]]) -> None:
    want = _reference_run("came", torch.float32, 11, 10, CAME)
    check_failed_step(ranks, "failed_step", want, "t", "came_pytorch", config="zero_rows")


@pytest.mark.slow
def test_a_rank_failing_after_its_last_collective_leaves_every_rank_unchanged(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        case = result["late_failure"]
        if rank == 1:
            assert case["message"] == "rank 1 fails at the end of its step", case
        else:
            assert case["message"] is not None and "failed on another rank of [0, 1, 2, 3]" in case["message"], case
        assert case["unchanged"] and case["moved"], (rank, case)


@pytest.mark.slow
def test_a_spec_over_fewer_ranks_than_the_job_is_refused_where_it_would_idle(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        kind, message, _ = result["smaller_mesh"]
        if rank < 2:
            assert kind == "ok", (rank, message)
            continue
        assert kind == "OptimizerError", (rank, kind, message)
        assert f"rank {rank} holds it" in message and "ranks [0, 1]" in message and "idle_ranks=True" in message
        assert message.startswith("tensor 'w': ")


@pytest.mark.slow
def test_ranks_with_other_buckets_refuse_the_step_everywhere(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        case = result["mismatched_buckets"]
        for kind, message in case["outcomes"]:
            assert kind == "PlanMismatchError", (rank, kind, message)
            assert "disagree on the step plan" in message and "ranks [" in message
        assert case["unchanged"], rank


@pytest.mark.slow
def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        case = result["nonfinite"]
        assert case["skipped"] == [False, False, False, True, False], (rank, case)
        assert case["unchanged"] and case["steps"] == {4}, (rank, case)


# --- a peer that dies ------------------------------------------------------------------
def _peer_dies(rank: int, world_size: int) -> dict[str, Any]:
    from runtime.optim import OptimizerStepError

    spec = _spec("mesh[dp=2]", _zero_rows)
    params = {n: torch.nn.Parameter(t) for n, t in initial_params(torch.float32, 13).items()}
    optimizer = _optimizer("came", list(params.items()), spec, timeout=20.0)
    for step in range(2):
        for name, (grad, addends) in step_grads(torch.float32, 13, step).items():
            params[name].grad = local_grad(grad, addends, spec[name].grad, (rank,))
        if step == 1 and rank == 1:  # between steps: the flag after the last one has arrived
            optimizer.wait_params()
            os._exit(0)
        if step == 1:
            saved = snapshot(optimizer, params)
            started = time.perf_counter()
            try:
                optimizer.step()
            except OptimizerStepError as e:
                unchanged = unchanged_since(saved, optimizer, params)
                return {"message": str(e), "seconds": time.perf_counter() - started, "unchanged": unchanged}
            return {"message": None}
        optimizer.step()
    return {"message": None}


@pytest.mark.slow
def test_a_peer_that_dies_fails_the_step_within_the_timeout() -> None:
    result = run_ranks(_peer_dies, 2, timeout=120, collective_timeout=30, allow_missing=(1,))[0]
    assert result["message"] is not None, "the step succeeded without its peer"
    assert "parameters and optimizer states are unchanged" in result["message"]
    assert result["seconds"] < 25
    assert result["unchanged"]
