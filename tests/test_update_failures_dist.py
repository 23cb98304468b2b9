"""A rank whose update fails mid-step (its math raising, as an out-of-memory error would) on 4
gloo ranks.

With the whole step on spare buffers (``transactional=True``; CAME always): every rank raises,
nothing changes anywhere, and the ranks it shares buckets with are not left waiting for
collectives it never joins: the next step runs on every rank and equals the reference
optimizer's first step. AdamW fails after its math wrote its new buffers; CAME fails between
its phases of sums; AdamW again with ``prefetch_params``, whose gathers of the failed step land
late (``tests.late_results``): any of them the failed step leaves in flight corrupts the next
step, which shares their buffers.

In place (AdamW's default), the math runs after the commit point: a failure there, or a peer
that dies during the final gather, is raised on every rank within seconds (the second flag):
at once on the rank that failed, at their next call into the optimizer on the others (the flag
is posted, not waited on, by a step that went well); every later ``step()`` refuses to run
(docs/memory.md, "The commit point").
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Generator
from typing import Any

import pytest
import torch

from runtime.testing import run_ranks
from tests.late_results import LateResults
from tests.optim_support import (
    ADAMW,
    CAME,
    DP4,
    _assert_close,
    _optimizer,
    _spec,
    _zero_rows,
    failed_step,
    initial_params,
    local_grad,
    reference,
    step_grads,
)

CASES = {"adamw": ("adamw", False), "came": ("came", False), "adamw_prefetch": ("adamw", True)}
SEED = 23
FAILING_RANK = 1


def _fails_after_its_first_phase(update: Generator) -> Generator:
    yield next(update)
    raise RuntimeError("injected failure between the phases")


def _run_case(rank: int, kind: str, prefetch: bool) -> dict[str, Any]:
    spec = _spec(DP4, _zero_rows)
    params = torch.nn.ParameterDict({n: torch.nn.Parameter(t) for n, t in initial_params(torch.float32, SEED).items()})
    optimizer = _optimizer(kind, list(params.items()), spec, timeout=20, transactional=True)
    if prefetch:
        optimizer.prefetch_params(params)
    fail = [rank == FAILING_RANK]
    updates = optimizer._updates

    def failing_updates(work: Any) -> list:
        made = updates(work)
        if not fail[0]:
            return made
        fail[0] = False
        if kind == "adamw":
            raise RuntimeError("injected out of memory after the math")
        return [_fails_after_its_first_phase(made[0]), *made[1:]]

    optimizer._updates = failing_updates
    with LateResults().installed() as late:
        with late.delayed() if prefetch else contextlib.nullcontext():
            message, unchanged = failed_step(optimizer, params, spec, rank, SEED)
        optimizer.step()  # the same gradients again: every rank's groups still work
        optimizer.wait_params()
    return {"message": message, "unchanged": unchanged, "params": {n: p.detach().clone() for n, p in params.items()}}


def _run(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    return {case: _run_case(rank, kind, prefetch) for case, (kind, prefetch) in CASES.items()}


@functools.cache
def _results() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_run, 4, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_failed_update_fails_the_step_everywhere_and_the_next_one_runs(case: str) -> None:
    kind, _ = CASES[case]
    ref, optimizer = reference(kind, initial_params(torch.float32, SEED), ADAMW if kind == "adamw" else CAME)
    for name, (grad, _) in step_grads(torch.float32, SEED, 0).items():
        ref[name].grad = grad.clone()
    optimizer.step()
    for rank, result in enumerate(_results()):
        got = result[case]
        message = got["message"] or ""
        if rank == FAILING_RANK:
            assert "step 1 failed in the update on rank 1: RuntimeError: injected" in message, message
        else:
            assert "step 1 failed on another rank of [0, 1, 2, 3]" in message, message
        assert "unchanged on every rank" in message, message
        assert got["unchanged"], f"{case}: rank {rank} changed in the failed step"
        for name, param in got["params"].items():
            label = f"{case}: rank {rank} '{name}' after the retry"
            _assert_close(kind, torch.float32, param, ref[name].detach(), label)


def _run_in_place(rank: int, world_size: int, prefetch: bool, how: str) -> dict[str, Any]:
    """AdamW in place, its first step failing after the commit point on rank 1 (``how``: its
    math raises, or it dies in the final gather): what each rank raised, how soon, and what
    the next ``step()`` says."""
    import runtime.execution.run
    from runtime.optim import OptimizerStepError

    spec = _spec(DP4, _zero_rows)
    params = torch.nn.ParameterDict({n: torch.nn.Parameter(t) for n, t in initial_params(torch.float32, SEED).items()})
    optimizer = _optimizer("adamw", list(params.items()), spec, timeout=20)
    if prefetch:
        optimizer.prefetch_params(params)
    if rank == FAILING_RANK and how == "math":

        def failing_updates(work: Any) -> list:
            raise RuntimeError("injected failure in the update")

        optimizer._updates = failing_updates
    if rank == FAILING_RANK and how == "dies":
        start = runtime.execution.run.start_collective

        def dying(op: str, *args: Any, **kwargs: Any) -> Any:
            if op == "all_gather":
                os._exit(0)
            return start(op, *args, **kwargs)

        runtime.execution.run.start_collective = dying
    if rank == FAILING_RANK and how == "exits":  # its step done, before it posts the flag after it
        optimizer._transaction.flag.post = lambda *args, **kwargs: os._exit(0)
    for name, (grad, addends) in step_grads(torch.float32, SEED, 0).items():
        params[name].grad = local_grad(grad, addends, spec[name].grad, (rank,))
    started = time.monotonic()
    messages, raised_by = [], None
    for call in (optimizer.step, optimizer.wait_params):
        try:
            call()
        except OptimizerStepError as e:
            messages.append(str(e))
            raised_by = call.__name__
            break
    seconds = time.monotonic() - started
    try:
        optimizer.step()
    except OptimizerStepError as e:
        messages.append(str(e))
    return {"messages": messages, "seconds": seconds, "raised_by": raised_by}


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
def test_an_update_failing_after_the_commit_point_is_raised_on_every_rank(prefetch: bool) -> None:
    for rank, got in enumerate(run_ranks(_run_in_place, 4, args=(prefetch, "math"), timeout=120)):
        first, then = got["messages"]
        where = "rank 1: RuntimeError: injected" if rank == FAILING_RANK else "another rank of [0, 1, 2, 3]"
        assert f"step 1 failed after its commit point on {where}" in first, first
        assert "load a checkpoint to go on" in first, first
        assert then == first, f"rank {rank}: the next step ran after a failure past the commit point"
        assert got["seconds"] < 10, f"rank {rank} took {got['seconds']:.1f} s to learn of the failure"
        # The failing rank raises in its step; the others' step() does not wait for the flag
        # after the commit point: their next call into the optimizer raises.
        assert got["raised_by"] == ("step" if rank == FAILING_RANK else "wait_params"), (rank, got["raised_by"])


def _survivors(how: str) -> list[tuple[int, dict[str, Any]]]:
    """What the ranks but the one that leaves (``how``: before the flag after the commit point,
    or in the final gather) saw, with their ranks."""
    ranks = run_ranks(
        _run_in_place, 4, args=(False, how), timeout=120, collective_timeout=30, allow_missing=(FAILING_RANK,)
    )
    return [(rank, got) for rank, got in enumerate(ranks) if rank != FAILING_RANK]


@pytest.mark.slow
def test_a_peer_exiting_before_the_flag_after_the_commit_point_is_raised_at_the_next_call() -> None:
    for rank, got in _survivors("exits"):
        first, then = got["messages"]
        # Its step finished here, but whether it did on the rank that left cannot be known.
        assert got["raised_by"] == "wait_params", (rank, got["raised_by"])
        assert "step 1 may have failed after its commit point: the flag after it did not come from every rank" in first
        assert "(a peer failed: " in first or "(timed out after 20 s" in first, first
        assert "load a checkpoint to go on" in first, first
        assert then == first
        assert got["seconds"] < 25, f"rank {rank} took {got['seconds']:.1f} s (timeout 20 s)"


@pytest.mark.slow
def test_a_peer_dying_in_the_final_gather_is_raised_on_every_other_rank() -> None:
    for rank, got in _survivors("dies"):
        first, then = got["messages"]
        assert "step 1 failed after its commit point on rank" in first, first
        assert "load a checkpoint to go on" in first, first
        assert then == first
        assert got["seconds"] < 25, f"rank {rank} took {got['seconds']:.1f} s (timeout 20 s)"
