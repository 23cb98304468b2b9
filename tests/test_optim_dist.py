"""Sharded AdamW and CAME on 4 gloo ranks against torch.optim.AdamW and came_pytorch.CAME.

One spawn runs every configuration; the references run here, in the test process, on the
full tensors, and every rank's piece is compared with the reference sliced by hand. Gradients
are dyadic rationals (k/256), so the partial addends every rank holds sum exactly, whatever
the order: AdamW, which is elementwise, must then match bit for bit.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Callable
from typing import Any

import came_pytorch
import pytest
import torch

from runtime.testing import run_ranks

SHAPES = {"w": (37, 24), "b": (24,), "t": (4, 6, 5), "e": (301, 8), "s": (3, 7)}
STEPS = 20
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
CAME = {"lr": 1e-2, "weight_decay": 0.1, "clip_threshold": 0.3, "betas": (0.9, 0.99, 0.999)}
KINDS = (("adamw", torch.float32), ("came", torch.float32), ("came", torch.float64))
CAME_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
CLIP = 0.73  # the MLP's gradient norms run from 0.52 to 0.86 over its 10 steps, none within 1e-3 of it


def _dims(n: int, split: dict[int, str]) -> str:
    return ",".join(split.get(d, "R") for d in range(n))


def _zero_rows(n: int) -> tuple[str, str, str]:
    return _dims(n, {}), _dims(n, {}) + " | P(dp):avg", _dims(n, {0: "S(dp)"})


def _replicated(n: int) -> tuple[str, str, str]:
    return _dims(n, {}), _dims(n, {}) + " | P(dp):avg", _dims(n, {})


def _tp_col(n: int) -> tuple[str, str, str]:
    layout = _dims(n, {n - 1: "S(tp)"})
    return layout, layout, layout


def _tp_row(n: int) -> tuple[str, str, str]:
    layout = _dims(n, {max(n - 2, 0): "S(tp)"})
    return layout, layout, layout


def _dp2_tp2(n: int) -> tuple[str, str, str]:
    if n == 1:
        return "S(tp)", "S(tp) | P(dp):avg", "S(tp,dp)"
    param = _dims(n, {n - 1: "S(tp)"})
    return param, param + " | P(dp):avg", _dims(n, {n - 2: "S(dp)", n - 1: "S(tp)"})


def _nested(n: int) -> tuple[str, str, str]:
    d = max(n - 2, 0)
    param = _dims(n, {d: "S(tp)"})
    return param, param + " | P(dp):avg", _dims(n, {d: "S(tp,dp)"})


def _three_ranks(n: int) -> tuple[str, str, str]:
    return _dims(n, {}), _dims(n, {}) + " | P0:avg", _dims(n, {max(n - 2, 0): "S0"})


def _flat_tp(n: int) -> tuple[str, str, str]:
    param = _dims(n, {n - 1: "S(tp)"})
    return param, param + " | P(dp):avg", param


def _rows_over_dp(n: int) -> dict[str, str]:
    return {"exp_avg": _dims(n, {0: "S(dp)"})}


DP4, TP4, DP2_TP2, THREE = "mesh[dp=4]", "mesh[tp=4]", "mesh[dp=2,tp=2]", "mesh[3] ranks 0..2"
# Configs whose exp_avg is kept in a layout of its own (the other states in the state layout).
OWN_STATES: dict[str, Callable[[int], dict[str, str]]] = {
    "own_exp_avg": _rows_over_dp,
    "own_exp_avg_flat": _rows_over_dp,
}
# name: (mesh, layouts (param, grad, state) of an n-d tensor, flat axis)
CONFIGS: dict[str, tuple[str, Callable[[int], tuple[str, str, str]], str | None]] = {
    "zero_rows": (DP4, _zero_rows, None),
    "flat_zero": (DP4, _replicated, "dp"),
    "tp_col": (TP4, _tp_col, None),
    "tp_row": (TP4, _tp_row, None),
    "dp2_tp2": (DP2_TP2, _dp2_tp2, None),
    "nested_tp_dp": (DP2_TP2, _nested, None),
    "three_ranks": (THREE, _three_ranks, None),
    "replicated": (DP4, _replicated, None),
    "flat_zero_with_tp": (DP2_TP2, _flat_tp, "dp"),
    "own_exp_avg": (DP4, _replicated, None),
    "own_exp_avg_flat": (DP4, _replicated, "dp"),
}


# --- the data every rank and the reference share ---------------------------------------
def dyadic(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, limit: int = 512) -> torch.Tensor:
    return (torch.randint(-limit, limit + 1, shape, generator=gen) / 256).to(dtype)


def initial_params(dtype: torch.dtype, seed: int, shapes: dict[str, tuple[int, ...]] = SHAPES) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {name: dyadic(shape, dtype, gen) for name, shape in shapes.items()}


def step_grads(dtype: torch.dtype, seed: int, step: int, shapes: dict[str, tuple[int, ...]] = SHAPES) -> dict:
    """Full gradients of one step, and per tensor 4 addends that sum to zero (for partials)."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    out = {}
    for name, shape in shapes.items():
        grad = dyadic(shape, dtype, gen)
        if step % 3 == 0 and len(shape) >= 2:
            grad[..., 0, :] = 0  # an all-zero row: only eps1 keeps CAME's statistics positive
        out[name] = (grad, [dyadic(shape, dtype, gen, 64) for _ in range(4)])
    return out


