"""Predicted against measured plan time, with the default cost model and a calibrated one.

    .venv/bin/python bench/bench_calibration.py                 # 4 gloo ranks, [4] and [2,2], 32 pairs each
    .venv/bin/python bench/bench_calibration.py --pairs 40 --reps 7 --json out/calibration.json

On each mesh: first ``runtime.calibrate.sweep`` and ``planner.fit`` (what ``shardlang calibrate``
runs) give the calibrated model; then random pairs (``runtime.calibrate.sample_pairs``: f32 tensors
of 16 KB-16 MB, sources partial over some axes), plus ``R,R | P01 -> R,R`` on [2,2] at three
sizes, are planned under both models, and every distinct plan is timed by
``runtime.calibrate.time_plans`` (reshard by the plan; median over repetitions of the slowest
rank, plans interleaved run by run). Per model: the Spearman rank correlation and the median
absolute relative error of its predicted time against the measured time of the plan it
chose; the calibrated model's error by kind of plan (sends nothing, one step, more steps), which
says where prediction and measurement part; and, for the pairs where the two models choose
different plans, the measured time of each choice.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import planner
from planner.fit import fit_model, median_relative_error, spearman
from runtime.calibrate import sample_pairs, sweep, time_plans
from runtime.testing import run_ranks
from shardlang import Mesh, parse_layout

MESHES = ((4,), (2, 2))
CHUNK = 12  # plans timed together (their pieces are held at once)


def _pairs(mesh: Mesh, count: int, seed: int) -> list[tuple]:
    pairs = sample_pairs(mesh, count, random.Random(seed), 16 * 2**10, 16 * 2**20)
    if mesh.shape == (2, 2):
        src, dst = parse_layout("R,R | P01 over mesh[2,2]"), parse_layout("R,R over mesh[2,2]")
        pairs += [(src, dst, (rows, 1024)) for rows in (64, 1024, 4096)]  # 256 KiB, 4 MiB, 16 MiB
    return pairs


def _rank(rank: int, world: int, count: int, reps: int, budget: float) -> list[dict]:
    rows = []
    for seed, shape in enumerate(MESHES):
        mesh = Mesh(shape)
        started = time.perf_counter()
        calibrated, _ = fit_model(sweep(mesh, budget=budget))
        if rank == 0:
            print(f"mesh {list(shape)}: calibrated in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        pairs = _pairs(mesh, count, seed)
        chosen = [
            (planner.plan(src, dst, shp, "f32"), planner.plan(src, dst, shp, "f32", calibrated))
            for src, dst, shp in pairs
        ]
        distinct = list(dict.fromkeys(p for pair in chosen for p in pair))
        measured: dict[planner.Plan, float] = {}
        for start in range(0, len(distinct), CHUNK):
            part = distinct[start : start + CHUNK]
            measured.update(zip(part, time_plans(part, reps=reps), strict=True))
            if rank == 0:
                print(f"  timed {len(measured)}/{len(distinct)} plans", file=sys.stderr, flush=True)
        for default, tuned in chosen:
            rows.append(
                {
                    "mesh": list(shape),
                    "pair": f"{default.src} -> {default.dst}",
                    "shape": list(default.shape),
                    "default_steps": [s.describe() for s in default.steps],
                    "calibrated_steps": [s.describe() for s in tuned.steps],
                    "default_predicted": default.total_seconds,
                    "default_measured": measured[default],
                    "calibrated_predicted": tuned.total_seconds,
                    "calibrated_measured": measured[tuned],
                    "model": calibrated.to_json(),
                }
            )
    return rows


def _scores(rows: list[dict], which: str) -> tuple[float, float]:
    predicted = [r[f"{which}_predicted"] for r in rows]
    measured = [r[f"{which}_measured"] for r in rows]
    return spearman(predicted, measured), median_relative_error(predicted, measured)


def _kind(steps: list[str]) -> str:
    if all(s.startswith(("slice", "partial")) for s in steps):
        return "sends nothing"
    return "one step" if len(steps) == 1 else "two or more steps"


def _by_kind(rows: list[dict]) -> list[str]:
    """The calibrated model's error and median predicted / measured per kind of plan."""
    out = ["| calibrated plans | pairs | median abs rel error | median predicted / measured |", "|---|---|---|---|"]
    for kind in ("sends nothing", "one step", "two or more steps"):
        chosen = [r for r in rows if _kind(r["calibrated_steps"]) == kind]
        if chosen:
            predicted = [r["calibrated_predicted"] for r in chosen]
            measured = [r["calibrated_measured"] for r in chosen]
            ratio = statistics.median(p / m for p, m in zip(predicted, measured, strict=True))
            error = median_relative_error(predicted, measured)
            out.append(f"| {kind} | {len(chosen)} | {error:.1%} | {ratio:.2f} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=32, help="random pairs per mesh")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--budget", type=float, default=40.0, help="seconds of calibration sweep per mesh")
    parser.add_argument("--json", help="also write every row here")
    args = parser.parse_args()
    rows = run_ranks(_rank, 4, (args.pairs, args.reps, args.budget), timeout=3600, collective_timeout=600)[0]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"4 gloo ranks, {len(rows)} pairs, median of {args.reps} runs of the slowest rank")
    print("| mesh | pairs | model | Spearman | median abs rel error |")
    print("|---|---|---|---|---|")
    for shape in [*MESHES, None]:
        chosen = [r for r in rows if shape is None or tuple(r["mesh"]) == shape]
        label = "both" if shape is None else str(list(shape))
        for which in ("default", "calibrated"):
            rho, error = _scores(chosen, which)
            print(f"| {label} | {len(chosen)} | {which} | {rho:.3f} | {error:.1%} |")
    print()
    print("\n".join(_by_kind(rows)))
    differ = [r for r in rows if r["default_steps"] != r["calibrated_steps"]]
    print(f"\n{len(differ)} pairs where the models choose different plans (measured ms):")
    print("| mesh | pair | shape | default plan | ms | calibrated plan | ms | calibrated/default |")
    print("|---|---|---|---|---|---|---|---|")
    for r in differ:
        print(
            f"| {r['mesh']} | {r['pair']} | {'x'.join(map(str, r['shape']))} | {'; '.join(r['default_steps'])} | "
            f"{r['default_measured'] * 1e3:.2f} | {'; '.join(r['calibrated_steps'])} | "
            f"{r['calibrated_measured'] * 1e3:.2f} | {r['calibrated_measured'] / r['default_measured']:.2f} |"
        )


if __name__ == "__main__":
    main()
