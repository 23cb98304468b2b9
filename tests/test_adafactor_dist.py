"""ShardedAdafactor on 4 gloo ranks against torch.optim.Adafactor on the full tensors.

One spawn runs every case; the reference runs here, in the test process, and every rank's
piece is compared with the reference sliced by hand. The layouts, data and helpers are the
CAME tests' (``tests.optim_support``): uneven rows, nested axes, flat chunks, a 3-rank mesh.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.testing import run_ranks
from tests.failed_step import check_failed_step, run_failed_step
from tests.optim_support import (
    CONFIGS,
    OWN_STATES,
    STEPS,
    _spec,
    check_pieces,
    initial_params,
    local_params,
    run_dtensor,
    set_local_grads,
    train_reference,
)

HYPER = {"lr": 1e-2, "weight_decay": 0.1, "d": 1.0}
# eps2 large enough to matter: alpha is max(eps2, RMS(p)) * rho and RMS(p) starts near 1.15.
HYPER_EPS = {"lr": 5e-2, "eps": (1e-4, 2.0), "d": 1.5, "beta2_decay": -0.6}
LAYOUT_CONFIGS = [c for c in CONFIGS if c not in OWN_STATES]
DTYPES = (torch.float32, torch.float64)
DTENSOR_STEPS = 10
SEED = 21
AGAINST = "torch.optim.Adafactor"


def _optimizer(named: list, spec: Any, hyper: dict = HYPER, **options: Any) -> Any:
    from runtime.optim import ShardedAdafactor

    return ShardedAdafactor(named, spec, **hyper, **options)


def _train(optimizer: Any, params: dict, spec: dict, coordinate: tuple[int, ...], dtype: torch.dtype, steps) -> None:
    for step in steps:
        set_local_grads(params, spec, coordinate, dtype, SEED, step)
        optimizer.step()


def _run_config(rank: int, config: str, dtype: torch.dtype, hyper: dict) -> dict[str, Any]:
    mesh, layouts_of, flat_axis = CONFIGS[config]
    spec = _spec(mesh, layouts_of)
    the_mesh = next(iter(spec.values())).param.mesh
    if rank not in the_mesh.ranks:
        params = {n: torch.nn.Parameter(t) for n, t in initial_params(dtype, SEED).items()}
        _optimizer(list(params.items()), spec, hyper, flat_axis=flat_axis, idle_ranks=True).step()
        return {"idle": True}
    coordinate = the_mesh.coordinate(rank)
    params = local_params(spec, coordinate, dtype, SEED)
    optimizer = _optimizer(list(params.items()), spec, hyper, flat_axis=flat_axis)
    phases = []
    for step in range(STEPS):
        set_local_grads(params, spec, coordinate, dtype, SEED, step)
        planned = optimizer.planned_traffic()
        optimizer.step()
        phases.append((planned.sum_collectives, optimizer.last_traffic.sum_collectives))
    return {
        "idle": False,
        "coordinate": coordinate,
        "params": {n: p.detach().clone() for n, p in params.items()},
        "sum_collectives": phases,
    }


def _run_resume(rank: int, directory: Path) -> dict[str, Any]:
    """10 steps on rows over dp, a state dict through torch.save and a checkpoint; then 10
    more from the state dict (same layouts) and from the checkpoint (columns over tp)."""
    from runtime import checkpoint

    rows, cols = _spec(*CONFIGS["zero_rows"][:2]), _spec(*CONFIGS["tp_col"][:2])
    coordinate = (rank,)
    dtype = torch.float32
    params = local_params(rows, coordinate, dtype, SEED)
    first = _optimizer(list(params.items()), rows)
    _train(first, params, rows, coordinate, dtype, range(STEPS // 2))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    checkpoint.save(directory, optimizer=first)
    buffer.seek(0)
    copies = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
    resumed = _optimizer(list(copies.items()), rows)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    _train(resumed, copies, rows, coordinate, dtype, range(STEPS // 2, STEPS))
    zeros = {n: torch.zeros_like(t) for n, t in initial_params(dtype, SEED).items()}
    moved = local_params(cols, coordinate, dtype, SEED, zeros)
    other = _optimizer(list(moved.items()), cols)
    checkpoint.load(directory, optimizer=other)
    _train(other, moved, cols, coordinate, dtype, range(STEPS // 2, STEPS))
    return {
        "state_dict": {n: p.detach().clone() for n, p in copies.items()},
        "checkpoint": {n: p.detach().clone() for n, p in moved.items()},
        "states": sorted(first.state_dict()["tensors"]["w"]["states"]),
    }


def all_cases(rank: int, world_size: int, directory: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for config in LAYOUT_CONFIGS:
        for dtype in DTYPES:
            out[(config, str(dtype))] = _run_config(rank, config, dtype, HYPER)
    out["eps"] = _run_config(rank, "nested_tp_dp", torch.float64, HYPER_EPS)
    out["resume"] = _run_resume(rank, directory)
    out["failed"] = run_failed_step(rank, _optimizer, SEED, "t", (2, 6, 5))
    out["dtensor"] = run_dtensor(rank, _optimizer, SEED, DTENSOR_STEPS)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(all_cases, 4, args=(tmp_path_factory.mktemp("adafactor") / "ckpt",), timeout=240)


def _reference(dtype: torch.dtype, steps: int, hyper: dict = HYPER) -> dict[str, torch.Tensor]:
    def adafactor(ref: dict) -> list:
        return [torch.optim.Adafactor(list(ref.values()), foreach=False, **hyper)]

    return train_reference(adafactor, dtype, SEED, steps)


@pytest.mark.parametrize("config", LAYOUT_CONFIGS)
def test_adafactor_matches_torch_after_20_steps(ranks: list[dict[str, Any]], config: str) -> None:
    spec = _spec(*CONFIGS[config][:2])
    for dtype in DTYPES:
        want = _reference(dtype, STEPS)
        for rank, result in enumerate(ranks):
            case = result[(config, str(dtype))]
            if case["idle"]:
                assert rank not in next(iter(spec.values())).param.mesh.ranks
                continue
            check_pieces(case, spec, want, dtype, f"{config} {dtype} rank {rank}", AGAINST)
            for planned, ran in case["sum_collectives"]:
                assert planned == ran, f"{config}: {ran} statistics all-reduces ran, {planned} planned"


def test_eps_clipping_and_decay_hyperparameters(ranks: list[dict[str, Any]]) -> None:
    want = _reference(torch.float64, STEPS, HYPER_EPS)
    spec = _spec(*CONFIGS["nested_tp_dp"][:2])
    for rank, result in enumerate(ranks):
        check_pieces(result["eps"], spec, want, torch.float64, f"eps rank {rank}", AGAINST)


def test_statistics_are_batched_per_phase(ranks: list[dict[str, Any]]) -> None:
    """Two phases: at most one all-reduce per (group, phase). Rows over dp split the rows of
    every matrix: phase 1 needs the dp group (column sums, totals, norms), phase 2 the norm."""
    assert {ran for _, ran in ranks[0][("zero_rows", str(torch.float32))]["sum_collectives"]} == {2}
    # tp over columns and dp over rows: row sums (tp), column sums (dp), totals (both), norms.
    assert {ran for _, ran in ranks[0][("dp2_tp2", str(torch.float32))]["sum_collectives"]} == {4}
    # replicated: nothing to complete
    assert {ran for _, ran in ranks[0][("replicated", str(torch.float32))]["sum_collectives"]} == {0}


def test_state_dict_and_checkpoint_resume(ranks: list[dict[str, Any]]) -> None:
    want = _reference(torch.float32, STEPS)
    rows, cols = _spec(*CONFIGS["zero_rows"][:2]), _spec(*CONFIGS["tp_col"][:2])
    for rank, result in enumerate(ranks):
        case = result["resume"]
        assert case["states"] == ["col_var", "row_var"]
        for resumed, spec in (("state_dict", rows), ("checkpoint", cols)):
            pieces = {"params": case[resumed], "coordinate": (rank,)}
            check_pieces(pieces, spec, want, torch.float32, f"{resumed} rank {rank}", AGAINST)


def test_a_failed_step_changes_nothing(ranks: list[dict[str, Any]]) -> None:
    check_failed_step(ranks, "failed", _reference(torch.float32, 8), "t", AGAINST)


def test_dtensor_parameters(ranks: list[dict[str, Any]]) -> None:
    want = _reference(torch.float32, DTENSOR_STEPS)
    spec = _spec(*CONFIGS["dp2_tp2"][:2])
    for rank, result in enumerate(ranks):
        check_pieces(result["dtensor"], spec, want, torch.float32, f"DTensor rank {rank}", AGAINST)
