"""A bucket's collective that fails to start on one rank inside a backward hook (``overlap=True``),
on 4 gloo ranks of ``mesh[dp=4]`` (ZeRO-2: params ``R``, gradients ``R | P(dp):avg``, states
``S(dp)``): the failing rank raises our ``OptimizerStepError`` naming the bucket, every other rank
ours too within the failure notice (not the 30 s collective timeout), nothing is committed, the
process group stays usable and the next step runs, equal to a step of ``torch.optim.AdamW`` on the
averaged gradients (docs/design/failures.md).

The failure is injected where ``runtime.execution.buckets`` starts a bucket's collective
(``start_move``), after the bucket has packed its members: the rank must keep their pieces, so
that ``step()`` starts the bucket again and every peer's collective is matched.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.testing import attempt, run_ranks
from tests.failed_step import snapshot, unchanged_since
from tests.test_step_agreement_dist import _backward, _params, _spec

TIMEOUT = 30


def _run(rank: int, world_size: int) -> dict[str, Any]:
    import runtime.execution.buckets as buckets
    from runtime.errors import DistributedError
    from runtime.optim import ShardedAdamW

    params = _params()
    optimizer = ShardedAdamW(list(params.items()), _spec(), lr=0.1, timeout=TIMEOUT, overlap=True, bucket_bytes=64)
    start = buckets.start_move
    failures = [rank == 1]

    def fails_to_start(*args: Any, **kwargs: Any) -> Any:
        if failures and failures.pop():
            raise DistributedError("gloo: connection reset by peer (injected)")
        return start(*args, **kwargs)

    buckets.start_move = fails_to_start
    try:
        saved = snapshot(optimizer, params)
        before = saved[0]
        failed = attempt(lambda: (_backward(params, rank, 0), optimizer.step()))
        unchanged = all(torch.equal(before[n], p) for n, p in params.items())
        states_unchanged = unchanged_since(saved, optimizer, params)  # steps and every state's values
    finally:
        buckets.start_move = start
    optimizer.zero_grad()
    then = attempt(lambda: (_backward(params, rank, 1), optimizer.step()))
    return {
        "failed": failed,
        "unchanged": unchanged,
        "states unchanged": states_unchanged,
        "then": then,
        "before": before,
        "after": {n: p.detach().clone() for n, p in params.items()},
    }


def _reference(before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One torch AdamW step from ``before`` on the gradients averaged over the 4 ranks' batches
    of step 1 (the failed step changed nothing)."""
    params = {n: torch.nn.Parameter(t.clone()) for n, t in before.items()}
    for rank in range(4):  # accumulated: the sum of the ranks' gradients
        _backward(params, rank, 1)
    for p in params.values():
        p.grad /= 4
    reference = torch.optim.AdamW(list(params.values()), lr=0.1)
    reference.step()
    return {n: p.detach() for n, p in params.items()}


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, Any]]:
    return run_ranks(_run, 4, timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("rank", range(4))
def test_a_collective_that_fails_to_start_in_a_hook_fails_every_rank_fast(
    outcomes: list[dict[str, Any]], rank: int
) -> None:
    kind, message, seconds = outcomes[rank]["failed"]
    expected = "connection reset by peer (injected)" if rank == 1 else "failed on another rank of [0, 1, 2, 3]"
    assert (kind, expected in message) == ("OptimizerStepError", True), message
    assert rank != 1 or "bucket " in message, message  # the failing rank names the bucket
    assert seconds < TIMEOUT / 2, seconds  # the failure notice, not the collective's timeout
    assert outcomes[rank]["unchanged"] and outcomes[rank]["states unchanged"]


@pytest.mark.slow
@pytest.mark.parametrize("rank", range(4))
def test_the_step_after_the_failed_one_runs_and_is_exact(outcomes: list[dict[str, Any]], rank: int) -> None:
    assert outcomes[rank]["then"][0] == "ok", outcomes[rank]["then"]
    for name, value in _reference(outcomes[0]["before"]).items():
        torch.testing.assert_close(outcomes[rank]["after"][name], value, rtol=1e-6, atol=1e-7)
