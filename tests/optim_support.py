"""The cases the sharded optimizers' multi-rank tests share: tensors and their layouts
(``CONFIGS``), dyadic parameters and gradients, each rank's piece cut by hand, the
single-process references (torch.optim.AdamW, came_pytorch.CAME) and the comparison with them,
an MLP and its batches, and a step meant to fail.

Gradients are dyadic rationals (k/256), so the partial addends every rank holds sum exactly,
whatever the order: AdamW, which is elementwise, must then match bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import came_pytorch
import torch

SHAPES = {"w": (37, 24), "b": (24,), "t": (4, 6, 5), "e": (301, 8), "s": (3, 7)}
STEPS = 20
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
CAME = {"lr": 1e-2, "weight_decay": 0.1, "clip_threshold": 0.3, "betas": (0.9, 0.99, 0.999)}
KINDS = (("adamw", torch.float32), ("came", torch.float32), ("came", torch.float64))
CAME_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


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


def local_params(
    spec: dict, coordinate: tuple[int, ...], dtype: torch.dtype, seed: int, values: dict | None = None
) -> dict[str, torch.nn.Parameter]:
    """This rank's pieces, cut by hand, of ``values`` (else of ``seed``'s initial parameters)."""
    mesh = next(iter(spec.values())).param.mesh
    full = initial_params(dtype, seed) if values is None else values
    return {
        n: torch.nn.Parameter(hand_piece(t, spec[n].param.dims, mesh.shape, coordinate).clone())
        for n, t in full.items()
    }


def set_local_grads(
    params: dict, spec: dict, coordinate: tuple[int, ...], dtype: torch.dtype, seed: int, step: int
) -> None:
    """Every parameter's gradient of ``seed``'s step ``step``, this rank's piece of it."""
    for name, (grad, addends) in step_grads(dtype, seed, step).items():
        params[name].grad = local_grad(grad, addends, spec[name].grad, coordinate)


def reference_optimizer(kind: str, params: list[torch.nn.Parameter], hyper: dict) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, foreach=False, **hyper)
    return came_pytorch.CAME(params, **hyper)


def reference(kind: str, params: dict[str, torch.Tensor], hyper: dict) -> tuple[dict, torch.optim.Optimizer]:
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in params.items()}
    return ref, reference_optimizer(kind, list(ref.values()), hyper)


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


# --- the references --------------------------------------------------------------------
def train_reference(
    optimizers_of: Callable[[dict[str, torch.nn.Parameter]], list], dtype: torch.dtype, seed: int, steps: int
) -> dict[str, torch.Tensor]:
    """``steps`` steps of the single-process optimizers ``optimizers_of(params)`` makes for
    ``seed``'s full tensors, on its full gradients: the tensors after them."""
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in initial_params(dtype, seed).items()}
    optimizers = optimizers_of(ref)
    for step in range(steps):
        for name, (grad, _) in step_grads(dtype, seed, step).items():
            ref[name].grad = grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    return {n: p.detach() for n, p in ref.items()}


def _reference_run(kind: str, dtype: torch.dtype, seed: int, steps: int, hyper: dict) -> dict[str, torch.Tensor]:
    return train_reference(lambda ref: [reference_optimizer(kind, list(ref.values()), hyper)], dtype, seed, steps)


def assert_relatively_close(
    got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, label: str, against: str
) -> None:
    """``got`` within ``CAME_TOLERANCE`` of ``want`` (the optimizer ``against``), relative to its largest entry."""
    assert got.shape == want.shape, f"{label}: shape {list(got.shape)} != {list(want.shape)}"
    if want.numel() == 0:
        return
    error = ((got - want).abs().max() / want.abs().max()).item()
    assert error <= CAME_TOLERANCE[dtype], f"{label}: relative error {error:.3g} against {against}"


def _assert_close(kind: str, dtype: torch.dtype, got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    if kind == "adamw":
        assert got.shape == want.shape, f"{label}: shape {list(got.shape)} != {list(want.shape)}"
        assert torch.equal(got, want), f"{label}: differs from torch.optim.AdamW by {(got - want).abs().max()}"
        return
    assert_relatively_close(got, want, dtype, label, "came_pytorch")


def check_pieces(case: dict, spec: dict, want: dict, dtype: torch.dtype, label: str, against: str) -> None:
    """Every parameter piece of ``case`` (a rank's, at ``case["coordinate"]``) against the
    reference's full tensors ``want`` cut by hand."""
    mesh = next(iter(spec.values())).param.mesh
    for name, got in case["params"].items():
        expected = hand_piece(want[name], spec[name].param.dims, mesh.shape, case["coordinate"])
        assert_relatively_close(got, expected, dtype, f"{label} '{name}'", against)
