"""Declared replication checked by the optimizers (``verify_replicas``), on 4 gloo ranks of
``mesh[dp=4]``: parameters that differ across ranks when the optimizer is built, gradients
declared ``R`` that no DDP reduced at the first step (and every N-th with ``verify_replicas=N``),
states that differ in what ``load_state_dict`` is given. Each ends in ``ReplicaMismatchError``
on every rank with nothing changed, its text golden (tests/golden/replica_errors.txt); equal
replicas train on, and ``verify_replicas=False`` turns the check off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.testing import attempt, run_ranks
from tests.failed_step import snapshot, unchanged_since
from tests.golden_blocks import golden_blocks

GOLDEN = Path(__file__).parent / "golden" / "replica_errors.txt"
MESH = "mesh[dp=4]"
SHAPES = {"w": (8, 6), "b": (6,)}


def _spec(grad: str, state: str = "S(dp),R") -> dict:
    from shardlang import parse_layout
    from shardlang.spec import Layouts, TensorSpec

    def layouts(n: int) -> Layouts:
        dims = ",".join(["R"] * n)
        grad_text = dims + (" | P(dp):avg" if grad == "avg" else "")
        state_text = state if n == 2 else ("S(dp)" if state.startswith("S") else "R")
        return Layouts(
            param=parse_layout(f"{dims} over {MESH}"),
            grad=parse_layout(f"{grad_text} over {MESH}"),
            states=(("", parse_layout(f"{state_text} over {MESH}")),),
        )

    return {n: TensorSpec(name=n, dtype="f32", shape=s, layouts=layouts(len(s))) for n, s in SHAPES.items()}


def _params(rank: int, off_on: int | None = None) -> dict[str, torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=generator)) for n, s in SHAPES.items()}
    if rank == off_on:
        with torch.no_grad():
            params["w"][3, 1] += 1e-3  # a forgotten seed on one rank
    return params


def _grads(params: dict[str, torch.nn.Parameter], rank: int, step: int, reduced: bool) -> None:
    """Equal gradients on every rank (``reduced``, as DDP leaves them) or each rank its own."""
    generator = torch.Generator().manual_seed(100 + step + (0 if reduced else 1000 * rank))
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=generator)


def _run(rank: int, world_size: int) -> dict[str, Any]:
    from runtime.optim import ShardedAdamW

    out: dict[str, Any] = {}
    # 1. Parameters that differ when the optimizer is built; and with the check off.
    params = _params(rank, off_on=2)
    out["parameters"] = attempt(lambda: ShardedAdamW(list(params.items()), _spec("avg"), lr=0.1, timeout=30))
    # The same with replicated states (each rank would keep its own model and its own states).
    out["parameters, replicated states"] = attempt(
        lambda: ShardedAdamW(list(params.items()), _spec("avg", state="R,R"), lr=0.1, timeout=30)
    )
    out["parameters, off"] = attempt(
        lambda: ShardedAdamW(list(params.items()), _spec("avg"), lr=0.1, timeout=30, verify_replicas=False)
    )

    # 2. Gradients declared R, not reduced: refused at the first step, nothing changed; once
    # they are reduced the step runs.
    params = _params(rank)
    optimizer = ShardedAdamW(list(params.items()), _spec("R"), lr=0.1, timeout=30)
    _grads(params, rank, 0, reduced=False)
    before = snapshot(optimizer, params)
    out["gradients"] = attempt(optimizer.step)
    out["gradients, unchanged"] = unchanged_since(before, optimizer, params)
    _grads(params, rank, 0, reduced=True)
    out["gradients, then reduced"] = attempt(optimizer.step)
    out["gradients, moved"] = not torch.equal(before[0]["w"], params["w"])

    # 3. verify_replicas=2: the first step and every second after it.
    params = _params(rank)
    optimizer = ShardedAdamW(list(params.items()), _spec("R"), lr=0.1, timeout=30, verify_replicas=2)
    cadence = []
    for step in range(4):
        _grads(params, rank, step, reduced=step == 0)
        cadence.append(attempt(optimizer.step)[0])
        if cadence[-1] != "ok":
            _grads(params, rank, step, reduced=True)
            optimizer.step()
    out["every 2"] = cadence

    # 4. States in a replicated layout loaded with other values on one rank.
    params = _params(rank)
    optimizer = ShardedAdamW(list(params.items()), _spec("avg", state="R,R"), lr=0.1, timeout=30)
    _grads(params, rank, 0, reduced=True)
    optimizer.step()
    saved = optimizer.state_dict()
    if rank == 1:
        saved["tensors"]["b"]["states"]["exp_avg"]["tensor"][2] += 1.0
    _grads(params, rank, 1, reduced=True)
    optimizer.step()
    before = snapshot(optimizer, params)
    out["states"] = attempt(lambda: optimizer.load_state_dict(saved))
    out["states, unchanged"] = unchanged_since(before, optimizer, params)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_run, 4, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["parameters", "gradients", "states"])
def test_each_mistake_is_the_golden_error_on_every_rank(ranks: list[dict[str, Any]], case: str) -> None:
    got = [f"rank {rank}: {out[case][0]}: {out[case][1]}" for rank, out in enumerate(ranks)]
    assert got == golden_blocks(GOLDEN)[case], "\n".join(got)
    if case != "parameters":  # the first collectives of the job create its groups: slow under load
        assert all(out[case][2] < 10 for out in ranks), [out[case][2] for out in ranks]


@pytest.mark.slow
def test_parameters_that_differ_are_refused_whatever_the_states_layout(ranks: list[dict[str, Any]]) -> None:
    case = "parameters, replicated states"
    got = [f"rank {rank}: {out[case][0]}: {out[case][1]}" for rank, out in enumerate(ranks)]
    assert got == golden_blocks(GOLDEN)["parameters"], "\n".join(got)


@pytest.mark.slow
def test_nothing_changes_and_reduced_gradients_train_on(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert out["gradients, unchanged"] and out["states, unchanged"]
        assert out["gradients, then reduced"][0] == "ok", out["gradients, then reduced"]
        assert out["gradients, moved"]


@pytest.mark.slow
def test_the_check_turns_off_and_runs_every_n_steps(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert out["parameters, off"][0] == "ok", out["parameters, off"]
        # step 1 checked (equal), step 2 not (differing, unseen), step 3 checked (differing)
        assert out["every 2"] == ["ok", "ok", "ReplicaMismatchError", "ok"], out["every 2"]
