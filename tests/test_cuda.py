"""The runtime on CUDA: the optimizers, reshard, checkpoints, overlap and prefetch, and memory,
each against an independent reference on the same device (docs/gpu.md).

Two runs hold every case: one rank on NCCL (a world of one, since NCCL takes one GPU per rank),
and two gloo ranks sharing the GPU with CUDA tensors (gloo moves them through the host, so the
collectives, buckets and gathers of a real sharded step run on CUDA tensors). Where no CUDA
device is present every test here is reported as skipped with that reason; the GPU machine runs
them through ``bench/gpu_check.sh``. Each rank returns CPU tensors and numbers only.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.testing import run_ranks
from shardlang import parse_layout
from shardlang.spec import Layouts

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_check.sh runs these)"),
]

SHAPES = {"w1": (64, 48), "b1": (64,), "w2": (40, 64), "b2": (40,), "odd": (33, 7)}
STEPS = 6
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}
CAME = {"lr": 1e-2, "weight_decay": 0.1, "clip_threshold": 0.3, "betas": (0.9, 0.99, 0.999)}
ADAFACTOR = {"lr": 1e-2, "weight_decay": 0.1}
MUON = {"lr": 2e-2, "weight_decay": 0.1, "momentum": 0.9}
# What the state layout is, per case: rows split over dp (ZeRO), flat chunks, replicated.
STATES = {"rows": "rows", "flat": "flat", "replicated": "replicated"}
# Sizes for the memory case: 16 matrices of 1 MiB, buckets of 2 MiB.
MEMORY_SHAPES = {f"m{i}": (512, 512) for i in range(16)}
MEMORY_BUCKET = 2 * 2**20


def _device() -> torch.device:
    """The rank's CUDA device; the CPU where there is none (``tests/test_fused_dist.py`` runs
    the fused cases there)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _spec(world: int, states: str, shapes: dict[str, tuple[int, ...]] = SHAPES) -> dict[str, Layouts]:
    """Parameters replicated, gradients a pending mean over dp, states as ``states`` says."""
    mesh = f"mesh[dp={world}]"
    spec = {}
    for name, shape in shapes.items():
        dims = ",".join("R" for _ in shape)
        state = ",".join(["S(dp)", *("R" for _ in shape[1:])]) if states == "rows" else dims
        spec[name] = Layouts(
            param=parse_layout(f"{dims} over {mesh}"),
            grad=parse_layout(f"{dims} | P(dp):avg over {mesh}"),
            states=(("", parse_layout(f"{state} over {mesh}")),),
        )
    return spec


def _params(seed: int, shapes: dict[str, tuple[int, ...]] = SHAPES) -> dict[str, torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.nn.Parameter(torch.randn(s, generator=generator).to(_device())) for n, s in shapes.items()}


def _grads(step: int, shapes: dict[str, tuple[int, ...]] = SHAPES) -> dict[str, torch.Tensor]:
    """The same on every rank, and dyadic (k/256): a mean over ranks of equal addends is exact."""
    generator = torch.Generator().manual_seed(1000 + step)
    return {n: (torch.randint(-512, 512, s, generator=generator) / 256).to(_device()) for n, s in shapes.items()}


def _sharded(kind: str, named: list, spec: dict, **options: Any) -> Any:
    from runtime.optim import ShardedAdafactor, ShardedAdamW, ShardedCAME, ShardedMuon

    if kind == "came":
        return ShardedCAME(named, spec, **CAME, **options)
    if kind == "adafactor":
        return ShardedAdafactor(named, spec, **ADAFACTOR, **options)
    if kind == "muon":
        return ShardedMuon(named, spec, **MUON, **options)
    return ShardedAdamW(named, spec, **ADAMW, **options)


def _reference(kind: str, params: list[torch.nn.Parameter], variant: str) -> torch.optim.Optimizer:
    if kind == "came":
        import came_pytorch

        return came_pytorch.CAME(params, **CAME)
    if kind == "adafactor":
        return torch.optim.Adafactor(params, **ADAFACTOR)
    if kind == "muon":
        return torch.optim.Muon(params, **MUON)
    return torch.optim.AdamW(params, **ADAMW, foreach=variant != "fused", fused=variant == "fused")


