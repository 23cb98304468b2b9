"""Raw collectives on gloo: why the runtime's reduce_scatter is an all_to_all plus a local sum,
and its all_gather point-to-point messages.

    .venv/bin/python bench/bench_collectives.py                   # 4 ranks, 256 KiB .. 16 MiB, f32
    .venv/bin/python bench/bench_collectives.py --ranks 2 --reps 30
    .venv/bin/python bench/bench_collectives.py --json docs/benchmarks/data/collectives.json   # for the docs

For each buffer size (the whole buffer a rank passes in, ``B``), the median over repetitions of
rank 0's time (ranks aligned by a barrier before each) for:

* ``all_reduce`` of ``B``;
* gloo's own ``reduce_scatter_tensor`` of ``B`` into ``B/n``;
* ``all_to_all_single`` of ``B`` followed by the sum of the ``n`` received blocks (what
  ``runtime.comm.collectives.collective`` runs for a reduce_scatter on gloo);
* gloo's own ``all_gather_into_tensor`` of ``B/n`` into ``B``;
* the same all_gather as ``runtime.comm.collectives.collective`` runs it on gloo: every rank's block sent to
  every peer at once, and received straight into its row of the result.

All ways are interleaved repetition by repetition, so that noise hits them alike.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import results as bench_results
import torch
import torch.distributed as dist

from runtime.comm.collectives import all_gather_single, collective, reduce_scatter_single
from runtime.testing import run_ranks

WAYS = ("all_reduce", "reduce_scatter (gloo)", "all_to_all + sum", "all_gather (gloo)", "all_gather as messages")
TIMEOUT = datetime.timedelta(minutes=5)


def _one(way: str, x: torch.Tensor, part: torch.Tensor, full: torch.Tensor, n: int) -> None:
    if way == "all_reduce":
        dist.all_reduce(x)
    elif way == "reduce_scatter (gloo)":
        reduce_scatter_single(part, x)
    elif way == "all_to_all + sum":
        dist.all_to_all_single(full, x)
        torch.sum(full.view(n, -1), 0, out=part)
    elif way == "all_gather (gloo)":
        all_gather_single(full, part)
    else:
        collective("all_gather", part, n, None, dist.group.WORLD, TIMEOUT, out=full)


def _rank(rank: int, world: int, sizes: list[int], reps: int) -> dict[int, dict[str, float]]:
    out = {}
    for size in sizes:
        numel = size // 4 // world * world
        x, part, full = torch.ones(numel), torch.empty(numel // world), torch.empty(numel)
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for _ in range(reps):
            for way in WAYS:
                dist.barrier()
                started = time.perf_counter()
                _one(way, x, part, full, world)
                times[way].append(time.perf_counter() - started)
        out[size] = {way: statistics.median(t[2:]) for way, t in times.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--sizes", default="256KiB,1MiB,4MiB,16MiB")
    bench_results.add_json_option(parser)
    args = parser.parse_args()
    units = {"KiB": 2**10, "MiB": 2**20}
    sizes = [int(s[:-3]) * units[s[-3:]] for s in args.sizes.split(",")]
    results = run_ranks(_rank, args.ranks, args=(sizes, args.reps), timeout=600)[0]
    title = f"gloo, {args.ranks} ranks, median ms of rank 0 over {args.reps - 2} repetitions"
    columns = ["buffer", *WAYS, "reduce_scatter / (all_to_all + sum)", "all_gather / messages"]
    rows = []
    for size, row in results.items():
        scatter = row["reduce_scatter (gloo)"] / row["all_to_all + sum"]
        gather = row["all_gather (gloo)"] / row["all_gather as messages"]
        times = [f"{row[w] * 1e3:.2f}" for w in WAYS]
        rows.append([f"{size // 1024} KiB", *times, f"{scatter:.2f}x", f"{gather:.2f}x"])
    print(title)
    print("| " + " | ".join(columns) + " |")
    print("|---|" + "---|" * (len(columns) - 1))
    for cells in rows:
        print("| " + " | ".join(cells) + " |")
    raw = {str(size): {w: seconds for w, seconds in row.items()} for size, row in results.items()}
    bench_results.write(args.json, "Collectives on gloo", [bench_results.table(title, columns, rows)], data=raw)


if __name__ == "__main__":
    main()
