"""The calibration sweep at dense sizes: where a kind's time departs from one line.

    .venv/bin/python bench/bench_calibration_sweep.py                       # [4], 256 KiB .. 16 MiB, 8 sizes an octave
    .venv/bin/python bench/bench_calibration_sweep.py --per-octave 4 --repeat 3 --json data/sweep.json

``--repeat`` times runs ``runtime.measure.calibrate.sweep`` (what ``shardlang calibrate`` measures: each
kind by a plan of one step through ``runtime.reshard``, the kinds interleaved repetition by
repetition, the slowest rank's time, medians of two passes) on 4 gloo ranks of one intra-op
thread each, at sizes (the larger local buffer) from 256 KiB to 16 MiB, ``--per-octave`` an
octave, without a time budget. Beside it, per size, ``dist.all_reduce`` of that buffer alone (no
executor: no copy of the caller's piece), interleaved likewise. Prints, per kind, the median
seconds at each size over the sweeps, and its relative residual off the relative least-squares
line (``planner.fit.fit_line``) through all sizes: where the residuals run in one sign over
several neighbouring sizes the kind is not one line there (docs/calibration.md, "The dense
sweep").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import results as bench_results
import torch
import torch.distributed as dist

from planner.fit import fit_line
from runtime.measure.calibrate import sweep
from runtime.testing import run_ranks
from shardlang import Mesh

MESH = (4,)
RAW = "all_reduce (raw)"


def _raw_all_reduce(sizes: list[int], reps: int) -> dict[int, float]:
    """Per size, the slowest rank's median time of ``dist.all_reduce`` of a buffer of it."""
    out = {}
    for size in sizes:
        x = torch.ones(size // 4)
        dist.all_reduce(x)  # warm-up
        times = torch.zeros(reps)
        for rep in range(reps):
            dist.barrier()
            begun = time.perf_counter()
            dist.all_reduce(x)
            times[rep] = time.perf_counter() - begun
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        out[size] = statistics.median(times.tolist())
    return out


def _rank(rank: int, world: int, sizes: list[int], repeat: int, reps: int) -> list[dict]:
    torch.set_num_threads(1)
    mesh = Mesh(MESH)
    runs = []
    for _ in range(repeat):
        samples = sweep(mesh, sizes=sizes, reps=reps, budget=1e9)
        raw = _raw_all_reduce(sizes, 2 * reps)
        runs.append(
            {
                "samples": [[s.op, s.axis, s.rounds, s.bytes, s.seconds, s.copied] for s in samples],
                "raw": {str(k): v for k, v in raw.items()},
            }
        )
    return runs


def _residuals(xs: list[float], ts: list[float]) -> list[float]:
    """Relative residuals off the fitted line."""
    line = fit_line(xs, ts)
    return [(line.intercept + line.slope * x - t) / t for x, t in zip(xs, ts, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-octave", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2, help="sweeps, one after the other")
    parser.add_argument("--reps", type=int, default=7, help="per pass, as the calibration")
    bench_results.add_json_option(parser)  # the tables, and every sample as data
    args = parser.parse_args()
    sizes = [round(2**18 * 2 ** (k / args.per_octave)) // 4096 * 4096 for k in range(6 * args.per_octave + 1)]
    started = time.perf_counter()
    runs = run_ranks(_rank, 4, (sizes, args.repeat, args.reps), timeout=3600, collective_timeout=600)[0]
    with bench_results.printed() as shown:
        print(f"{args.repeat} sweeps of {len(sizes)} sizes in {time.perf_counter() - started:.0f} s")
        _report(runs)
    tables = bench_results.markdown_tables(shown.getvalue())
    bench_results.write(args.json, "Calibration sweep", tables, data={"sizes": sizes, "runs": runs})


def _report(runs: list[dict]) -> None:
    """Per kind, the median time at each size and its residual off one line."""
    kinds = ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "point_to_point", "slice"]
    for kind in [*kinds, RAW]:
        per_run = []
        for run in runs:
            if kind == RAW:  # the table's bytes of an all_reduce of the buffer: 2 (n-1) / n of it
                per_run.append([(2 * (MESH[0] - 1) * (int(s) // 4 // MESH[0]) * 4, t) for s, t in run["raw"].items()])
            else:
                per_run.append([(s[3], s[4]) for s in run["samples"] if s[0] == kind])
        xs = [x for x, _ in per_run[0]]
        ts = [statistics.median(r[i][1] for r in per_run) for i in range(len(xs))]
        one = _residuals(xs, ts)
        print(f"\n{kind}")
        print("| table KiB | " + " | ".join(f"run {k + 1} ms" for k in range(len(runs))) + " | median | one line |")
        print("|" + "---|" * (len(runs) + 3))
        for i, x in enumerate(xs):
            cells = " | ".join(f"{r[i][1] * 1e3:.2f}" for r in per_run)
            print(f"| {x / 1024:.0f} | {cells} | {ts[i] * 1e3:.2f} | {one[i]:+.0%} |")


if __name__ == "__main__":
    main()
