"""Overlap on 4 gloo ranks: buckets started during backward, parameters gathered before forward.

Every tensor is the weight of a module of its own whose forward is ``(weight * g).sum()``, so
backward gives each rank exactly its piece ``g`` of the gradients the optimizer tests use
(dyadic, so partial sums are exact in any order), split over 1 or 4 micro-batches of
``g / 4`` (also exact). A run with ``overlap=True`` (and ``prefetch_params``) must equal the run
without it bit for bit (AdamW) or to 1e-12 (CAME in fp64), and both must equal the single-process
reference on the full tensors. So must a run whose gradients change after backward started their
buckets (``CHANGED``): the step reduces them again, and says so once.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from typing import Any

import pytest
import torch

from runtime.testing import run_ranks
from tests.late_results import LateResults
from tests.optim_support import (
    ADAMW,
    CAME,
    CONFIGS,
    OWN_STATES,
    SHAPES,
    _assert_close,
    _optimizer,
    _reference_run,
    _spec,
    hand_piece,
    initial_params,
    local_grad,
    step_grads,
)

STEPS = 6
LAYOUTS = ("zero_rows", "flat_zero", "dp2_tp2", "nested_tp_dp", "three_ranks", "flat_zero_with_tp", "own_exp_avg")
KINDS = (("adamw", torch.float32), ("came", torch.float64))
# name: (overlap, prefetch_params, micro-batches, results landing late: tests.late_results,
# free_grads: False keeps the gradients; None, the default, frees every gradient once its
# bucket packed it, ZeRO-2 proper)
MODES = {
    "plain": (False, False, 1, False, False),
    "overlap": (True, False, 4, False, False),
    "overlap_prefetch": (True, True, 1, False, False),
    "overlap_prefetch_micro4": (True, True, 4, False, False),
    "overlap_prefetch_late": (True, True, 2, True, False),
    "overlap_free_micro4": (True, False, 4, False, None),
    "overlap_free_prefetch_late": (True, True, 2, True, None),
}
BUCKET_BYTES = 512  # small buckets: several start during backward, at different times
# Gradients changed after their buckets took them: backward of twice the pieces, then halved in
# place (as GradScaler.unscale_ does); or two backwards of half the pieces outside no_sync().
CHANGED = ("halved_in_place", "accumulated_without_no_sync")
CHANGED_LAYOUTS = ("zero_rows", "dp2_tp2")


class Piece(torch.nn.Module):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(value)

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.weight * g).sum()


class Pieces(torch.nn.Module):
    """One module per tensor; forward takes every tensor's gradient piece."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleDict({n: Piece(v) for n, v in values.items()})

    def forward(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((self.parts[n](g) for n, g in grads.items()), torch.zeros((), dtype=grads["w"].dtype))


def _run(
    rank: int, config: str, kind: str, dtype: torch.dtype, mode: str, seed: int, changed: str | None = None
) -> dict[str, Any] | None:
    from planner.legs import BEFORE, DURING_BACKWARD

    overlap, prefetch, micro, late, free = MODES[mode]
    mesh, layouts_of, flat_axis = CONFIGS[config]
    spec = _spec(mesh, layouts_of, own=OWN_STATES.get(config))
    the_mesh = next(iter(spec.values())).param.mesh
    if rank not in the_mesh.ranks:
        return None
    coordinate = the_mesh.coordinate(rank)
    model = Pieces(
        {
            n: hand_piece(t, spec[n].param.dims, the_mesh.shape, coordinate).clone()
            for n, t in initial_params(dtype, seed).items()
        }
    )
    named = [(n, model.parts[n].weight) for n in SHAPES]
    optimizer = _optimizer(
        kind, named, spec, flat_axis=flat_axis, overlap=overlap, bucket_bytes=BUCKET_BYTES, free_grads=free
    )
    if prefetch:
        optimizer.prefetch_params(*model.parts.values())
    started, kept_grads = [], []
    results = LateResults()
    with (
        warnings.catch_warnings(record=True) as warned,
        results.installed(),
        results.delayed() if late else nullcontext(),
    ):
        warnings.simplefilter("always")
        for step in range(STEPS):
            pieces = {
                n: local_grad(grad, addends, spec[n].grad, coordinate)
                for n, (grad, addends) in step_grads(dtype, seed, step).items()
            }
            optimizer.zero_grad()
            if changed == "halved_in_place":
                model({n: g * 2 for n, g in pieces.items()}).backward()
                for name in SHAPES:
                    model.parts[name].weight.grad.mul_(0.5)
            elif changed == "accumulated_without_no_sync":
                for _ in range(2):
                    model({n: g * 0.5 for n, g in pieces.items()}).backward()
            for k in range(micro if changed is None else 0):
                scale = 1.0 / micro  # exact: micro is 1, 2 or 4
                if k < micro - 1:
                    with optimizer.no_sync():
                        model({n: g * scale for n, g in pieces.items()}).backward()
                        assert optimizer.buckets_started == 0, "a bucket started inside no_sync"
                else:
                    model({n: g * scale for n, g in pieces.items()}).backward()
            # Gradients left after backward: freed by default, but those whose legs send nothing.
            kept_grads.append(sorted(n for n in SHAPES if _kept(model.parts[n].weight.grad)))
            plan = optimizer.step_plan()
            before = plan.stage_buckets(BEFORE)
            if overlap:
                assert all(b.launch == DURING_BACKWARD for b in before)
            started.append((optimizer.buckets_started, len(before)))
            optimizer.step()
    optimizer.wait_params()  # the last step's gathers (forward would wait for them)
    params = {n: model.parts[n].weight.detach().clone() for n in SHAPES}
    said_again = [str(w.message) for w in warned if "reduced the gradients again" in str(w.message)]
    return {
        "coordinate": coordinate,
        "params": params,
        "started": started,
        "said_again": said_again,
        "kept_grads": kept_grads,
    }


def _kept(grad: torch.Tensor | None) -> bool:
    from runtime.optim.freed_grads import is_freed

    return grad is not None and not is_freed(grad)


def _peer_dies_in_backward(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 exits in the middle of the backward of step 1 (after the buckets of the tensors
    backward finishes first have started); rank 0's step must fail within its timeout and
    change nothing."""
    from runtime.optim import OptimizerStepError

    spec = _spec("mesh[dp=2]", CONFIGS["zero_rows"][1])
    model = Pieces({n: t for n, t in initial_params(torch.float32, 21).items()})
    named = [(n, model.parts[n].weight) for n in SHAPES]
    optimizer = _optimizer("adamw", named, spec, overlap=True, bucket_bytes=BUCKET_BYTES, timeout=8.0)
    if rank == 1:  # "w" comes first in forward, so its gradient is finished last
        model.parts["w"].weight.register_hook(lambda g: os._exit(0) if optimizer.state_dict()["tensors"] else g)
    for step in range(2):
        pieces = {
            n: local_grad(grad, addends, spec[n].grad, (rank,))
            for n, (grad, addends) in step_grads(torch.float32, 21, step).items()
        }
        optimizer.zero_grad()
        model(pieces).backward()
        if step == 1:
            saved = ({n: p.detach().clone() for n, p in named}, optimizer.state_dict())
            in_flight = optimizer.buckets_started
            began = time.perf_counter()
            try:
                optimizer.step()
            except OptimizerStepError as e:
                unchanged = all(torch.equal(saved[0][n], p) for n, p in named)
                states = optimizer.state_dict()["tensors"]
                unchanged = unchanged and all(
                    torch.equal(states[n]["states"][k]["tensor"], saved[1]["tensors"][n]["states"][k]["tensor"])
                    for n in states
                    for k in states[n]["states"]
                )
                return {
                    "message": str(e),
                    "seconds": time.perf_counter() - began,
                    "unchanged": unchanged,
                    "in_flight": in_flight,
                }
            return {"message": None}
        optimizer.step()
    return {"message": None}


def _written_while_gathered(rank: int, world_size: int) -> dict[str, Any]:
    """After a step with ``prefetch_params``, ``model.load_state_dict`` writes one parameter
    before forward has waited for its gather: forward raises, the written value stays, and
    every other parameter gets the step's."""
    from runtime.optim import OptimizerError

    spec = _spec(*CONFIGS["zero_rows"][:2])
    model = Pieces(initial_params(torch.float32, 33))
    optimizer = _optimizer("adamw", [(n, model.parts[n].weight) for n in SHAPES], spec, overlap=True)
    optimizer.prefetch_params(*model.parts.values())
    pieces = {n: local_grad(g, a, spec[n].grad, (rank,)) for n, (g, a) in step_grads(torch.float32, 33, 0).items()}
    model(pieces).backward()
    optimizer.step()
    model.parts["b"].load_state_dict({"weight": torch.full(SHAPES["b"], 0.5)})
    try:
        model(pieces)
        message = None
    except OptimizerError as e:
        message = str(e)
    optimizer.wait_params()
    return {"message": message, "params": {n: model.parts[n].weight.detach().clone() for n in SHAPES}}


def all_cases(rank: int, world_size: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for config in LAYOUTS:
        for kind, dtype in KINDS:
            for mode in MODES:
                out[(config, kind, mode)] = _run(rank, config, kind, dtype, mode, seed=31)
    for config in CHANGED_LAYOUTS:
        for kind, dtype in KINDS:
            for changed in CHANGED:
                out[(config, kind, changed)] = _run(rank, config, kind, dtype, "overlap_prefetch", 31, changed)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[Any, Any]]:
    return run_ranks(all_cases, 4, timeout=300)


def _checked_runs(
    ranks: list[dict[Any, Any]], config: str, kind: str, dtype: torch.dtype, cases: Iterable[str]
) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """Each rank's run of each of ``cases`` on ``config`` (ranks of its mesh), once its
    parameters were checked against the single-process reference's pieces."""
    mesh, layouts_of, _ = CONFIGS[config]
    spec = _spec(mesh, layouts_of)
    the_mesh = next(iter(spec.values())).param.mesh
    want = _reference_run(kind, dtype, 31, STEPS, ADAMW if kind == "adamw" else CAME)
    for rank, out in enumerate(ranks):
        if rank not in the_mesh.ranks:
            continue
        for case in cases:
            got = out[(config, kind, case)]
            for name in SHAPES:
                piece = hand_piece(want[name], spec[name].param.dims, the_mesh.shape, got["coordinate"])
                _assert_close(kind, dtype, got["params"][name], piece, f"{config} {kind} {case} rank {rank} '{name}'")
            yield rank, case, got


@pytest.mark.slow
@pytest.mark.parametrize("config", LAYOUTS)
@pytest.mark.parametrize(("kind", "dtype"), KINDS)
def test_overlap_equals_the_step_without_it_and_the_reference(
    ranks: list[dict[Any, Any]], config: str, kind: str, dtype: torch.dtype
) -> None:
    for rank, mode, got in _checked_runs(ranks, config, kind, dtype, MODES):
        plain = ranks[rank][(config, kind, "plain")]
        for name in SHAPES:
            label = f"{config} {kind} {mode} rank {rank} '{name}'"
            if kind == "adamw":
                assert torch.equal(got["params"][name], plain["params"][name]), label
            else:
                _assert_close(kind, dtype, got["params"][name], plain["params"][name], label)
        if MODES[mode][0]:  # every bucket before the update started during backward
            assert all(n == total and total > 1 for n, total in got["started"][1:]), (mode, got["started"])
        else:
            assert all(n == 0 for n, _ in got["started"]), (mode, got["started"])
        assert not got["said_again"], (mode, got["said_again"])
        if MODES[mode][4] is None and config in ("zero_rows", "flat_zero"):  # every leg reduce-scatters
            assert all(kept == [] for kept in got["kept_grads"]), (mode, got["kept_grads"])
        elif MODES[mode][4] is False:
            assert all(kept == sorted(SHAPES) for kept in got["kept_grads"]), (mode, got["kept_grads"])


@pytest.mark.slow
@pytest.mark.parametrize("config", CHANGED_LAYOUTS)
@pytest.mark.parametrize(("kind", "dtype"), KINDS)
@pytest.mark.parametrize("changed", CHANGED)
def test_gradients_changed_after_their_buckets_started_are_reduced_again(
    ranks: list[dict[Any, Any]], config: str, kind: str, dtype: torch.dtype, changed: str
) -> None:
    runs = list(_checked_runs(ranks, config, kind, dtype, (changed,)))
    assert len(runs) == 4
    for _, _, got in runs:
        assert len(got["said_again"]) == 1, got["said_again"]
        assert "step 1: the gradients of" in got["said_again"][0], got["said_again"]


@pytest.mark.slow
def test_a_parameter_written_while_its_gather_is_in_flight_keeps_what_was_written() -> None:
    want = _reference_run("adamw", torch.float32, 33, 1, ADAMW)
    for rank, got in enumerate(run_ranks(_written_while_gathered, 4, timeout=120)):
        assert got["message"] is not None, f"rank {rank}: forward did not raise"
        assert got["message"].startswith("parameter 'b' written while the gather of step 1's value"), got["message"]
        assert "optimizer.wait_params()" in got["message"]
        assert torch.equal(got["params"]["b"], torch.full(SHAPES["b"], 0.5)), rank
        for name in SHAPES:
            if name != "b":
                _assert_close("adamw", torch.float32, got["params"][name], want[name], f"rank {rank} '{name}'")


@pytest.mark.slow
def test_a_peer_that_dies_during_backward_fails_the_step_and_changes_nothing() -> None:
    result = run_ranks(_peer_dies_in_backward, 2, timeout=120, collective_timeout=30, allow_missing=(1,))[0]
    assert result["message"] is not None, "the step succeeded without its peer"
    assert "parameters and optimizer states are unchanged" in result["message"]
    assert "bucket" in result["message"] and "step 2" in result["message"], result["message"]
    assert result["in_flight"] > 0, "no bucket had started during backward"
    assert result["seconds"] < 15
    assert result["unchanged"]


def _accumulated_after_freed(rank: int, world_size: int) -> tuple[tuple[str, str, float], tuple[str, str, float]]:
    """free_grads (the default): a second backward outside no_sync() accumulates into
    gradients already freed: that backward raises, and the step refuses (not reduce half of
    them), on every rank, changing nothing."""
    from runtime.testing import attempt

    spec = _spec(*CONFIGS["zero_rows"][:2])
    model = Pieces(initial_params(torch.float32, 35))
    named = [(n, model.parts[n].weight) for n in SHAPES]
    optimizer = _optimizer("adamw", named, spec, overlap=True, bucket_bytes=BUCKET_BYTES)
    pieces = {n: local_grad(g, a, spec[n].grad, (rank,)) for n, (g, a) in step_grads(torch.float32, 35, 0).items()}
    model({n: g * 0.5 for n, g in pieces.items()}).backward()
    again = attempt(lambda: model({n: g * 0.5 for n, g in pieces.items()}).backward())
    before = {n: p.detach().clone() for n, p in named}
    outcome = attempt(optimizer.step)
    unchanged = all(torch.equal(before[n], p) for n, p in named) and not optimizer.state_dict()["tensors"]
    return again, (outcome[0], outcome[1] + ("" if unchanged else " (CHANGED)"), outcome[2])


@pytest.mark.slow
def test_free_grads_refuses_a_gradient_accumulated_after_it_was_freed() -> None:
    for rank, (again, (kind, message, seconds)) in enumerate(run_ranks(_accumulated_after_freed, 4, timeout=120)):
        assert again[0] == "FreedGradError" and "optimizer.no_sync()" in again[1], (rank, again)
        assert kind == "OptimizerError", (rank, kind, message)
        assert "was accumulated again (or changed in place) after its bucket had taken and freed it" in message, message
        assert "optimizer.no_sync()" in message and "(CHANGED)" not in message, message
        assert seconds < 10, (rank, seconds)