def hand_piece(full: torch.Tensor, dims: tuple[tuple[int, ...], ...], mesh_shape, coordinate) -> torch.Tensor:
    """The block at ``coordinate``: per dim, cut in ceil(L/n) pieces axis after axis."""
    index = []
    for d, axes in enumerate(dims):
        lo, hi = 0, full.shape[d]
        for a in axes:
            size = -(-(hi - lo) // mesh_shape[a])
            lo, hi = min(lo + coordinate[a] * size, hi), min(lo + (coordinate[a] + 1) * size, hi)
        index.append(slice(lo, hi))
    return full[tuple(index)]


def local_grad(grad: torch.Tensor, addends: list[torch.Tensor], layout, coordinate) -> torch.Tensor:
    """This rank's piece of ``grad`` in ``layout``; over a partial ``avg`` axis of n ranks the
    ranks hold ``grad + d_i`` with dyadic ``d_i`` summing to zero, so that the sum, ``n *
    grad``, is exact and so is its division by n."""
    piece = hand_piece(grad, layout.dims, layout.mesh.shape, coordinate).clone()
    for axis, op in layout.partial:
        assert op == "avg"
        n, mine = layout.mesh.shape[axis], coordinate[axis]
        offset = addends[mine] if mine < n - 1 else -sum(addends[: n - 1], torch.zeros_like(grad))
        piece += hand_piece(offset, layout.dims, layout.mesh.shape, coordinate)
    return piece


def reference(kind: str, params: dict[str, torch.Tensor], hyper: dict) -> tuple[dict, torch.optim.Optimizer]:
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in params.items()}
    if kind == "adamw":
        return ref, torch.optim.AdamW(list(ref.values()), foreach=False, **hyper)
    return ref, came_pytorch.CAME(list(ref.values()), **hyper)


# --- what the ranks run ----------------------------------------------------------------
def _spec(
    mesh: str,
    layouts_of: Callable[[int], tuple[str, str, str]],
    shapes=SHAPES,
    own: Callable[[int], dict[str, str]] | None = None,
):
    from shardlang import parse_layout
    from shardlang.spec import Layouts, TensorSpec

    spec = {}
    for name, shape in shapes.items():
        param, grad, state = (parse_layout(f"{text} over {mesh}") for text in layouts_of(len(shape)))
        extra = {} if own is None else own(len(shape))
        states = (("", state), *((k, parse_layout(f"{text} over {mesh}")) for k, text in sorted(extra.items())))
        layouts = Layouts(param=param, grad=grad, states=states)
        spec[name] = TensorSpec(name=name, dtype="f32", shape=shape, layouts=layouts)
    return spec


def _optimizer(kind: str, named: list, spec: Any, **options: Any):
    from runtime.optim import ShardedAdamW, ShardedCAME

    if kind == "adamw":
        return ShardedAdamW(named, spec, **ADAMW, **options)
    return ShardedCAME(named, spec, **CAME, **options)


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


