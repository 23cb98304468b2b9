"""The optimizer step alone on one GPU: ShardedAdamW against torch.optim.AdamW, and ShardedCAME
against came_pytorch.CAME, on the same device in the same run (docs/gpu.md).

    python3 bench/bench_gpu.py --json out/gpu_check.json          # ~1B parameters
    python3 bench/bench_gpu.py --scale 0.1 --steps 3               # a quick look

One process, one NCCL rank (a world of one: NCCL takes one GPU per rank). The model is a set of
f32 tensors of ``--scale`` x 1.07B parameters (16 matrices of 8192 x 8192 and their biases); every
variant starts from the same parameters and gets the same gradients, one variant at a time, the
previous one's memory freed. Per variant:

* step time: the median over ``--steps`` timed steps (after 2 warm-up steps) of
  ``optimizer.step()`` between two CUDA events;
* memory: ``torch.cuda.max_memory_allocated`` over the steps, less what the parameters and
  gradients take (so the optimizer's own: states, buffers, scratch, temporaries), beside what
  ``memory_report()`` predicts for it;
* exactness: the parameters after the steps against the torch variant of the same kernels
  (``foreach=True`` for ShardedAdamW's default, ``fused=True`` for ``fused=True``).

The ShardedAdamW spec is ZeRO's (parameters replicated, gradients a mean over dp, states split by
rows over dp), which over one rank holds every row: the step runs the planner's program with
no collective, so what is measured is the runtime's own cost around the arithmetic.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import results as bench_results
import torch
import torch.distributed as dist

from shardlang import parse_layout
from shardlang.spec import Layouts

WIDTH = 8192
LAYERS = 16
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}
CAME = {"lr": 1e-3, "weight_decay": 0.01}
MiB = 2**20
DEVICE = torch.device("cuda", 0)


def shapes_for(scale: float, width: int = WIDTH) -> dict[str, tuple[int, ...]]:
    rows = max(8, int(width * scale) // 8 * 8)
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(LAYERS):
        shapes[f"layer{i}.weight"] = (rows, width)
        shapes[f"layer{i}.bias"] = (rows,)
    return shapes


def spec_for(shapes: dict[str, tuple[int, ...]]) -> dict[str, Layouts]:
    spec = {}
    for name, shape in shapes.items():
        dims = ",".join("R" for _ in shape)
        state = ",".join(["S(dp)", *("R" for _ in shape[1:])])
        spec[name] = Layouts(
            param=parse_layout(f"{dims} over mesh[dp=1]"),
            grad=parse_layout(f"{dims} | P(dp):avg over mesh[dp=1]"),
            states=(("", parse_layout(f"{state} over mesh[dp=1]")),),
        )
    return spec


def _start(device: torch.device) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group(
        "nccl", store=store, rank=0, world_size=1, timeout=datetime.timedelta(minutes=2), device_id=device
    )


def run_variant(
    name: str,
    make: Callable[[list[tuple[str, torch.nn.Parameter]]], Any],
    start: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    steps: int,
) -> dict[str, Any]:
    """Time and memory of ``steps`` steps of the optimizer ``make`` builds; its parameters after."""
    params = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    for n, p in params.items():
        p.grad = grads[n]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    optimizer = make(list(params.items()))
    times = []
    for step in range(steps + 2):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        optimizer.step()
        end.record()
        end.synchronize()
        if step >= 2:
            times.append(begin.elapsed_time(end))
    torch.cuda.synchronize()
    syncs = host_syncs(optimizer.step)
    report = optimizer.memory_report() if hasattr(optimizer, "memory_report") else None
    result = {
        "variant": name,
        "step_ms": statistics.median(times),
        "peak_bytes": torch.cuda.max_memory_allocated() - base,
        "held_bytes": torch.cuda.memory_allocated() - base,
        "predicted_bytes": None if report is None else report.tensor_bytes - report.params - report.grads,
        "params": {n: p.detach() for n, p in params.items()},
        "host_syncs": syncs,
    }
    del optimizer, params
    gc.collect()
    torch.cuda.empty_cache()
    return result


def host_syncs(call: Callable[[], Any]) -> int:
    """How many times ``call`` made the host wait for the device, as torch's sync debug mode
    counts them (each warns once)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], relative: bool = False) -> float:
    worst = 0.0
    for n in a:
        diff = (a[n] - b[n]).abs().max().item()
        if relative:
            diff /= max(b[n].abs().max().item(), 1e-30)
        worst = max(worst, diff)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="of the 1.07B-parameter model (default 1)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (after 2 warm-up steps)")
    parser.add_argument("--came-scale", type=float, default=0.125, help="of the model, for the CAME comparison")
    parser.add_argument("--tests", type=Path, default=None, help="a pytest junit XML to summarize beside")
    bench_results.add_json_option(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA device")
    device = DEVICE
    torch.cuda.set_device(device)
    _start(device)

    import came_pytorch

    from runtime.optim import ShardedAdamW, ShardedCAME

    shapes = shapes_for(args.scale)
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    generator = torch.Generator(device=device).manual_seed(0)
    start = {n: torch.randn(s, generator=generator, device=device) for n, s in shapes.items()}
    grads = {n: torch.randn(s, generator=generator, device=device) * 1e-2 for n, s in shapes.items()}
    spec = spec_for(shapes)
    variants: list[tuple[str, Callable[[list], Any]]] = [
        ("torch AdamW fused=True", lambda named: torch.optim.AdamW([p for _, p in named], **ADAMW, fused=True)),
        ("torch AdamW foreach=True", lambda named: torch.optim.AdamW([p for _, p in named], **ADAMW, foreach=True)),
        ("ShardedAdamW", lambda named: ShardedAdamW(named, spec, **ADAMW)),
        ("ShardedAdamW fused=True", lambda named: ShardedAdamW(named, spec, **ADAMW, fused=True)),
    ]
    runs = {name: run_variant(name, make, start, grads, args.steps) for name, make in variants}
    fused_ms = runs["torch AdamW fused=True"]["step_ms"]
    exact_against = {"ShardedAdamW": "torch AdamW foreach=True", "ShardedAdamW fused=True": "torch AdamW fused=True"}
    rows = []
    for name, run in runs.items():
        against = exact_against.get(name)
        diff = None if against is None else _largest_difference(run["params"], runs[against]["params"])
        predicted = run["predicted_bytes"]
        rows.append(
            [
                name,
                f"{run['step_ms']:.2f}",
                f"{run['step_ms'] / fused_ms:.2f}",
                str(run["host_syncs"]),
                f"{run['peak_bytes'] / MiB:.0f}",
                "" if predicted is None else f"{predicted / MiB:.0f}",
                "" if predicted is None else f"{run['peak_bytes'] / predicted:.3f}",
                "" if diff is None else f"{diff:g} vs {against}",
            ]
        )
    adamw_table = bench_results.table(
        f"AdamW step on one H200, {numel / 1e9:.2f}B f32 parameters ({len(shapes)} tensors), median of {args.steps}",
        [
            "optimizer",
            "step ms",
            "x fused",
            "host syncs",
            "peak MiB",
            "predicted MiB",
            "peak / predicted",
            "largest difference",
        ],
        rows,
        "peak: torch.cuda.max_memory_allocated over the steps less the parameters and gradients; "
        "predicted: memory_report() less the same; host syncs: in one step, by torch.cuda's sync debug mode",
    )
    del runs
    gc.collect()
    torch.cuda.empty_cache()

    came_shapes = shapes_for(args.came_scale)
    came_start = {n: start[n][: s[0]].clone() for n, s in came_shapes.items()}
    came_grads = {n: grads[n][: s[0]].clone() for n, s in came_shapes.items()}
    del start, grads
    came_spec = spec_for(came_shapes)
    came_runs = {
        name: run_variant(name, make, came_start, came_grads, args.steps)
        for name, make in [
            ("came_pytorch.CAME", lambda named: came_pytorch.CAME([p for _, p in named], **CAME)),
            ("ShardedCAME", lambda named: ShardedCAME(named, came_spec, **CAME)),
        ]
    }
    reference = came_runs["came_pytorch.CAME"]
    came_numel = sum(torch.Size(s).numel() for s in came_shapes.values())
    came_table = bench_results.table(
        f"CAME step on one H200, {came_numel / 1e6:.0f}M f32 parameters, median of {args.steps}",
        ["optimizer", "step ms", "x came_pytorch", "peak MiB", "largest relative difference"],
        [
            [
                name,
                f"{run['step_ms']:.2f}",
                f"{run['step_ms'] / reference['step_ms']:.2f}",
                f"{run['peak_bytes'] / MiB:.0f}",
                "" if run is reference else f"{_largest_difference(run['params'], reference['params'], True):g}",
            ]
            for name, run in came_runs.items()
        ],
    )
    tables = [adamw_table, came_table]
    if args.tests is not None and args.tests.exists():
        tables.insert(0, tests_table(args.tests))
    for t in tables:
        print(f"\n{t['title']}\n")
        print("| " + " | ".join(t["columns"]) + " |")
        print("|" + "---|" * len(t["columns"]))
        for row in t["rows"]:
            print("| " + " | ".join(row) + " |")
    info = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda}
    bench_results.write(args.json, "bench_gpu", tables, data=info)
    dist.destroy_process_group()


def tests_table(junit: Path) -> dict[str, Any]:
    """The CUDA tests' outcome from pytest's junit XML: one row per test."""
    import xml.etree.ElementTree as ElementTree

    rows = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped: " + (child.get("message") or "")
        rows.append([f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}", outcome])
    passed = sum(r[1] == "passed" for r in rows)
    return bench_results.table(f"CUDA tests: {passed} of {len(rows)} passed", ["test", "outcome"], rows)


if __name__ == "__main__":
    main()