def _train_against_reference(world: int, kind: str, states: str, variant: str) -> dict[str, Any]:
    """``STEPS`` steps of the sharded optimizer and of the reference on the same device, from the
    same parameters and gradients: the largest difference per tensor, and where the result lies."""
    shapes = {n: s for n, s in SHAPES.items() if len(s) == 2} if kind == "muon" else SHAPES
    params = _params(7, shapes)
    reference = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
    options: dict[str, Any] = {"flat_axis": "dp"} if states == "flat" else {}
    if variant == "fused":
        options["fused"] = True
    optimizer = _sharded(kind, list(params.items()), _spec(world, states, shapes), **options)
    torch_optimizer = _reference(kind, list(reference.values()), variant)
    for step in range(STEPS):
        for name, grad in _grads(step, shapes).items():
            params[name].grad = grad.clone()
            reference[name].grad = grad.clone()
        optimizer.step()
        torch_optimizer.step()
    devices = {str(p.device) for p in params.values()}
    states_on = {str(t.device) for t in _tensors(optimizer.state_dict())}
    return {
        "diff": {n: (params[n].detach() - reference[n].detach()).abs().max().item() for n in params},
        "devices": sorted(devices | states_on),
    }


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def _reshard_cases(world: int) -> dict[str, Any]:
    """A tensor split by rows, gathered, and split again by columns: each against the full
    tensor sliced by hand."""
    from runtime import reshard

    rank = torch.distributed.get_rank()
    full = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10).to(_device())
    mesh = f"mesh[dp={world}]"
    rows, cols = full.chunk(world, 0)[rank], full.chunk(world, 1)[rank]
    gathered = reshard(
        rows.clone(), parse_layout(f"S0,R over {mesh}"), parse_layout(f"R,R over {mesh}"), global_shape=(12, 10)
    )
    split = reshard(
        gathered, parse_layout(f"R,R over {mesh}"), parse_layout(f"R,S0 over {mesh}"), global_shape=(12, 10)
    )
    return {
        "gathered": torch.equal(gathered, full) and gathered.is_cuda,
        "split": torch.equal(split, cols) and split.is_cuda,
    }


def _checkpoint_case(world: int, directory: str) -> dict[str, Any]:
    """Three steps, a save, a fresh optimizer loading it, one more step on both: equal bits."""
    from runtime import checkpoint

    spec = _spec(world, "rows")
    params = _params(3)
    optimizer = _sharded("adamw", list(params.items()), spec)
    for step in range(3):
        for name, grad in _grads(step).items():
            params[name].grad = grad
        optimizer.step()
    checkpoint.save(Path(directory) / "ckpt", optimizer=optimizer)
    copies = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
    loaded = _sharded("adamw", list(copies.items()), spec)
    checkpoint.load(Path(directory) / "ckpt", optimizer=loaded)
    same_states = all(
        torch.equal(a, b) and a.is_cuda
        for a, b in zip(_tensors(optimizer.state_dict()), _tensors(loaded.state_dict()), strict=True)
        if a.numel() > 1
    )
    for name, grad in _grads(3).items():
        params[name].grad = grad
        copies[name].grad = grad.clone()
    optimizer.step()
    loaded.step()
    return {"same_states": same_states, "same_after": all(torch.equal(params[n], copies[n]) for n in params)}


def _mlp() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.GELU(), torch.nn.Linear(64, 40)).to(_device())


