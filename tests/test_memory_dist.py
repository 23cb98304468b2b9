"""What a sharded optimizer holds, counted through the storages of the tensors it references (not
through its own accounting), on 4 gloo ranks: a ZeRO-2 step holds its states, the reduced
gradient shards and buffers of a few buckets, never a buffer the size of the model; and
``memory_report()`` predicts what it holds (docs/memory.md).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from runtime.measure.storages import storage_bytes
from runtime.testing import run_ranks
from shardlang import parse_layout
from shardlang.spec import Layouts

# 24 matrices of 32 KiB, one of uneven rows, a vector: buckets of 64 KiB take a few each.
SHAPES = {f"w{i}": (64, 128) for i in range(24)} | {"uneven": (66, 128), "bias": (384,)}
BUCKET = 64 * 1024  # bytes: a twelfth of the model's 0.8 MiB
WORLD = 4


def _spec(flat: bool) -> dict[str, Layouts]:
    mesh = f"mesh[dp={WORLD}]"
    spec = {}
    for name, shape in SHAPES.items():
        dims = ",".join("R" for _ in shape)
        state = dims if flat else ",".join(["S(dp)", *("R" for _ in shape[1:])])
        spec[name] = Layouts(
            param=parse_layout(f"{dims} over {mesh}"),
            grad=parse_layout(f"{dims} | P(dp):avg over {mesh}"),
            states=(("", parse_layout(f"{state} over {mesh}")),),
        )
    return spec


def _run(
    rank: int, world_size: int, flat: bool, transactional: bool, free_grads: bool | None, kind: str
) -> dict[str, Any]:
    from runtime.optim import ShardedAdamW, ShardedCAME

    torch.manual_seed(0)
    params = {n: torch.nn.Parameter(torch.randn(shape)) for n, shape in SHAPES.items()}
    optimizer = {"adamw": ShardedAdamW, "came": ShardedCAME}[kind](
        list(params.items()),
        _spec(flat),
        bucket_bytes=BUCKET,
        flat_axis="dp" if flat else None,
        transactional=transactional,
        lr=1e-3,
        **({} if free_grads is None else {"free_grads": free_grads}),
    )
    predicted_before = optimizer.memory_report()
    for step in range(3):
        generator = torch.Generator().manual_seed(100 * step + rank)
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
    grads_left = sum(p.grad is not None for p in params.values())
    skip = {p.untyped_storage().data_ptr() for p in params.values()}
    skip |= {p.grad.untyped_storage().data_ptr() for p in params.values() if p.grad is not None}
    held = sum(storage_bytes(optimizer, skip).values())
    report = optimizer.memory_report()
    return {
        "held": held,
        "grads_left": grads_left,
        "report": report,
        "predicted_before": predicted_before.total_bytes,
        "model": sum(4 * math.prod(shape) for shape in SHAPES.values()),
    }


# (flat, transactional, free_grads, optimizer); None: the default, which frees the gradients in
# step(). CAME's flat chunks keep a row, column and matrix index per element besides its scratch.
CASES = {
    "zero2": (False, False, None, "adamw"),
    "flat": (True, False, None, "adamw"),
    "transactional": (False, True, None, "adamw"),
    "kept_grads": (False, False, False, "adamw"),
    "came_flat": (True, False, None, "came"),
}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict[str, Any]]]:
    return {case: run_ranks(_run, WORLD, args=args, timeout=120) for case, args in CASES.items()}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["zero2", "flat", "kept_grads"])
def test_a_step_in_place_holds_no_buffer_the_size_of_the_model(results: dict, case: str) -> None:
    for rank, got in enumerate(results[case]):
        report, model = got["report"], got["model"]
        assert report.params == model
        # ZeRO-2 by default: step() frees the gradients it reduced; free_grads=False keeps them.
        kept = case == "kept_grads"
        assert report.grads == (model if kept else 0), str(report)
        assert got["grads_left"] == (len(SHAPES) if kept else 0), (rank, got["grads_left"])
        # A row or two more or less than a quarter of the rows: the uneven matrix.
        assert abs(report.states - 2 * model // WORLD) <= 2 * 4 * 2 * 128, (report.states, model)
        # The states, the reduced gradient shards (a quarter of the model), the send and result
        # regions of a bucket and the math's scratch (a group of shards, at most a quarter).
        bound = report.states + 2 * model // WORLD + 3 * BUCKET
        assert got["held"] <= bound, f"rank {rank}: the optimizer holds {got['held']} B, over {bound} B"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_memory_report_predicts_what_the_optimizer_holds(results: dict, case: str) -> None:
    for rank, got in enumerate(results[case]):
        report = got["report"]
        # What the optimizer's tensors hold is what its report says it holds (less what the
        # training loop holds: parameters and gradients), to the commit flag's few bytes; and
        # the report before the first step said so already.
        counted = report.tensor_bytes - report.params - report.grads
        assert abs(got["held"] - counted) <= 64, (rank, got["held"], counted, str(report))
        if case not in ("transactional", "came_flat"):  # whose scratch the first step makes
            assert got["predicted_before"] == report.total_bytes, (got["predicted_before"], str(report))


def _host(rank: int, world_size: int, kind: str) -> dict[str, int]:
    """Python's allocations alive after an optimizer's three steps (``tracemalloc``, from just
    before it was made), beside its report's ``host`` kind."""
    import gc
    import tracemalloc

    from runtime.optim import ShardedAdafactor, ShardedAdamW, ShardedCAME, ShardedMuon

    kinds = {"adamw": ShardedAdamW, "came": ShardedCAME, "adafactor": ShardedAdafactor, "muon": ShardedMuon}

    def steps(shapes: dict[str, tuple[int, ...]]) -> Any:
        params = {n: torch.nn.Parameter(torch.randn(shape)) for n, shape in shapes.items()}
        optimizer = kinds[kind](list(params.items()), _spec(False), bucket_bytes=BUCKET, lr=1e-3)
        for step in range(3):
            generator = torch.Generator().manual_seed(step)  # alike on every rank: Muon's matrices too
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=generator)
            optimizer.step()
        return optimizer

    steps(SHAPES)  # code, caches and interned objects every run loads, before the baseline
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    optimizer = steps(SHAPES)
    report = optimizer.memory_report()
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {"traced": traced, "host": report.host}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adamw", "came", "adafactor", "muon"])
def test_the_host_kind_is_the_python_objects_the_optimizer_keeps(kind: str) -> None:
    # Measured by Python's allocator, not by the report's per-tensor constant: within 20%.
    for rank, got in enumerate(run_ranks(_host, WORLD, args=(kind,), timeout=180)):
        assert abs(got["host"] - got["traced"]) <= 0.2 * got["traced"], (kind, rank, got)
