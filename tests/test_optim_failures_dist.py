"""Failed steps of the sharded optimizers on 4 gloo ranks (2 where a peer dies): a step that
fails changes no parameter or state on any rank and names the tensor, ranks that disagree on
the buckets or fail after their last collective refuse the step everywhere, a spec over fewer
ranks is refused where it would idle, and a nonfinite gradient skips the step on every rank.
The cases' data and references are tests/optim_support.py's.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from runtime.testing import run_ranks
from tests.optim_support import (
    ADAMW,
    CAME,
    DP4,
    MLP_SPEC,
    SHAPES,
    _assert_close,
    _optimizer,
    _spec,
    _zero_rows,
    failed_step,
    initial_params,
    local_grad,
    mlp,
    mlp_batches,
    reference,
    step_grads,
)


def _run_failed_step(rank: int, seed: int) -> dict[str, Any]:
    """A gradient of the wrong shape fails one step: that step changes nothing, and the run
    then goes on as if it had not been attempted."""
    from runtime.optim import OptimizerStepError

    spec = _spec(DP4, _zero_rows)
    coordinate = (rank,)
    params = {n: torch.nn.Parameter(t) for n, t in initial_params(torch.float32, seed).items()}
    optimizer = _optimizer("came", list(params.items()), spec)
    message = None
    for step in range(10):
        for name, (grad, addends) in step_grads(torch.float32, seed, step).items():
            params[name].grad = local_grad(grad, addends, spec[name].grad, coordinate)
        if step == 3:
            good = params["t"].grad.clone()
            params["t"].grad.data = torch.zeros(4, 6, 4)  # as a faulty gradient hook might leave it
            saved_params = {n: p.detach().clone() for n, p in params.items()}
            saved_states = optimizer.state_dict()
            try:
                optimizer.step()
            except OptimizerStepError as e:
                message = str(e)
            unchanged = all(torch.equal(saved_params[n], params[n]) for n in SHAPES) and _same_states(
                saved_states, optimizer.state_dict()
            )
            params["t"].grad = good
        optimizer.step()
    return {"message": message, "unchanged": unchanged, "params": {n: p.detach().clone() for n, p in params.items()}}


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


def _same_states(a: dict, b: dict) -> bool:
    if a["tensors"].keys() != b["tensors"].keys():
        return False
    for name, entry in a["tensors"].items():
        other = b["tensors"][name]
        if entry["step"] != other["step"]:
            return False
        for state, record in entry["states"].items():
            if not torch.equal(record["tensor"], other["states"][state]["tensor"]):
                return False
    return True


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


def all_cases(rank: int, world_size: int) -> dict[str, Any]:
    """Every case of this module on this rank."""
    return {
        "failed_step": _run_failed_step(rank, seed=11),
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
    ref, optimizer = reference("came", initial_params(torch.float32, 11), CAME)
    for step in range(10):
        for name, (grad, _) in step_grads(torch.float32, 11, step).items():
            ref[name].grad = grad.clone()
        optimizer.step()
    want = {n: p.detach() for n, p in ref.items()}
    for rank, result in enumerate(ranks):
        case = result["failed_step"]
        assert case["message"] is not None and "'t'" in case["message"], case["message"]
        assert case["unchanged"]
        for name, got in case["params"].items():
            _assert_close("came", torch.float32, got, want[name], f"after the failed step, rank {rank} '{name}'")


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
        if step == 1 and rank == 1:
            os._exit(0)
        if step == 1:
            saved = ({n: p.detach().clone() for n, p in params.items()}, optimizer.state_dict())
            started = time.perf_counter()
            try:
                optimizer.step()
            except OptimizerStepError as e:
                unchanged = all(torch.equal(saved[0][n], params[n]) for n in SHAPES)
                unchanged = unchanged and _same_states(saved[1], optimizer.state_dict())
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
