"""FSDP2 + TP on [dp=2, tp=2] (4 gloo ranks) with the sharded optimizers equals single-process
training with torch.optim.AdamW and came_pytorch.CAME; and TP on mesh["tp"] inside the
[dp, tp] job, with the spec's full-mesh grad and state layouts (ZeRO over dp); both again with
``overlap``, ``clip_grad_norm_`` and every bucket's result landing late.

One spawn runs every case; the references run here, in the test process, on the whole model
and the whole batch.
"""

from __future__ import annotations

import contextlib
from typing import Any

import came_pytorch
import pytest
import torch

from runtime.testing import run_ranks

STEPS = 10
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
CAME = {"lr": 1e-2, "weight_decay": 0.1, "clip_threshold": 0.3, "betas": (0.9, 0.99, 0.999)}
TOLERANCE = {("adamw", torch.float32): 1e-6, ("adamw", torch.float64): 1e-12}
TOLERANCE |= {("came", torch.float32): 1e-5, ("came", torch.float64): 1e-10}
CASES = [(kind, dtype) for kind in ("adamw", "came") for dtype in (torch.float32, torch.float64)]
BATCH = 8

# TP on mesh["tp"]: the spec says what the DTensors cannot, that gradients pend a mean over dp,
# and keeps every state sharded over dp as well (ZeRO).
SUB_MESH_SPEC = """
mesh world = [dp=2,tp=2]
rule "0.weight" {
  param = S(tp),R over world  grad = S(tp),R | P(dp):avg over world  state = S(tp,dp),R over world
}
rule "0.bias" { param = S(tp) over world  grad = S(tp) | P(dp):avg over world  state = S(tp,dp) over world }
rule "2.weight" {
  param = R,S(tp) over world  grad = R,S(tp) | P(dp):avg over world  state = S(dp),S(tp) over world
}
rule "2.bias" { param = R over world  grad = R | P(dp):avg over world  state = S(dp) over world }
"""


def model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 5)).to(dtype)


def batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 6, generator=gen).to(dtype), torch.randn(BATCH, 5, generator=gen).to(dtype)


def optimizer_for(kind: str, named: list, spec: Any = None, **options: Any):
    from runtime.optim import ShardedAdamW, ShardedCAME

    if kind == "adamw":
        return ShardedAdamW(named, spec, **ADAMW, **options)
    return ShardedCAME(named, spec, **CAME, **options)


def _train(rank: int, kind: str, dtype: torch.dtype, *, fsdp: bool, overlap: bool = False) -> dict[str, Any]:
    """``overlap``: the optimizer's buckets (of 64 bytes) start during backward, every bucket's
    result landing late (``tests.late_results``), and the step is clipped by
    ``clip_grad_norm_`` to a norm no step reaches (so the same training)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from planner.legs import BEFORE
    from shardlang import parse_spec
    from tests.late_results import LateResults

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    net = model(dtype)
    parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if fsdp:
        fully_shard(net, mesh=mesh["dp"])
        spec = None
    else:
        spec = parse_spec(SUB_MESH_SPEC)
    options = {"overlap": True, "bucket_bytes": 64} if overlap else {}
    optimizer = optimizer_for(kind, list(net.named_parameters()), spec, **options)
    half = slice(BATCH // 2 * (rank // 2), BATCH // 2 * (rank // 2 + 1))  # this rank's dp half
    results, started = LateResults(), []
    with results.installed(), results.delayed() if overlap else contextlib.nullcontext():
        for step in range(STEPS):
            x, y = batch(step, dtype)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(net(x[half]), y[half]).backward()
            started.append((optimizer.buckets_started, len(optimizer.step_plan().stage_buckets(BEFORE))))
            if overlap:
                optimizer.clip_grad_norm_(1e6)
            optimizer.step()
    return {
        "params": {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()},
        "started": started,
    }


def all_cases(rank: int, world_size: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for kind, dtype in CASES:
        out[("fsdp_tp", kind, dtype)] = _train(rank, kind, dtype, fsdp=True)
    for kind in ("adamw", "came"):
        out[("tp_sub_mesh", kind, torch.float64)] = _train(rank, kind, torch.float64, fsdp=False)
        for fsdp in (True, False):
            out[("overlap", fsdp, kind)] = _train(rank, kind, torch.float64, fsdp=fsdp, overlap=True)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[Any, Any]]:
    return run_ranks(all_cases, 4, timeout=240)


def reference(kind: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    net = model(dtype)
    if kind == "adamw":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(net.parameters(), foreach=False, **ADAMW)
    else:
        optimizer = came_pytorch.CAME(net.parameters(), **CAME)
    for step in range(STEPS):
        x, y = batch(step, dtype)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    return {n: p.detach() for n, p in net.named_parameters()}


def _assert_trains_as_one_process(got: dict[str, Any], kind: str, dtype: torch.dtype) -> None:
    got = got["params"]
    want = reference(kind, dtype)
    start = model(dtype)
    for name, value in want.items():
        assert not torch.equal(value, dict(start.named_parameters())[name].detach())  # it did train
        error = ((got[name] - value).abs().max() / value.abs().max()).item()
        assert error <= TOLERANCE[(kind, dtype)], f"{name}: relative error {error:.3g}"


@pytest.mark.parametrize(("kind", "dtype"), CASES)
def test_fsdp2_over_tp_trains_as_one_process(ranks: list[dict[Any, Any]], kind: str, dtype: torch.dtype) -> None:
    for rank in ranks:
        _assert_trains_as_one_process(rank[("fsdp_tp", kind, dtype)], kind, dtype)


@pytest.mark.parametrize("kind", ["adamw", "came"])
@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2_tp", "tp_sub_mesh"])
def test_overlap_and_clip_grad_norm_train_as_one_process(ranks: list[dict[Any, Any]], kind: str, fsdp: bool) -> None:
    for rank in ranks:
        got = rank[("overlap", fsdp, kind)]
        _assert_trains_as_one_process(got, kind, torch.float64)
        # Every bucket before the update started during backward, but on a DTensor's first step
        # (its gradient's layout shows then). FSDP2 reduces the gradients itself: none is left.
        first, *later = got["started"]
        assert first[0] == 0 and all(n == total for n, total in later), got["started"]
        assert all(total == 0 if fsdp else total > 1 for _, total in got["started"]), got["started"]


@pytest.mark.parametrize("kind", ["adamw", "came"])
def test_tp_on_a_sub_mesh_with_zero_over_dp_trains_as_one_process(ranks: list[dict[Any, Any]], kind: str) -> None:
    for rank in ranks:
        _assert_trains_as_one_process(rank[("tp_sub_mesh", kind, torch.float64)], kind, torch.float64)
