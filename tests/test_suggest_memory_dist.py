"""``suggest`` predicts per-rank memory as the runtime holds it: for the layouts it proposes
(ZeRO-1, ZeRO-2, flat ZeRO-2 on a small model; ``shardlang suggest`` on a plain model), its
prediction equals ``ShardedAdamW(...).memory_report()`` kind by kind on every one of 4 gloo
ranks, bucket buffers and scratch included, and lies within 10% of what the optimizer's tensors
hold, counted through their storages (as tests/test_memory_dist.py counts them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from cli.main import main
from planner.memory import predict_memory
from planner.suggest import build_problem
from runtime.measure.storages import storage_bytes
from runtime.optim.commit import FLAG_ELEMENTS
from runtime.testing import run_ranks
from shardlang import load_spec, parse_spec
from shardlang.spec import Spec

WORLD = 4
BUCKET = 64 * 1024  # bytes: several buckets per stage
_PLAIN = "tensor {name} : {dtype}[{shape}] {{ param = {rep} over world  grad = {rep} | P(dp):avg over world }}\n"
SHAPES = {f"w{i}": ((64, 128), "f32") for i in range(10)} | {
    "h": ((256, 64), "bf16"),
    "bias": ((384,), "f32"),
    "uneven": ((66, 128), "f32"),  # the last rank's rows are short of their padded chunk
}
TEXT = "mesh world = [dp=4]  bandwidth 25e9  latency 20us\n" + "".join(
    _PLAIN.format(name=n, dtype=d, shape=", ".join(map(str, s)), rep=",".join("R" for _ in s))
    for n, (s, d) in SHAPES.items()
)
# (strategy of suggest's problem, flat axis): the fixed layouts suggest prices.
STRATEGIES = {"zero1": ("zero1", None), "zero2": ("zero2", None), "zero2 flat": ("zero2 flat", "dp")}


def _proposed(name: str) -> tuple[Spec, str | None]:
    strategy, flat = STRATEGIES[name]
    problem = build_problem(parse_spec(TEXT), flat_axis=flat, bucket_bytes=BUCKET)
    choice = problem.strategy(strategy)
    assert choice is not None
    return problem.spec_of(choice), flat


def _held(
    rank: int,
    world: int,
    spec: Spec,
    flat: str | None,
    bucket: int | None,
    optimizer_name: str = "adamw",
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from runtime.optim import ShardedAdafactor, ShardedAdamW, ShardedCAME, ShardedMuon

    kinds = {"adamw": ShardedAdamW, "came": ShardedCAME, "adafactor": ShardedAdafactor, "muon": ShardedMuon}
    torch.manual_seed(0)
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    params = {t.name: torch.nn.Parameter(torch.randn(t.shape, dtype=dtypes[t.dtype])) for t in spec.tensors}
    optimizer = kinds[optimizer_name](
        list(params.items()), spec, bucket_bytes=bucket, flat_axis=flat, lr=1e-3, **(options or {})
    )
    for step in range(2):
        generator = torch.Generator().manual_seed(step)  # alike on every rank: ZeRO-1 reads them reduced
        loss = sum((p.float() * torch.randn(p.shape, generator=generator)).sum() for p in params.values())
        loss.backward()  # through backward: overlap's hooks take the gradients there
        optimizer.step()
    skip = {p.untyped_storage().data_ptr() for p in params.values()}
    skip |= {p.grad.untyped_storage().data_ptr() for p in params.values() if p.grad is not None}
    report = attrs.asdict(optimizer.memory_report())
    return {"report": report, "held": sum(storage_bytes(optimizer, skip).values())}


def _run_strategies(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {name: _held(rank, world, *_proposed(name), BUCKET) for name in STRATEGIES}


@pytest.mark.slow
def test_suggest_predicts_the_memory_report_of_the_layouts_it_proposes() -> None:
    results = run_ranks(_run_strategies, WORLD, timeout=240)
    for name in STRATEGIES:
        spec, flat = _proposed(name)
        for rank, got in enumerate(results):
            report = got[name]["report"]
            assert report["wrapper"] == 0
            predicted = attrs.asdict(predict_memory(spec, rank=rank, flat_axis=flat, bucket_bytes=BUCKET))
            assert predicted == report, (name, rank, predicted, report)
            assert report["buffers"] > 0 and report["scratch"] > 0, (name, rank, report)
            # What the optimizer's tensors hold (less the loop's parameters and gradients), to
            # the commit flag's few bytes.
            counted = sum(predicted.values()) - predicted["params"] - predicted["grads"] - predicted["host"]
            assert abs(got[name]["held"] - counted) <= 64, (name, rank, got[name]["held"], counted)


def _run_suggested(rank: int, world: int, path: str, bucket: int) -> dict[str, Any]:
    return _held(rank, world, load_spec(path), None, bucket)


@pytest.mark.slow
def test_shardlang_suggest_on_a_plain_model_predicts_what_the_runtime_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, chosen = tmp_path / "plain.shard", tmp_path / "chosen.shard"
    source.write_text(TEXT)
    assert main(["suggest", str(source), "--memory", "2MiB", "--format", "json", "-o", str(chosen)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["flat_axis"] is None  # a plain problem's layouts: the optimizer runs them without flat_axis
    predicted = out["runtime_memory"]
    assert predicted["total"] <= 2 * 2**20
    results = run_ranks(_run_suggested, WORLD, args=(str(chosen), out["bucket_bytes"]), timeout=240)
    first = results[0]
    report = first["report"]
    assert {k: v for k, v in predicted.items() if k != "total"} == report, (predicted, report)
    runtime = first["held"] + report["params"] + report["grads"]  # its tensors
    tensors = predicted["total"] - predicted["host"]
    assert abs(tensors - runtime) <= 0.1 * runtime, (predicted, runtime)
    # No rank holds more than the first rank, whose prediction suggest shows.
    assert max(sum(r["report"].values()) for r in results) <= predicted["total"]


# Layouts of their own: on a 2-d mesh, rows split over two axes (sums over both, per-matrix
# sums), and a batch of matrices; on one axis, matrices split by columns only (their row sums lie
# one after another in their all-reduce's buffer, so CAME copies none of them). Each 2-d one
# alone: mixed in one run, their gradients lie in no one range, and the math's copy of them is
# no scratch planner.memory sizes yet (docs/memory.md, "Statistics").
_STATED = "tensor {name} : {dtype}[{shape}] {{ param = {rep} over world  grad = {rep} | P(dp):avg over world  "


def _stated(mesh: str, tensors: dict[str, tuple[tuple[int, ...], str, str]]) -> str:
    return f"mesh world = [{mesh}]\n" + "".join(
        _STATED.format(name=n, dtype=d, shape=", ".join(map(str, s)), rep=",".join("R" for _ in s))
        + f"state = {state} over world }}\n"
        for n, (s, d, state) in tensors.items()
    )


CUSTOM = {
    "rows 2d": _stated("dp=2, tp=2", {"rows": ((40, 24), "f32", "S(dp,tp),R")}),
    "batch 2d": _stated("dp=2, tp=2", {"batch": ((3, 16, 20), "f32", "R,S(dp),R")}),
    "columns": _stated(
        "dp=4", {"a": ((24, 64), "f32", "R,S(dp)"), "bias": ((8,), "f32", "S(dp)"), "b": ((8, 36), "f32", "R,S(dp)")}
    ),
}


def _spec(strategy: str) -> tuple[Spec, str | None]:
    return (parse_spec(CUSTOM[strategy]), None) if strategy in CUSTOM else _proposed(strategy)


# (layouts suggest proposes, optimizer, options): every optimizer, and AdamW's step variants.
OPTIMIZER_CASES = {
    "adamw zero1": ("zero1", "adamw", {}),
    "adamw zero2 overlap": ("zero2", "adamw", {"overlap": True}),
    "adamw zero2 transactional": ("zero2", "adamw", {"transactional": True}),
    "adamw zero2 fused": ("zero2", "adamw", {"fused": True}),
    "adamw flat transactional": ("zero2 flat", "adamw", {"transactional": True}),
    "adamw zero2 clipped": ("zero2", "adamw", {"max_grad_norm": 1.0}),
    "came zero2": ("zero2", "came", {}),
    "came flat": ("zero2 flat", "came", {}),
    "adafactor zero2": ("zero2", "adafactor", {}),
    "adafactor flat clipped": ("zero2 flat", "adafactor", {"max_grad_norm": 1.0}),
    "came zero1": ("zero1", "came", {}),
    "came rows 2d": ("rows 2d", "came", {}),
    "came batch 2d": ("batch 2d", "came", {}),
    "came columns": ("columns", "came", {}),
    "adafactor rows 2d clipped": ("rows 2d", "adafactor", {"skip_nonfinite": True}),
    "muon zero2": ("zero2", "muon", {}),
    "muon flat": ("zero2 flat", "muon", {}),
}


def _run_optimizers(rank: int, world: int) -> dict[str, dict[str, Any]]:
    out = {}
    for case, (strategy, name, options) in OPTIMIZER_CASES.items():
        spec, flat = _spec(strategy)
        out[case] = _held(rank, world, spec, flat, BUCKET, name, options)
    return out


@pytest.mark.slow
def test_predict_memory_is_the_memory_report_of_every_optimizer() -> None:
    """``predict_memory`` from the spec equals ``memory_report()`` kind by kind for AdamW (ZeRO-1,
    overlap, transactional, fused, flat, clipped), CAME, Adafactor and Muon. And the report is
    what torch holds: the optimizer's tensors counted through their storages (independent of the
    formula), to the byte."""
    results = run_ranks(_run_optimizers, WORLD, timeout=300)
    for case, (strategy, name, options) in OPTIMIZER_CASES.items():
        spec, flat = _spec(strategy)
        for rank, got in enumerate(results):
            report = dict(got[case]["report"])
            predicted = attrs.asdict(
                predict_memory(spec, name, rank=rank, flat_axis=flat, bucket_bytes=BUCKET, **options)
            )
            # Everything, scratch included: CAME's and Adafactor's statistics and their sums'
            # buffers too. Muon's matrices here are each iterated by one owner and moved by
            # exchanges, which keep no wave buffers (gathered waves would: predict_memory does not
            # size them).
            assert predicted == report, (case, rank, predicted, report)
            # Torch's caches of Muon's products and the Python objects are no tensor of the optimizer's.
            counted = sum(report.values()) - report["params"] - report["grads"] - report["kernels"] - report["host"]
            # Besides: the commit flag (int64), the flag after the commit point (one int64, in
            # flight between steps; a transactional step has none) and, where every step takes
            # the gradient norm, the last one (f32), which the optimizer keeps for its caller; to
            # the byte.
            clipped = "max_grad_norm" in options or options.get("skip_nonfinite", False)
            after = 0 if options.get("transactional", False) else 8
            unreported = FLAG_ELEMENTS * 8 + after + (4 if clipped else 0)
            assert got[case]["held"] - counted == unreported, (case, rank, got[case]["held"], counted)
