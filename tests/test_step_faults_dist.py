"""Faults of one rank that the others' step cannot see, on 4 gloo ranks of ``mesh[dp=4]``
(ZeRO-2: params ``R``, gradients ``R | P(dp):avg``, states ``S(dp)``). Each ends in
``OptimizerStepError`` on every rank, its text golden (tests/golden/step_errors.txt), with
parameters and states unchanged everywhere, and the next step runs:

- a rank that skips both ``step()`` and ``zero_grad()`` for one iteration: its next step pairs
  with the others' with the gradients of two backward passes (step number and ``zero_grad()``
  count agree), named by the backward passes the commit flag's digest carries;
- a NaN gradient on one rank without ``skip_nonfinite`` (``ShardedAdamW`` in place), an inf in
  one element under ``overlap=True``, a NaN with ``max_grad_norm`` (the norm's test) in
  ``ShardedCAME`` (the math into spare states before the commit point): named with the tensor,
  the ranks whose reduced gradient holds it and the rank whose own gradient did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.testing import attempt, run_ranks
from tests.failed_step import snapshot, unchanged_since
from tests.golden_blocks import golden_blocks
from tests.test_step_agreement_dist import (  # the same job
    _backward,
    _params,
    _spec,
    _usable,
    check_a_step_out_of_step,
)

GOLDEN = Path(__file__).parent / "golden" / "step_errors.txt"


def _skipped_step_and_zero_grad(rank: int) -> dict[str, Any]:
    """Rank 1 runs backward at iteration 1 but neither ``step()`` nor ``zero_grad()``: its step
    of iteration 2 (gradients of iterations 1 and 2) pairs with the others' of iteration 1."""
    from runtime.optim import ShardedAdamW

    params = _params()
    optimizer = ShardedAdamW(list(params.items()), _spec(), lr=0.1, timeout=30)
    outcomes, snapshots = [], []
    for step in range(3 if rank == 1 else 2):
        _backward(params, rank, step)
        if rank == 1 and step == 1:
            continue
        snapshots.append(snapshot(optimizer, params))
        outcomes.append(attempt(optimizer.step))
        optimizer.zero_grad()
    unchanged = unchanged_since(snapshots[-1], optimizer, params)
    _backward(params, rank, 3)  # every rank in step again: the step runs
    then = attempt(optimizer.step)
    return {"outcomes": outcomes, "unchanged": unchanged, "usable": _usable(), "then": then}


def _nonfinite(rank: int, kind: str) -> dict[str, Any]:
    """One rank's gradient not finite, no ``skip_nonfinite``: refused everywhere, then a finite
    step runs and moves the parameters."""
    from runtime.optim import ShardedAdamW, ShardedCAME

    params = _params()
    if kind == "nan":
        optimizer: Any = ShardedAdamW(list(params.items()), _spec(), lr=0.1, timeout=30)
    elif kind == "inf, overlap":
        optimizer = ShardedAdamW(
            list(params.items()), _spec(), lr=0.1, timeout=30, overlap=True, bucket_bytes=64, free_grads=False
        )
        if rank == 1:  # one element of b's gradient, before it accumulates (and its bucket starts)
            params["b"].register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    else:
        optimizer = ShardedCAME(list(params.items()), _spec(), lr=0.1, timeout=30, max_grad_norm=1.0)
    before = snapshot(optimizer, params)
    failed = attempt(lambda: (_backward(params, rank, 0, nan=rank == 2 and kind != "inf, overlap"), optimizer.step()))
    unchanged = unchanged_since(before, optimizer, params)
    optimizer.zero_grad()
    if kind == "inf, overlap":
        params["b"]._backward_hooks = None  # the fault was once
    then = attempt(lambda: (_backward(params, rank, 1), optimizer.step()))
    finite = all(bool(torch.isfinite(p).all()) for p in params.values())
    moved = not all(torch.equal(before[0][n], p) for n, p in params.items())
    return {"failed": failed, "unchanged": unchanged, "then": then, "moved": moved, "finite": finite}


def _run(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "skipped step and zero_grad": _skipped_step_and_zero_grad(rank),
        "nan": _nonfinite(rank, "nan"),
        "inf, overlap": _nonfinite(rank, "inf, overlap"),
        "nan, came, max_grad_norm": _nonfinite(rank, "nan, came, max_grad_norm"),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_run, 4, timeout=240)


@pytest.mark.slow
def test_a_rank_that_skipped_step_and_zero_grad_is_named_and_nothing_commits(ranks: list[dict[str, Any]]) -> None:
    check_a_step_out_of_step(ranks, "skipped step and zero_grad")
    for rank, out in enumerate(ranks):
        assert out["skipped step and zero_grad"]["then"][0] == "ok", (rank, out["skipped step and zero_grad"]["then"])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["nan", "inf, overlap", "nan, came, max_grad_norm"])
def test_a_nonfinite_gradient_is_named_on_every_rank_before_anything_commits(
    ranks: list[dict[str, Any]], case: str
) -> None:
    got = [f"rank {rank}: {out[case]['failed'][0]}: {out[case]['failed'][1]}" for rank, out in enumerate(ranks)]
    assert got == golden_blocks(GOLDEN)[case], "\n".join(got)
    for rank, out in enumerate(ranks):
        assert out[case]["unchanged"], rank
        assert out[case]["then"][0] == "ok" and out[case]["moved"] and out[case]["finite"], (rank, out[case])


def test_a_nonfinite_gradient_on_one_process_is_refused_and_changes_nothing() -> None:
    """Without a process group (or with ``all_ranks_commit=False``) the test runs on the rank
    alone: the same error, nothing written, and a finite step then runs."""
    from runtime.optim import ShardedAdamW
    from runtime.optim.errors import OptimizerStepError
    from shardlang.spec import Layouts

    spec = {"w": Layouts(param=_one("R,R"), grad=_one("R,R"), states=(("", _one("R,R")),))}
    w = torch.nn.Parameter(torch.ones(8, 6))
    optimizer = ShardedAdamW([("w", w)], spec, lr=0.1)
    w.grad = torch.zeros(8, 6)
    w.grad[2, 3] = float("inf")
    with pytest.raises(OptimizerStepError) as caught:
        optimizer.step()
    assert str(caught.value) == (
        "step 1 was refused: the gradients hold NaN or inf: 'w' (inf); before the reduction, 'w' (inf): pass "
        "skip_nonfinite=True to skip such steps (with a warning), or find where it comes from (a NaN loss, too "
        "high a learning rate); parameters and optimizer states are unchanged on every rank"
    )
    assert torch.equal(w.detach(), torch.ones(8, 6)) and not optimizer.state_dict()["tensors"]
    w.grad[2, 3] = 1.0
    optimizer.step()
    assert not torch.equal(w.detach(), torch.ones(8, 6))


def _one(text: str) -> Any:
    from shardlang import parse_layout

    return parse_layout(f"{text} over mesh[1]")
