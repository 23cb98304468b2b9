"""runtime.reshard against DTensor.redistribute and against hand-written collectives.

    .venv/bin/python bench/bench_reshard.py                    # 1, 16 and 64 MB, 7 runs each
    .venv/bin/python bench/bench_reshard.py --sizes 16 --reps 11
    .venv/bin/python bench/bench_reshard.py --sizes 1,16 --uneven  # one row short: padded blocks

Four gloo ranks on this machine (CPU). For each pair DTensor can express and each global
tensor size (f32, [rows, 1024]), three ways run the same resharding on the same DeviceMesh
process groups, interleaved run by run so machine noise hits all alike:

* ``ours``: ``runtime.reshard(local, src, dst, global_shape=..., mesh=device_mesh)``;
* ``dtensor``: ``DTensor.redistribute`` from the same pieces (``to_local`` and wait);
* ``hand``: the steps of our plan written directly with torch.distributed collectives, as a
  user would (synchronous calls, torch.cat for dims other than 0, a copy when no step made
  one), no checks.

``--uneven`` takes one row off every tensor, so that no split is even (the executor pads its
blocks, DTensor pads likewise); the hand-written way, which assumes even shapes, is left out.

Time is the median over runs of the slowest rank. Peak memory is the rise of the process's
peak resident set (VmHWM, reset before each measurement) over its resident set before the
call, the largest over ranks; glibc maps every large buffer (MALLOC_MMAP_THRESHOLD_) and
returns freed heap pages first (malloc_trim), so reused memory counts. The three results are also compared for equality.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import results as bench_results
import torch
import torch.distributed as dist

import planner
from runtime import axis_group, reshard, shard
from runtime.comm.collectives import all_gather_single, reduce_scatter_single
from runtime.testing import run_ranks
from shardlang import parse_layout
from shardlang.interop import to_dtensor_placements

PAIRS = [
    ("S0,R over mesh[4]", "R,R over mesh[4]"),
    ("R,S0 over mesh[4]", "R,R over mesh[4]"),
    ("S0,R over mesh[4]", "R,S0 over mesh[4]"),
    ("R,R | P0 over mesh[4]", "S0,R over mesh[4]"),
    ("R,R | P0 over mesh[4]", "R,R over mesh[4]"),
    ("R,R | P0:avg over mesh[4]", "R,S0 over mesh[4]"),
    ("R,R over mesh[4]", "S0,R over mesh[4]"),
    ("R,S1 | P0 over mesh[2,2]", "S0,S1 over mesh[2,2]"),
    ("S0,S1 over mesh[2,2]", "R,S1 over mesh[2,2]"),
    ("S0,S1 over mesh[2,2]", "R,R over mesh[2,2]"),
    ("R,R | P01 over mesh[2,2]", "R,R over mesh[2,2]"),
    ("S01,R over mesh[2,2]", "R,S01 over mesh[2,2]"),
    ("R,R | P1:max over mesh[2,2]", "R,R over mesh[2,2]"),
]
COLUMNS = 1024


def hand_step(step: planner.Step, x: torch.Tensor, group: dist.ProcessGroup | None, n: int, k: int) -> torch.Tensor:
    """One plan step written directly with torch.distributed (even shapes only)."""
    op, dim = step.op, step.dim
    if op == "slice":
        return x.chunk(n, dim)[k]
    if op == "partial":
        return torch.zeros_like(x) if step.reduce_op == "sum" and k else x
    reduce_op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}.get(step.reduce_op)
    if op == "all_gather":
        out = x.new_empty(n * x.numel())
        all_gather_single(out, x.contiguous().view(-1), group=group)
        return torch.cat(list(out.view(n, *x.shape)), dim=dim) if dim else out.view(n * x.shape[0], *x.shape[1:])
    if op == "all_reduce":
        out = x.clone()
        dist.all_reduce(out, op=reduce_op, group=group)
    elif op == "reduce_scatter":
        flat = torch.cat([c.contiguous().view(-1) for c in x.chunk(n, dim)]) if dim else x.contiguous().view(-1)
        out = x.new_empty(flat.numel() // n)
        reduce_scatter_single(out, flat, op=reduce_op, group=group)
        out = out.view(*x.shape[:dim], x.shape[dim] // n, *x.shape[dim + 1 :])
    else:  # all_to_all
        to = step.to_dim
        flat = torch.cat([c.contiguous().view(-1) for c in x.chunk(n, to)])
        received = torch.empty_like(flat)
        dist.all_to_all_single(received, flat, group=group)
        block = [*x.shape[:to], x.shape[to] // n, *x.shape[to + 1 :]]
        return torch.cat(list(received.view(n, *block)), dim=dim)
    return out.div_(n) if step.reduce_op == "avg" else out


def _memory_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_rise_mb(call: Callable[[], torch.Tensor]) -> float:
    # Freed heap pages go back to the kernel, so buffers reusing them count again.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    before = _memory_kib("VmRSS")
    result = call()
    rise = _memory_kib("VmHWM") - before
    del result
    return rise / 1024


def _measure(
    rank: int, src_text: str, dst_text: str, megabytes: int, device_mesh, reps: int, uneven: bool
) -> dict[str, object]:
    from torch.distributed.tensor import DTensor

    src, dst = parse_layout(src_text), parse_layout(dst_text)
    mesh = src.mesh
    coordinate = mesh.coordinate(rank)
    dst_placements = to_dtensor_placements(dst)
    shape = (megabytes * 2**20 // (4 * COLUMNS) - uneven, COLUMNS)
    plan = planner.plan(src, dst, shape, "f32")
    local = shard(torch.randn(shape, generator=torch.Generator().manual_seed(0)), src, rank)
    dtensor = DTensor.from_local(
        local, device_mesh, to_dtensor_placements(src), run_check=False, shape=shape, stride=(COLUMNS, 1)
    )

    def ours() -> torch.Tensor:
        return reshard(local, src, dst, global_shape=shape, mesh=device_mesh)

    def redistribute() -> torch.Tensor:
        out = dtensor.redistribute(device_mesh, dst_placements).to_local()
        return out.wait() if hasattr(out, "wait") else out

    def hand() -> torch.Tensor:
        x = local
        for step in plan.steps:
            group = axis_group(mesh, (step.axis,), device_mesh)
            x = hand_step(step, x, group, mesh.shape[step.axis], coordinate[step.axis])
        # A fresh tensor, as reshard and DTensor return, even when no step copied.
        same = x.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
        return x.clone(memory_format=torch.contiguous_format) if same else x.contiguous()

    methods = (
        {"ours": ours, "dtensor": redistribute} if uneven else {"ours": ours, "dtensor": redistribute, "hand": hand}
    )
    results = {name: call() for name, call in methods.items()}  # warm-up: groups, plans, caches
    agree = all(torch.allclose(results["ours"], r, rtol=1e-5, atol=1e-5) for r in results.values())
    del results
    peaks = {}
    for name, call in methods.items():
        dist.barrier()
        peaks[name] = _peak_rise_mb(call)
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            dist.barrier()
            started = time.perf_counter()
            out = methods[name]()
            times[name].append(time.perf_counter() - started)
            del out
    # The slowest rank per run, and the largest peak over ranks.
    packed = torch.tensor([*(t for name in names for t in times[name]), *peaks.values(), float(not agree)])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    values = packed.tolist()
    row: dict[str, object] = {"pair": f"{src} -> {dst}", "mb": megabytes, "steps": len(plan.collectives)}
    for i, name in enumerate(names):
        row[f"{name}_ms"] = statistics.median(values[i * reps : (i + 1) * reps]) * 1e3
        row[f"{name}_peak_mb"] = values[len(names) * reps + i]
    row["agree"] = values[-1] == 0.0
    return row


def _bench_rank(rank: int, world_size: int, sizes: list[int], reps: int, uneven: bool) -> list[dict[str, object]]:
    from torch.distributed.device_mesh import init_device_mesh

    device_meshes: dict[tuple[int, ...], object] = {}
    rows = []
    for src_text, dst_text in PAIRS:
        shape = parse_layout(src_text).mesh.shape
        if shape not in device_meshes:
            device_meshes[shape] = init_device_mesh("cpu", shape)
        rows += [_measure(rank, src_text, dst_text, mb, device_meshes[shape], reps, uneven) for mb in sizes]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,16,64", help="global tensor sizes in MB (f32)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--uneven", action="store_true", help="one row short: no split is even")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # inherited by the spawned ranks
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = run_ranks(_bench_rank, 4, (sizes, args.reps, args.uneven), timeout=3600, collective_timeout=600)[0]
    print(f"4 gloo ranks, median of {args.reps} runs{', every tensor one row short' if args.uneven else ''}")
    print(
        "| pair | MB | collectives | ours ms | DTensor ms | ours/DTensor | hand ms | ours/hand "
        "| peak MB ours/DTensor/hand | agree |"
    )
    print("|" + "---|" * 10)
    for r in rows:
        hand = f"{r['hand_ms']:.2f} | {r['ours_ms'] / r['hand_ms']:.3f}" if "hand_ms" in r else "- | -"
        pair = r["pair"].replace("|", "\\|")  # a cell of a markdown table
        print(
            f"| {pair} | {r['mb']} | {r['steps']} | {r['ours_ms']:.2f} | {r['dtensor_ms']:.2f} "
            f"| {r['ours_ms'] / r['dtensor_ms']:.2f} | {hand} "
            f"| {r['ours_peak_mb']:.1f}/{r['dtensor_peak_mb']:.1f}/{r.get('hand_peak_mb', float('nan')):.1f} "
            f"| {r['agree']} |"
        )
    print()
    for mb in sizes:
        chosen = [r for r in rows if r["mb"] == mb]
        versus_dtensor = statistics.geometric_mean([r["ours_ms"] / r["dtensor_ms"] for r in chosen])
        line = f"{mb:>3} MB: geometric mean ours/DTensor {versus_dtensor:.3f}"
        if not args.uneven:
            line += f", ours/hand {statistics.geometric_mean([r['ours_ms'] / r['hand_ms'] for r in chosen]):.3f}"
        print(line)


if __name__ == "__main__":
    # --json PATH: also write what it prints, with command, commit, date and machine (bench/results.py).
    bench_results.main(main, "Reshard wall time")
