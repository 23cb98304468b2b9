"""Sharded AdamW and CAME on 4 gloo ranks against torch.optim.AdamW and came_pytorch.CAME.

One spawn runs every configuration; the references run here, in the test process, on the
full tensors, and every rank's piece is compared with the reference sliced by hand. Gradients
are dyadic rationals (k/256), so the partial addends every rank holds sum exactly, whatever
the order: AdamW, which is elementwise, must then match bit for bit. The shared cases are in
tests/optim_support.py; failed steps are in test_optim_failures_dist.py, training an MLP (and
clipping) in test_optim_training_dist.py.
"""

from __future__ import annotations

import io
import time
from typing import Any

import pytest
import torch

from runtime.testing import run_ranks
from tests.optim_support import (
    ADAMW,
    CAME,
    CONFIGS,
    DP2_TP2,
    DP4,
    KINDS,
    OWN_STATES,
    SHAPES,
    STEPS,
    _assert_close,
    _dims,
    _dp2_tp2,
    _optimizer,
    _reference_run,
    _spec,
    _zero_rows,
    hand_piece,
    initial_params,
    local_grad,
    reference,
    run_dtensor,
    step_grads,
)


def _run_config(rank: int, config: str, kind: str, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    import runtime

    mesh, layouts_of, flat_axis = CONFIGS[config]
    spec = _spec(mesh, layouts_of, own=OWN_STATES.get(config))
    the_mesh = next(iter(spec.values())).param.mesh
    if rank not in the_mesh.ranks:  # idle rank: holds the tensors, takes part in nothing
        params = {n: torch.nn.Parameter(t) for n, t in initial_params(dtype, seed).items()}
        optimizer = _optimizer(kind, list(params.items()), spec, flat_axis=flat_axis, idle_ranks=True)
        optimizer.step()
        return {"idle": True, "state_bytes": optimizer.state_bytes()}
    coordinate = the_mesh.coordinate(rank)
    params = {
        n: torch.nn.Parameter(hand_piece(t, spec[n].param.dims, the_mesh.shape, coordinate).clone())
        for n, t in initial_params(dtype, seed).items()
    }
    optimizer = _optimizer(kind, list(params.items()), spec, flat_axis=flat_axis)
    traffic = []
    for step in range(STEPS):
        if step == STEPS // 2:  # new memory for every parameter, matrices column-major: the steps
            for p in params.values():  # after must write there, in its order
                p.data = p.data.t().contiguous().t() if p.dim() == 2 else p.data.clone()
        for name, (grad, addends) in step_grads(dtype, seed, step).items():
            params[name].grad = local_grad(grad, addends, spec[name].grad, coordinate)
        planned = optimizer.planned_traffic()
        with runtime.recording() as log:
            optimizer.step()
        traffic.append(
            (
                planned.bytes,
                log.planned_bytes,
                log.total_bytes,
                optimizer.last_traffic.sum_collectives,
                planned.collectives,
                len(log.records),
            )
        )
    return {
        "idle": False,
        "coordinate": coordinate,
        "params": {n: p.detach().clone() for n, p in params.items()},
        "traffic": traffic,
        "state_bytes": optimizer.state_bytes(),
        "bytes_by_state": _bytes_by_state(optimizer.state_dict()),
    }


def _bytes_by_state(state_dict: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for entry in state_dict["tensors"].values():
        for name, record in entry["states"].items():
            out[name] = out.get(name, 0) + record["tensor"].numel() * record["tensor"].element_size()
    return out


def _run_dtensor(rank: int, kind: str, seed: int) -> dict[str, Any]:
    return run_dtensor(rank, lambda named, layouts: _optimizer(kind, named, layouts), seed)


def _run_mixed_precision(rank: int, kind: str, seed: int) -> dict[str, Any]:
    """bf16 parameters and gradients (replicated), ZeRO states and fp32 master shards."""
    spec = _spec(DP4, lambda n: (_dims(n, {}), _dims(n, {}), _dims(n, {0: "S(dp)"})))
    params = {n: torch.nn.Parameter(t.to(torch.bfloat16)) for n, t in initial_params(torch.float32, seed).items()}
    optimizer = _optimizer(kind, list(params.items()), spec)
    for step in range(STEPS):
        for name, (grad, _) in step_grads(torch.float32, seed, step).items():
            params[name].grad = grad.to(torch.bfloat16)
        optimizer.step()
    masters = {n: entry["states"]["master"]["tensor"] for n, entry in optimizer.state_dict()["tensors"].items()}
    return {"params": {n: p.detach().clone() for n, p in params.items()}, "masters": masters}


REDUCE_STEPS = 5


def _bf16_pieces(seed: int, step: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s bf16 gradients, pending a mean over dp=4: ``grad + d_rank`` rounded to bf16."""
    spec = _spec(DP4, _zero_rows)
    return {
        n: local_grad(grad, addends, spec[n].grad, (rank,)).to(torch.bfloat16)
        for n, (grad, addends) in step_grads(torch.float32, seed, step).items()
    }


def _run_reduce_dtype(rank: int, seed: int) -> dict[str, Any]:
    """bf16 parameters whose bf16 gradients pend a mean over dp, reduced in fp32 and in bf16."""
    spec = _spec(DP4, _zero_rows)
    out = {}
    for reduce_dtype in (torch.float32, None):
        params = {n: torch.nn.Parameter(t.to(torch.bfloat16)) for n, t in initial_params(torch.float32, seed).items()}
        optimizer = _optimizer("adamw", list(params.items()), spec, reduce_dtype=reduce_dtype)
        for step in range(REDUCE_STEPS):
            for name, piece in _bf16_pieces(seed, step, rank).items():
                params[name].grad = piece
            optimizer.step()
        out[str(reduce_dtype)] = {
            n: e["states"]["master"]["tensor"] for n, e in optimizer.state_dict()["tensors"].items()
        }
    return out


def _run_resume(rank: int, kind: str, seed: int) -> dict[str, Any]:
    """20 steps straight, against 10 steps, a state dict through torch.save, a new optimizer on
    copies of the parameters, and 10 more steps."""
    spec = _spec(DP4, _zero_rows)
    coordinate = (rank,)

    def set_grads(params: dict, step: int) -> None:
        for name, (grad, addends) in step_grads(torch.float32, seed, step).items():
            params[name].grad = local_grad(grad, addends, spec[name].grad, coordinate)

    straight = {n: torch.nn.Parameter(t) for n, t in initial_params(torch.float32, seed).items()}
    resumed = {n: torch.nn.Parameter(t) for n, t in initial_params(torch.float32, seed).items()}
    first = _optimizer(kind, list(straight.items()), spec)
    before = _optimizer(kind, list(resumed.items()), spec)
    for step in range(STEPS):
        set_grads(straight, step)
        first.step()
        if step < STEPS // 2:
            set_grads(resumed, step)
            before.step()
    buffer = io.BytesIO()
    torch.save(before.state_dict(), buffer)
    buffer.seek(0)
    copies = {n: torch.nn.Parameter(p.detach().clone()) for n, p in resumed.items()}
    after = _optimizer(kind, list(copies.items()), spec)
    after.load_state_dict(torch.load(buffer, weights_only=False))
    for step in range(STEPS // 2, STEPS):
        set_grads(copies, step)
        after.step()
    return {"equal": {n: torch.equal(straight[n], copies[n]) for n in SHAPES}}


def all_cases(rank: int, world_size: int) -> dict[str, Any]:
    """Every case of this module on this rank."""
    out: dict[str, Any] = {"timing": {}}
    for config in CONFIGS:
        for kind, dtype in KINDS:
            started = time.perf_counter()
            out[(config, kind, str(dtype))] = _run_config(rank, config, kind, dtype, seed=7)
            out["timing"][(config, kind, str(dtype))] = time.perf_counter() - started
    for kind in ("adamw", "came"):
        out[("dtensor", kind)] = _run_dtensor(rank, kind, seed=8)
        out[("mixed", kind)] = _run_mixed_precision(rank, kind, seed=9)
        out[("resume", kind)] = _run_resume(rank, kind, seed=10)
    out["reduce_dtype"] = _run_reduce_dtype(rank, seed=18)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(all_cases, 4, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_sharded_optimizers_match_references_after_20_steps(ranks: list[dict[str, Any]], config: str) -> None:
    mesh, layouts_of, _ = CONFIGS[config]
    spec = _spec(mesh, layouts_of)
    for kind, dtype in KINDS:
        want = _reference_run(kind, dtype, 7, STEPS, ADAMW if kind == "adamw" else CAME)
        for rank, result in enumerate(ranks):
            case = result[(config, kind, str(dtype))]
            if case["idle"]:
                assert rank not in next(iter(spec.values())).param.mesh.ranks
                assert case["state_bytes"] == 0
                continue
            for name, got in case["params"].items():
                layout = spec[name].param
                expected = hand_piece(want[name], layout.dims, layout.mesh.shape, case["coordinate"])
                _assert_close(kind, dtype, got, expected, f"{config} {kind} {dtype} rank {rank} '{name}'")


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_bytes_sent_agree_with_the_plans(ranks: list[dict[str, Any]], config: str) -> None:
    for kind, dtype in KINDS:
        for result in ranks:
            case = result[(config, kind, str(dtype))]
            for predicted, planned, sent, _, collectives, records in case.get("traffic", []):
                assert collectives == records, f"{config} {kind}: {records} collectives ran, {collectives} planned"
                # The plans' bytes are those of the busiest rank (coordinate 0): others pad less.
                assert predicted == planned, f"{config} {kind}: predicted {predicted}, the runtime planned {planned}"
                assert sent <= planned
                if not any(case["coordinate"]):
                    assert sent == planned, f"{config} {kind}: rank at coordinate 0 sent {sent}, planned {planned}"


@pytest.mark.slow
def test_every_kind_of_collective_runs_once_per_step(ranks: list[dict[str, Any]]) -> None:
    """The five tensors of a config share one collective per kind of move: ZeRO is one
    reduce_scatter in and one all_gather out, DDP one all_reduce; a layout that splits rows
    over dp for the 2-d tensors and columns over tp for the 1-d one still moves only over dp;
    an own-layout exp_avg split by rows adds its all_gather into the replicated state (its way
    back is a slice)."""
    expected = {
        "zero_rows": 2,
        "flat_zero": 2,
        "tp_col": 0,
        "tp_row": 0,
        "dp2_tp2": 2,
        "nested_tp_dp": 2,
        "three_ranks": 2,
        "replicated": 1,
        "flat_zero_with_tp": 2,
        "own_exp_avg": 2,
        "own_exp_avg_flat": 3,
    }
    assert set(expected) == set(CONFIGS)
    for config, count in expected.items():
        case = ranks[0][(config, "adamw", str(torch.float32))]
        # ... plus the all-reduces of the commit flags, which every config's step takes: AdamW
        # updates in place, so two (before the math, and after it and the gathers).
        assert {records for *_, records in case["traffic"]} == {count + 2}, (config, case["traffic"])


@pytest.mark.slow
def test_came_reductions_are_batched_per_phase(ranks: list[dict[str, Any]]) -> None:
    """All tensors' sums of a phase share an all-reduce per process group: for layouts over one
    mesh axis 3 per step (one per phase); rows over dp and columns over tp need 7: row sums,
    column sums and matrix totals (which carry the row normaliser) twice, and the RMS."""
    counts = {config: ranks[0][(config, "came", str(torch.float32))]["traffic"][-1][3] for config in CONFIGS}
    assert counts["zero_rows"] == counts["flat_zero"] == counts["tp_col"] == counts["tp_row"] == 3
    assert counts["nested_tp_dp"] == counts["three_ranks"] == 3
    assert counts["dp2_tp2"] == 7
    assert counts["replicated"] == 0


@pytest.mark.slow
def test_each_rank_holds_its_shard_of_every_state(ranks: list[dict[str, Any]]) -> None:
    """Per-rank state bytes against the states the single-device optimizers hold: the
    elementwise states are split without overlap or padding (the ranks together hold one
    copy), CAME's row and column statistics are at most whole on any rank."""
    for kind in ("adamw", "came"):
        _, optimizer = reference(kind, initial_params(torch.float32, 7), ADAMW if kind == "adamw" else CAME)
        for p in optimizer.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        optimizer.step()
        unsharded: dict[str, int] = {}
        for state in optimizer.state.values():
            for key, t in state.items():
                if key not in ("step", "RMS"):
                    unsharded[key] = unsharded.get(key, 0) + t.numel() * t.element_size()
        for config in ("zero_rows", "flat_zero"):
            cases = [r[(config, kind, str(torch.float32))] for r in ranks]
            for case in cases:
                assert case["state_bytes"] == sum(case["bytes_by_state"].values())
            for key, total in unsharded.items():
                held = [case["bytes_by_state"][key] for case in cases]
                if key in ("exp_avg", "exp_avg_sq"):
                    assert sum(held) == total, f"{config} {kind} {key}: ranks hold {held}, one copy is {total}"
                else:
                    assert max(held) <= total, f"{config} {kind} {key}: ranks hold {held} of {total}"
            assert max(c["state_bytes"] for c in cases) < sum(unsharded.values()) / 2


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adamw", "came"])
def test_dtensor_parameters(ranks: list[dict[str, Any]], kind: str) -> None:
    want = _reference_run(kind, torch.float32, 8, 10, ADAMW if kind == "adamw" else CAME)
    spec = _spec(DP2_TP2, _dp2_tp2)
    for rank, result in enumerate(ranks):
        case = result[("dtensor", kind)]
        for name, got in case["params"].items():
            layout = spec[name].param
            expected = hand_piece(want[name], layout.dims, layout.mesh.shape, case["coordinate"])
            _assert_close(kind, torch.float32, got, expected, f"dtensor {kind} rank {rank} '{name}'")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adamw", "came"])
def test_bf16_parameters_with_fp32_master_shards(ranks: list[dict[str, Any]], kind: str) -> None:
    """The reference steps fp32 copies of the bf16 parameters with the bf16 gradients in fp32."""
    start = {n: t.to(torch.bfloat16).float() for n, t in initial_params(torch.float32, 9).items()}
    ref, optimizer = reference(kind, start, ADAMW if kind == "adamw" else CAME)
    for step in range(STEPS):
        for name, (grad, _) in step_grads(torch.float32, 9, step).items():
            ref[name].grad = grad.to(torch.bfloat16).float()
        optimizer.step()
    for rank, result in enumerate(ranks):
        case = result[("mixed", kind)]
        for name, master in case["masters"].items():
            expected = hand_piece(ref[name].detach(), ((0,),) + ((),) * (master.dim() - 1), (4,), (rank,))
            _assert_close(kind, torch.float32, master, expected, f"bf16 master {kind} rank {rank} '{name}'")
            param = case["params"][name]
            assert param.dtype == torch.bfloat16
            rounded = ref[name].detach().to(torch.bfloat16)
            if kind == "adamw":
                assert torch.equal(param, rounded)
            else:  # within one bf16 rounding step of the rounded reference
                assert ((param.float() - rounded.float()).abs() <= rounded.float().abs() * 2**-7).all()


@pytest.mark.slow
def test_bf16_gradients_reduced_in_fp32_equal_an_fp32_reduction(ranks: list[dict[str, Any]]) -> None:
    """The reference: fp32 AdamW on the fp32 copies of the bf16 parameters, its gradient the mean
    of the four ranks' bf16 pieces computed in fp64 (exact: bf16 addends sum exactly in fp32)."""
    start = {n: t.to(torch.bfloat16).float() for n, t in initial_params(torch.float32, 18).items()}
    ref, optimizer = reference("adamw", start, ADAMW)
    for step in range(REDUCE_STEPS):
        pieces = [_bf16_pieces(18, step, r) for r in range(4)]
        for name in SHAPES:
            ref[name].grad = (sum(p[name].double() for p in pieces) / 4).float()
        optimizer.step()
    in_bf16_differs = False
    for rank, result in enumerate(ranks):
        for name, master in result["reduce_dtype"][str(torch.float32)].items():
            expected = hand_piece(ref[name].detach(), ((0,),) + ((),) * (master.dim() - 1), (4,), (rank,))
            _assert_close("adamw", torch.float32, master, expected, f"reduce_dtype=float32 rank {rank} '{name}'")
            in_bf16_differs |= not torch.equal(result["reduce_dtype"]["None"][name], expected)
    assert in_bf16_differs, "reducing in bf16 gave the fp32 result: the case cannot tell the two apart"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adamw", "came"])
def test_state_dict_resumes_exactly(ranks: list[dict[str, Any]], kind: str) -> None:
    for result in ranks:
        assert all(result[("resume", kind)]["equal"].values()), result[("resume", kind)]
