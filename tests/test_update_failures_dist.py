"""A rank whose update fails mid-step (its math raising, as an out-of-memory error would) on 4
gloo ranks: every rank raises, nothing changes anywhere, and the ranks it shares buckets with
are not left waiting for collectives it never joins: the next step runs on every rank and
equals the reference optimizer's first step. AdamW fails after its math wrote its new buffers;
CAME fails between its phases of sums; AdamW again with ``prefetch_params``, whose gathers
after the failed step land late (:class:`_LateGathers`): any of them the failed step leaves in
flight corrupts the next step, which shares their buffers.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
from collections.abc import Generator, Iterator
from typing import Any

import attrs
import pytest
import torch

import runtime.buckets
from runtime.comm import PendingCollective, start_collective
from runtime.testing import run_ranks
from tests.test_optim_dist import (
    ADAMW,
    CAME,
    DP4,
    _assert_close,
    _optimizer,
    _spec,
    _zero_rows,
    failed_step,
    initial_params,
    reference,
    step_grads,
)

CASES = {"adamw": ("adamw", False), "came": ("came", False), "adamw_prefetch": ("adamw", True)}
SEED = 23
FAILING_RANK = 1


@attrs.define(eq=False)
class _Landing:
    """A gather's result held back until it is waited on, or until any later collective
    finishes (:class:`_LateGathers`)."""

    pending: PendingCollective
    out: torch.Tensor
    late: list[_Landing]

    def wait(self, timeout: datetime.timedelta) -> bool:
        if self in self.late:
            self.late.remove(self)
            self.out.copy_(self.pending.wait(timeout))
        return True


@attrs.define(eq=False)
class _Flush:
    """The last work of every other collective: the late gathers land once its own works are
    done, before its result is read (a gloo reduce_scatter's blocks are reduced after it)."""

    late: list[_Landing]

    def wait(self, timeout: datetime.timedelta) -> bool:
        for landing in list(self.late):
            landing.wait(timeout)
        return True


class _LateGathers:
    """Bucket collectives whose all_gathers, while ``delaying``, write their results only when
    waited on or else as late as gloo's threads may: right after the next collective's
    transfer, before that one's result is read."""

    def __init__(self) -> None:
        self.late: list[_Landing] = []
        self.delaying = False

    def start(self, op: str, send: torch.Tensor, *args: Any, out: torch.Tensor | None = None, **kw: Any) -> Any:
        if self.delaying and op == "all_gather" and out is not None:
            pending = start_collective(op, send, *args, out=torch.empty_like(out), **kw)
            landing = _Landing(pending, out, self.late)
            self.late.append(landing)
            return attrs.evolve(pending, received=out, works=(landing,))
        pending = start_collective(op, send, *args, out=out, **kw)
        return attrs.evolve(pending, works=(*pending.works, _Flush(self.late)))

    @contextlib.contextmanager
    def delayed(self) -> Iterator[None]:
        self.delaying = True
        try:
            yield
        finally:
            self.delaying = False


def _fails_after_its_first_phase(update: Generator) -> Generator:
    yield next(update)
    raise RuntimeError("injected failure between the phases")


def _run_case(rank: int, kind: str, prefetch: bool) -> dict[str, Any]:
    spec = _spec(DP4, _zero_rows)
    params = torch.nn.ParameterDict({n: torch.nn.Parameter(t) for n, t in initial_params(torch.float32, SEED).items()})
    optimizer = _optimizer(kind, list(params.items()), spec, timeout=20)
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
    gathers = _LateGathers()
    runtime.buckets.start_collective = gathers.start  # type: ignore[assignment]
    try:
        with gathers.delayed() if prefetch else contextlib.nullcontext():
            message, unchanged = failed_step(optimizer, params, spec, rank, SEED)
        optimizer.step()  # the same gradients again: every rank's groups still work
        optimizer.wait_params()
    finally:
        runtime.buckets.start_collective = start_collective
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