def run_dtensor(rank: int, build: Callable[[list, dict], Any], seed: int, steps: int = 10) -> dict[str, Any]:
    """Parameters and gradients as DTensors on a [dp=2, tp=2] DeviceMesh, ``steps`` steps of the
    optimizer ``build(named_params, layouts)`` makes; the spec gives only the state layouts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from shardlang.interop import to_dtensor_placements

    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    spec = _spec(DP2_TP2, _dp2_tp2)
    coordinate = (rank // 2, rank % 2)

    def dtensor(full: torch.Tensor, local: torch.Tensor, layout: Any) -> DTensor:
        placements = to_dtensor_placements(layout)
        return DTensor.from_local(local, device_mesh, placements, shape=full.shape, stride=full.stride())

    params = {}
    for name, full in initial_params(torch.float32, seed).items():
        layout = spec[name].param
        local = hand_piece(full, layout.dims, layout.mesh.shape, coordinate).clone()
        params[name] = torch.nn.Parameter(dtensor(full, local, layout))
    optimizer = build(list(params.items()), {n: s.layouts for n, s in spec.items()})
    for step in range(steps):
        for name, (grad, addends) in step_grads(torch.float32, seed, step).items():
            params[name].grad = dtensor(grad, local_grad(grad, addends, spec[name].grad, coordinate), spec[name].grad)
        optimizer.step()
    return {"coordinate": coordinate, "params": {n: p.to_local().detach().clone() for n, p in params.items()}}


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


def failed_step(optimizer: Any, params: Any, spec: dict, rank: int, seed: int) -> tuple[str | None, bool]:
    """A step of ``seed``'s first gradients (ZeRO-2 over [dp=4]) meant to fail: what it raised
    on this rank (``None``: nothing), and whether parameters and states are as before it."""
    from runtime.optim import OptimizerStepError

    for name, (grad, addends) in step_grads(torch.float32, seed, 0).items():
        params[name].grad = local_grad(grad, addends, spec[name].grad, (rank,))
    before = {n: p.detach().clone() for n, p in params.items()}
    try:
        optimizer.step()
        message = None
    except OptimizerStepError as e:
        message = str(e)
    optimizer.wait_params()
    unchanged = all(torch.equal(before[n], params[n]) for n in SHAPES) and not optimizer.state_dict()["tensors"]
    return message, unchanged


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


MLP_SPEC = """
mesh world = [dp=4]
rule "*.weight" { param = R,R over world  grad = R,R | P(dp):avg over world  state = S(dp),R over world }
rule "*.bias"   { param = R over world    grad = R | P(dp):avg over world    state = S(dp) over world }
"""


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))


def mlp_batches(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 100 + step)
    return torch.randn(12, 7, generator=gen), torch.randn(12, 5, generator=gen)


def _run_training(
    rank: int,
    kind: str,
    flat_axis: str | None,
    seed: int,
    max_grad_norm: float | None = None,
    clip_method: bool = False,
    overlap: bool = False,
    free_grads: bool = False,
) -> dict[str, Any]:
    """10 steps of an MLP; every rank trains on its 3 of the 12 samples; the global gradient
    norm of every step when clipping (``max_grad_norm``, or ``optimizer.clip_grad_norm_`` before
    each step with ``clip_method``). ``overlap``: buckets of 256 bytes started during backward,
    ``prefetch_params`` of both layers, and every bucket's result landing late
    (``tests.late_results``). ``free_grads``: gradients freed once their buckets took them (the
    run records whether any was left after backward and after the step)."""
    from shardlang import parse_spec
    from tests.late_results import LateResults

    model = mlp(seed)
    options: dict[str, Any] = {"flat_axis": flat_axis, "max_grad_norm": None if clip_method else max_grad_norm}
    options["free_grads"] = free_grads
    if overlap:
        options |= {"overlap": True, "bucket_bytes": 256}
    optimizer = _optimizer(kind, list(model.named_parameters()), parse_spec(MLP_SPEC), **options)
    if overlap:
        optimizer.prefetch_params(model[0], model[2])
    norms, started, left = [], [], []
    results = LateResults()
    with results.installed(), results.delayed() if overlap else contextlib.nullcontext():
        for step in range(10):
            x, y = mlp_batches(seed, step)
            mine = slice(3 * rank, 3 * rank + 3)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            started.append(optimizer.buckets_started)
            returned = optimizer.clip_grad_norm_(max_grad_norm) if clip_method else None
            optimizer.step()
            left.append(sum(p.grad is not None for p in model.parameters()))
            norms.append(None if optimizer.last_grad_norm is None else float(optimizer.last_grad_norm))
            if returned is not None:
                assert float(returned) == norms[-1], (float(returned), norms[-1])
        optimizer.wait_params()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "norms": norms, "started": started, "left": left}


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
    """Every case on this rank."""
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
    out["failed_step"] = _run_failed_step(rank, seed=11)
    out["reduce_dtype"] = _run_reduce_dtype(rank, seed=18)
    out["mismatched_buckets"] = _run_mismatched_buckets(rank, seed=13)
    for kind, flat_axis in (("adamw", None), ("came", None), ("came", "dp")):
        out[("training", kind, flat_axis)] = _run_training(rank, kind, flat_axis, seed=12)
    for kind, flat_axis in (("adamw", None), ("adamw", "dp"), ("came", None)):
        out[("clipped", kind, flat_axis)] = _run_training(rank, kind, flat_axis, seed=14, max_grad_norm=CLIP)
        out[("clip_method", kind, flat_axis)] = _run_training(
            rank, kind, flat_axis, seed=14, max_grad_norm=CLIP, clip_method=True
        )
        out[("clip_method_overlap", kind, flat_axis)] = _run_training(
            rank, kind, flat_axis, seed=14, max_grad_norm=CLIP, clip_method=True, overlap=True
        )
        out[("clip_method_free", kind, flat_axis)] = _run_training(
            rank, kind, flat_axis, seed=14, max_grad_norm=CLIP, clip_method=True, free_grads=True
        )
    out["nonfinite"] = _run_nonfinite(rank, seed=15)
    out["smaller_mesh"] = _run_smaller_mesh(rank)
    out["late_failure"] = _run_fails_after_its_last_collective(rank, seed=17)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(all_cases, 4, timeout=300)


# --- the checks ------------------------------------------------------------------------
def _reference_run(kind: str, dtype: torch.dtype, seed: int, steps: int, hyper: dict) -> dict[str, torch.Tensor]:
    ref, optimizer = reference(kind, initial_params(dtype, seed), hyper)
    for step in range(steps):
        for name, (grad, _) in step_grads(dtype, seed, step).items():
            ref[name].grad = grad.clone()
        optimizer.step()
    return {n: p.detach() for n, p in ref.items()}


def _assert_close(kind: str, dtype: torch.dtype, got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    assert got.shape == want.shape, f"{label}: shape {list(got.shape)} != {list(want.shape)}"
    if kind == "adamw":
        assert torch.equal(got, want), f"{label}: differs from torch.optim.AdamW by {(got - want).abs().max()}"
        return
    if want.numel() == 0:
        return
    error = ((got - want).abs().max() / want.abs().max()).item()
    assert error <= CAME_TOLERANCE[dtype], f"{label}: relative error {error:.3g} against came_pytorch"


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
@pytest.mark.parametrize(("kind", "flat_axis"), [("adamw", None), ("came", None), ("came", "dp")])
def test_data_parallel_training_equals_single_process_training(
    ranks: list[dict[str, Any]], kind: str, flat_axis: str | None
) -> None:
    model = mlp(12)
    named = list(model.named_parameters())
    if kind == "adamw":
        optimizer = torch.optim.AdamW([p for _, p in named], foreach=False, **ADAMW)
    else:
        optimizer = came_pytorch.CAME([p for _, p in named], **CAME)
    for step in range(10):
        x, y = mlp_batches(12, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    for rank, result in enumerate(ranks):
        got = result[("training", kind, flat_axis)]["params"]
        for name, p in named:
            torch.testing.assert_close(got[name], p.detach(), rtol=2e-5, atol=2e-6, msg=f"rank {rank} '{name}'")


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "flat_axis"), [("adamw", None), ("adamw", "dp"), ("came", None)])
def test_clipping_equals_torch_clip_grad_norm_in_single_process_training(
    ranks: list[dict[str, Any]], kind: str, flat_axis: str | None
) -> None:
    """``max_grad_norm`` (and ``optimizer.clip_grad_norm_`` before each step, which returns the
    norm) on the reduced gradients against ``torch.nn.utils.clip_grad_norm_`` on the whole batch:
    the same norm every step, clipping at the same steps (some, not all), the same parameters;
    also with overlap and ``prefetch_params``, and with ``free_grads``."""
    model = mlp(14)
    params = [p for _, p in model.named_parameters()]
    hyper = ADAMW if kind == "adamw" else CAME
    optimizer = (
        torch.optim.AdamW(params, foreach=False, **hyper) if kind == "adamw" else came_pytorch.CAME(params, **hyper)
    )
    norms = []
    for step in range(10):
        x, y = mlp_batches(14, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        optimizer.step()
    clipped = [n > CLIP for n in norms]
    assert any(clipped) and not all(clipped), norms
    for rank, result in enumerate(ranks):
        for how in ("clipped", "clip_method", "clip_method_overlap", "clip_method_free"):
            got = result[(how, kind, flat_axis)]
            # free_grads (without overlap: in clip_grad_norm_): no gradient left after the step.
            assert all(n == (0 if how.endswith("free") else len(params)) for n in got["left"]), (how, got["left"])
            assert [n > CLIP for n in got["norms"]] == clipped, (rank, how, got["norms"], norms)
            if how == "clip_method_overlap":  # every step's buckets started during backward
                assert all(n > 1 for n in got["started"]), (rank, got["started"])
            for mine, want in zip(got["norms"], norms, strict=True):
                assert mine == pytest.approx(want, rel=1e-5)
            for name, p in model.named_parameters():
                torch.testing.assert_close(
                    got["params"][name], p.detach(), rtol=2e-5, atol=2e-6, msg=f"rank {rank} '{name}'"
                )


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
