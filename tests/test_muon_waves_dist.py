"""ShardedMuon moves and iterates its matrices a wave of buckets at a time (docs/memory.md): on 4
gloo ranks, a ZeRO-2 step of 24 matrices (0.8 MiB) with 64 KiB buckets creates no more than two
buckets and one matrix of tensors alive at once beyond an AdamW step's, gathered and owned, holds
between steps what ``memory_report()`` says, and still equals
torch.optim.Muon (torch.optim.AdamW on the bias) on the full tensors.

What is alive is measured outside the optimizer: every tensor an op makes inside ``step()``
(a ``TorchDispatchMode``), each storage counted once while a tensor of it lives; a ShardedAdamW
step of the same spec gives what the step around the math makes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from planner.matrices import TO
from runtime.measure.storages import storage_bytes
from runtime.testing import run_ranks
from shardlang import parse_layout
from shardlang.spec import Layouts
from tests.live_storages import LiveStorages
from tests.optim_support import CAME_TOLERANCE

SHAPES = {f"w{i}": (64, 128) for i in range(24)} | {"uneven": (66, 128), "bias": (384,)}
BUCKET = 64 * 1024  # bytes: a twelfth of the matrices
LARGEST = 66 * 128 * 4
WORLD, STEPS = 4, 3
MUON = {"lr": 2e-2, "weight_decay": 0.1, "momentum": 0.9}
ADAMW = {"lr": 1e-2, "weight_decay": 0.05, "betas": (0.9, 0.99)}


class _Alive(TorchDispatchMode):
    """The most bytes of storages made by ops under the mode and alive at once (``live.peak``)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = LiveStorages()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.live.note(out)
        return out


def _spec() -> dict[str, Layouts]:
    mesh = f"mesh[dp={WORLD}]"
    spec = {}
    for name, shape in SHAPES.items():
        dims = ",".join("R" for _ in shape)
        spec[name] = Layouts(
            param=parse_layout(f"{dims} over {mesh}"),
            grad=parse_layout(f"{dims} | P(dp):avg over {mesh}"),
            states=(("", parse_layout(f"{','.join(['S(dp)', *('R' for _ in shape[1:])])} over {mesh}")),),
        )
    return spec


def _initial() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return {n: torch.randn(shape, generator=generator) for n, shape in SHAPES.items()}


def _grads(step: int, rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return {n: torch.randn(shape, generator=generator) for n, shape in SHAPES.items()}


def _run(rank: int, world_size: int, placement: str | None) -> dict[str, Any]:
    """ShardedMuon with ``placement``, or (``None``) ShardedAdamW: what the step around the math makes."""
    from runtime.optim import ShardedAdamW, ShardedMuon

    torch.set_num_threads(1)
    params = {n: torch.nn.Parameter(t) for n, t in _initial().items()}
    adamw = {f"adamw_{k}": v for k, v in ADAMW.items()}
    if placement is None:
        optimizer = ShardedAdamW(list(params.items()), _spec(), bucket_bytes=BUCKET, **ADAMW)
    else:
        optimizer = ShardedMuon(
            list(params.items()), _spec(), placement=placement, bucket_bytes=BUCKET, **MUON, **adamw
        )
    alive = _Alive()
    for step in range(STEPS):
        for name, grad in _grads(step, rank).items():
            params[name].grad = grad
        if step == STEPS - 1:  # the buffers kept between steps are made by then
            with alive:
                optimizer.step()
        else:
            optimizer.step()
    skip = {p.untyped_storage().data_ptr() for p in params.values()}
    skip |= {p.grad.untyped_storage().data_ptr() for p in params.values() if p.grad is not None}
    report = optimizer.memory_report()
    counted = report.tensor_bytes - report.params - report.grads  # torch's product caches are no tensor
    matrices = optimizer.step_plan().matrices
    waves = 0 if matrices is None else sum(b.stage == TO for b in matrices.buckets)
    return {
        "params": {n: p.detach().clone() for n, p in params.items()},
        "peak": alive.live.peak,
        "waves": waves,
        "held": sum(storage_bytes(optimizer, skip).values()),
        "counted": counted,
    }


def _reference() -> dict[str, torch.Tensor]:
    ref = {n: torch.nn.Parameter(t) for n, t in _initial().items()}
    optimizers = [
        torch.optim.Muon([p for p in ref.values() if p.ndim == 2], **MUON),
        torch.optim.AdamW([p for p in ref.values() if p.ndim != 2], foreach=False, **ADAMW),
    ]
    for step in range(STEPS):
        grads = [_grads(step, rank) for rank in range(WORLD)]
        for name, p in ref.items():
            p.grad = sum(g[name] for g in grads) / WORLD
        for optimizer in optimizers:
            optimizer.step()
    return {n: p.detach() for n, p in ref.items()}


@pytest.mark.parametrize("placement", ["gather", "owner"])
def test_a_muon_step_holds_a_wave_of_matrices_not_the_model(placement: str) -> None:
    around = run_ranks(_run, WORLD, args=(None,), timeout=120)
    ranks = run_ranks(_run, WORLD, args=(placement,), timeout=120)
    want = _reference()
    model = sum(t.numel() * 4 for n, t in want.items() if t.ndim == 2)
    for rank, result in enumerate(ranks):
        assert result["waves"] > 1, f"rank {rank}: one wave of {len(SHAPES) - 1} matrices"
        # Beyond what an AdamW step makes (the gradients reduced, the parameters gathered).
        extra = result["peak"] - around[rank]["peak"]
        assert extra <= 2 * BUCKET + LARGEST < model / 2, f"rank {rank} {placement}: {extra} bytes more alive"
        # What it keeps between steps (a wave's gather buffer with gathers) is what it reports.
        assert abs(result["held"] - result["counted"]) <= 64, (rank, result["held"], result["counted"])
        for name, got in result["params"].items():
            error = ((got - want[name]).abs().max() / want[name].abs().max()).item()
            assert error <= CAME_TOLERANCE[torch.float32], f"rank {rank} '{name}': relative error {error:.3g}"