def _overlap_case(world: int, prefetch: bool) -> dict[str, Any]:
    """Backward with the buckets started in its hooks (on NCCL's stream), gradients freed once
    packed, the parameters' gathers prefetched into the next forward; against
    torch.optim.AdamW(foreach=True) on a copy of the model fed the same batches."""
    from runtime.optim import ShardedAdamW

    model = _mlp()
    reference = copy.deepcopy(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    optimizer = ShardedAdamW(
        model.named_parameters(),
        _spec(world, "rows", shapes),
        **ADAMW,
        overlap=True,
        free_grads=True,
        bucket_bytes=8192,
    )
    if prefetch:
        optimizer.prefetch_params(model[0], model[2])
    torch_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW, foreach=True)
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(50 + step)
        batch = torch.randn(16, 48, generator=generator).to(_device())
        for net in (model, reference):
            net(batch).square().mean().backward()
        optimizer.step()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
    optimizer.wait_params()
    return {
        "diff": max(
            (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        ),
        "grads_left": sum(p.grad is not None for p in model.parameters()),
    }


def _memory_case(world: int) -> dict[str, Any]:
    """What the optimizer holds after its first step, by torch.cuda's counters, against
    ``memory_report()``: measured after the parameters and gradients exist, so what is new is
    the optimizer's own (states, buffers kept, scratch kept), and the peak during a step."""
    from runtime.optim import ShardedAdamW

    params = _params(11, MEMORY_SHAPES)
    for name, grad in _grads(0, MEMORY_SHAPES).items():
        params[name].grad = grad
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    optimizer = ShardedAdamW(list(params.items()), _spec(world, "rows", MEMORY_SHAPES), bucket_bytes=MEMORY_BUCKET)
    optimizer.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    optimizer.step()
    torch.cuda.synchronize()
    report = optimizer.memory_report()
    return {
        "held": torch.cuda.memory_allocated() - before,
        "peak": torch.cuda.max_memory_allocated() - before,
        "step_peak": torch.cuda.max_memory_allocated() - start,
        "predicted": report.tensor_bytes - report.params - report.grads,  # CUDA tensors only: no host objects
        "report": str(report),
        "model": sum(4 * math.prod(s) for s in MEMORY_SHAPES.values()),
    }


KINDS = ("adamw", "came", "adafactor", "muon")


def all_cases(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in KINDS:
        for states in ("rows", "flat"):
            if kind == "muon" and states == "flat":
                continue  # Muon needs whole matrices per owner: no flat chunks
            out[f"{kind}-{states}"] = _train_against_reference(world_size, kind, states, "foreach")
    out["adamw-replicated"] = _train_against_reference(world_size, "adamw", "replicated", "foreach")
    out["adamw-rows-fused"] = _train_against_reference(world_size, "adamw", "rows", "fused")
    out["adamw-flat-fused"] = _train_against_reference(world_size, "adamw", "flat", "fused")
    out["reshard"] = _reshard_cases(world_size)
    out["checkpoint"] = _checkpoint_case(world_size, f"{directory}/{torch.distributed.get_backend()}")
    out["overlap"] = _overlap_case(world_size, prefetch=False)
    out["prefetch"] = _overlap_case(world_size, prefetch=True)
    out["memory"] = _memory_case(world_size)
    return out


RUNS = {"nccl": 1, "gloo": 2}  # backend: ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    directory = str(tmp_path_factory.mktemp("cuda"))
    return {
        backend: run_ranks(all_cases, ranks, args=(directory,), backend=backend, timeout=300)
        for backend, ranks in RUNS.items()
    }


# Tolerances against the reference (the largest absolute difference after STEPS steps): AdamW
# is elementwise and runs the reference's kernels, so none; the others reduce over rows and
# columns, whose sums the shards add in another order.
TOLERANCE = {"adamw": 0.0, "came": 1e-5, "adafactor": 1e-5, "muon": 1e-3}


@pytest.mark.parametrize("backend", list(RUNS))
@pytest.mark.parametrize(
    "case",
    [f"{k}-{s}" for k in KINDS for s in ("rows", "flat") if not (k == "muon" and s == "flat")]
    + ["adamw-replicated", "adamw-rows-fused", "adamw-flat-fused"],
)
def test_optimizer_on_cuda_matches_the_reference(runs: dict, backend: str, case: str) -> None:
    tolerance = TOLERANCE[case.split("-")[0]]
    for rank, got in enumerate(runs[backend]):
        result = got[case]
        assert all(d.startswith("cuda") for d in result["devices"]), (rank, result["devices"])
        worst = max(result["diff"].items(), key=lambda item: item[1])
        assert worst[1] <= tolerance, f"{backend} rank {rank} {case}: {worst[0]} differs by {worst[1]:g}"


@pytest.mark.parametrize("backend", list(RUNS))
def test_reshard_on_cuda_matches_the_tensor_sliced_by_hand(runs: dict, backend: str) -> None:
    for got in runs[backend]:
        assert got["reshard"] == {"gathered": True, "split": True}


@pytest.mark.parametrize("backend", list(RUNS))
def test_checkpoint_of_cuda_states_saves_and_loads(runs: dict, backend: str) -> None:
    for got in runs[backend]:
        assert got["checkpoint"] == {"same_states": True, "same_after": True}


@pytest.mark.parametrize("backend", list(RUNS))
@pytest.mark.parametrize("case", ["overlap", "prefetch"])
def test_overlap_and_prefetch_on_cuda_streams(runs: dict, backend: str, case: str) -> None:
    # Two backward passes of the same model and batch: the same kernels, but cuBLAS does not
    # promise the same bits, so a small tolerance.
    for rank, got in enumerate(runs[backend]):
        assert got[case]["diff"] <= 1e-6, (rank, got[case])
        assert got[case]["grads_left"] == 0, (rank, got[case])


@pytest.mark.parametrize("backend", list(RUNS))
def test_memory_on_cuda_is_what_the_report_predicts(runs: dict, backend: str) -> None:
    for rank, got in enumerate(runs[backend]):
        memory = got["memory"]
        held, peak, predicted = memory["held"], memory["peak"], memory["predicted"]
        assert abs(held - predicted) <= 0.1 * predicted, (
            f"rank {rank}: held {held} B, predicted {predicted} B ({memory['report']})"
        )
        assert peak <= 1.1 * predicted, f"rank {rank}: peak {peak} B, predicted {predicted} B ({memory['report']})"
