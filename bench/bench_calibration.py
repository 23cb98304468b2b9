"""Predicted against measured plan time, with the default cost model and a calibrated one.

    .venv/bin/python bench/bench_calibration.py                 # 4 gloo ranks, [4] and [2,2], 32 pairs each
    .venv/bin/python bench/bench_calibration.py --pairs 40 --reps 7 --json docs/benchmarks/data/calibration.json

On each mesh: first ``runtime.measure.calibrate.sweep`` and ``planner.fit`` (what ``shardlang calibrate``
runs) give the calibrated model; then random pairs (``runtime.measure.calibrate.sample_pairs``: f32 tensors
of 16 KB-16 MB, sources partial over some axes), plus ``R,R | P01 -> R,R`` on [2,2] at three
sizes, are planned under both models, and every distinct plan is timed by
``runtime.measure.calibrate.time_plans`` (reshard by the plan; median over repetitions of the slowest
rank, plans interleaved run by run). Per model: the Spearman rank correlation and the median
absolute relative error of its predicted time against the measured time of the plan it
chose; each calibrated model's choice margin (``planner.fit``); the calibrated model's error by
kind of plan (sends nothing, one step, more steps), which says where prediction and measurement
part; and, for the pairs where the two models choose
different plans, the measured time of each choice. Those two plans are then timed again, by
themselves, with three times the repetitions (``runtime.measure.calibrate.timed_runs``, interleaved run
by run), and a difference counts as measurable only if the Wilcoxon signed-rank test on the
runs' paired times (run ``k`` of both plans met the same load) gives p < 0.05: the verdict is
then faster or slower (by the ratio of the medians), else level. A run compares some ten such
pairs, so even were every pair level about one in twenty would get a verdict by chance; beside
each pair's own p-value the table gives it Holm-adjusted over all of the run's differing pairs
(one family: the verdict then says whether any choice of the run is measurably slower, at 5%
for the whole run), and the summary counts both. ``R,R | P01 -> R,R`` on
[2,2], at each of its three sizes, times both candidates whatever the models choose (the
hierarchical reduce_scatter, all_reduce, all_gather and the two all_reduces, and the calibrated
choice if it is neither) the same way, and says which is measured faster and whether the
calibrated model picked it (or a plan level with it).

Every rank runs one intra-op thread (``torch.set_num_threads(1)``), as ``torchrun`` starts
``shardlang calibrate``'s processes (``OMP_NUM_THREADS=1``): with two threads in each of 4
processes on 2 cores, a local copy or sum of more than 128 KiB (torch's parallel grain) took
4-27 ms here instead of 0.1-0.5, which made the sweep's 256 KiB samples and every plan's local
work a matter of scheduling.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attrs
import results as bench_results
import torch
from scipy.stats import wilcoxon

import planner
from planner.fit import fit_model, holm, median_relative_error, spearman
from runtime.measure.calibrate import known_breaks, sample_pairs, sweep, time_plans, timed_runs
from runtime.testing import run_ranks
from shardlang import Mesh, parse_layout

MESHES = ((4,), (2, 2))
CHUNK = 12  # plans timed together (their pieces are held at once)
RETIME = 3  # times the repetitions of a re-timed pair
LEVEL = 0.05  # the signed-rank test's p-value below which a difference is measurable
ALL_REDUCE = ("R,R | P01 over mesh[2,2]", "R,R over mesh[2,2]")
ALL_REDUCE_ROWS = (64, 1024, 4096)  # of 1024 f32 columns: 256 KiB, 4 MiB, 16 MiB


def _pairs(mesh: Mesh, count: int, seed: int) -> list[tuple]:
    pairs = sample_pairs(mesh, count, random.Random(seed), 16 * 2**10, 16 * 2**20)
    if mesh.shape == (2, 2):
        src, dst = map(parse_layout, ALL_REDUCE)
        pairs += [(src, dst, (rows, 1024)) for rows in ALL_REDUCE_ROWS]
    return pairs


def _candidates(shape: tuple[int, ...], calibrated: planner.CostModel) -> tuple[list[planner.Plan], int]:
    """``R,R | P01 -> R,R`` of ``shape``: the hierarchical plan (the default model's), the two
    all-reduces (a model whose per-step overhead outweighs the bytes the third step saves), and
    the calibrated model's choice if it is neither; and which of them that choice is."""
    src, dst = map(parse_layout, ALL_REDUCE)
    hierarchical = planner.plan(src, dst, shape, "f32")
    two = planner.plan(src, dst, shape, "f32", planner.CostModel(overhead=1.0))
    ops = [[s.op for s in p.steps] for p in (hierarchical, two)]
    if ops != [["reduce_scatter", "all_reduce", "all_gather"], ["all_reduce", "all_reduce"]]:
        raise AssertionError(f"unexpected candidates {ops}")
    tuned = planner.plan(src, dst, shape, "f32", calibrated)
    steps = [_steps(hierarchical), _steps(two)]
    if _steps(tuned) in steps:
        return [hierarchical, two], steps.index(_steps(tuned))
    return [hierarchical, two, tuned], 2


def _steps(plan: planner.Plan) -> tuple[str, ...]:
    """What a plan does (two models' plans of the same steps differ only in their predictions)."""
    return tuple(s.describe() for s in plan.steps)


def _compare(tuned: list[float], other: list[float]) -> tuple[float, float, str]:
    """The ratio of the medians of two plans' paired runs, the two-sided Wilcoxon signed-rank
    test's p-value, and the verdict on the first: faster or slower where p < :data:`LEVEL`, else
    level."""
    ratio = statistics.median(tuned) / statistics.median(other)
    p = float(wilcoxon(tuned, other).pvalue)
    return ratio, p, _verdict(ratio, p)


def _verdict(ratio: float, p: float) -> str:
    return "level" if p >= LEVEL else "faster" if ratio < 1 else "slower"


def _rank(rank: int, world: int, count: int, reps: int, budget: float) -> dict[str, list[dict]]:
    torch.set_num_threads(1)  # as torchrun starts each process (module docstring)
    rows, candidates, swept = [], [], []
    for seed, shape in enumerate(MESHES):
        mesh = Mesh(shape)
        started = time.perf_counter()
        samples = sweep(mesh, budget=budget)
        swept.append({"mesh": list(shape), "samples": [attrs.astuple(s) for s in samples]})
        calibrated, _ = fit_model(samples, known_breaks(mesh))
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
        differ = dict.fromkeys(pair for pair in chosen if _steps(pair[0]) != _steps(pair[1]))
        retimed = {pair: timed_runs(pair, RETIME * reps) for pair in differ}
        for default, tuned in chosen:
            again = retimed.get((default, tuned), [[], []])
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
                    "default_runs": again[0],
                    "calibrated_runs": again[1],
                    "model": calibrated.to_json(),
                }
            )
        if shape == (2, 2):
            for length in ALL_REDUCE_ROWS:
                plans, picked = _candidates((length, 1024), calibrated)
                runs = timed_runs(plans, RETIME * reps)
                steps = [[s.describe() for s in p.steps] for p in plans]
                candidates.append({"shape": [length, 1024], "plans": steps, "runs": runs, "calibrated": picked})
            if rank == 0:
                print("  timed the R,R | P01 -> R,R candidates", file=sys.stderr, flush=True)
    return {"pairs": rows, "all_reduce": candidates, "sweeps": swept}


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
    bench_results.add_json_option(parser)  # the tables, and every row and the sweeps' samples as data
    args = parser.parse_args()
    result = run_ranks(_rank, 4, (args.pairs, args.reps, args.budget), timeout=3600, collective_timeout=600)[0]
    with bench_results.printed() as shown:
        _report(result, args.reps)
    tables = bench_results.markdown_tables(shown.getvalue())
    bench_results.write(args.json, "Calibration", tables, data=result)


def _report(result: dict, reps: int) -> None:
    """The tables of a run (``result`` as ``--json`` keeps it under ``data``)."""
    rows = result["pairs"]
    print(f"4 gloo ranks, {len(rows)} pairs, median of {reps} runs of the slowest rank")
    print("| mesh | pairs | model | Spearman | median abs rel error |")
    print("|---|---|---|---|---|")
    for shape in [*MESHES, None]:
        chosen = [r for r in rows if shape is None or tuple(r["mesh"]) == shape]
        label = "both" if shape is None else str(list(shape))
        for which in ("default", "calibrated"):
            rho, error = _scores(chosen, which)
            print(f"| {label} | {len(chosen)} | {which} | {rho:.3f} | {error:.1%} |")
    margins = [next(r["model"].get("margin", 0.0) for r in rows if tuple(r["mesh"]) == shape) for shape in MESHES]
    print("choice margin: " + ", ".join(f"{list(m)} {v * 1e3:.3g} ms" for m, v in zip(MESHES, margins, strict=True)))
    print()
    print("\n".join(_by_kind(rows)))
    differ = [r for r in rows if r["default_steps"] != r["calibrated_steps"]]
    print(
        f"\n{len(differ)} pairs where the models choose different plans: median ms over {reps} runs, "
        f"then the two re-timed over {RETIME * reps} paired runs (Wilcoxon signed-rank, p < {LEVEL})"
    )
    print(
        "| mesh | pair | shape | default plan | calibrated plan | ms | re-timed ms | ratio | p | verdict "
        "| Holm p | verdict, run as one family |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    compared = [_compare(r["calibrated_runs"], r["default_runs"]) for r in differ]
    adjusted = holm([p for _, p, _ in compared])
    family = [_verdict(ratio, q) for (ratio, _, _), q in zip(compared, adjusted, strict=True)]
    for r, (ratio, p, verdict), q, whole in zip(differ, compared, adjusted, family, strict=True):
        again = [statistics.median(r[f"{w}_runs"]) * 1e3 for w in ("default", "calibrated")]
        pair = r["pair"].replace("|", "\\|")  # a cell of a markdown table
        print(
            f"| {r['mesh']} | {pair} | {'x'.join(map(str, r['shape']))} | {'; '.join(r['default_steps'])} | "
            f"{'; '.join(r['calibrated_steps'])} | {r['default_measured'] * 1e3:.2f} / "
            f"{r['calibrated_measured'] * 1e3:.2f} | {again[0]:.2f} / {again[1]:.2f} | {ratio:.2f} | {p:.3g} | "
            f"{verdict} | {q:.3g} | {whole} |"
        )
    verdicts = [v for _, _, v in compared]
    kinds = ("faster", "level", "slower")
    print("calibrated choice: " + ", ".join(f"{verdicts.count(v)} {v}" for v in kinds), end="")
    print("; the run as one family (Holm): " + ", ".join(f"{family.count(v)} {v}" for v in kinds))
    print(f"\n{ALL_REDUCE[0]} -> {ALL_REDUCE[1]}: every candidate, {RETIME * reps} paired runs (median ms)")
    print("| shape | hierarchical | two all_reduces | calibrated's own | faster | calibrated picks | p | verdict |")
    print("|---|---|---|---|---|---|---|---|")
    for c in result["all_reduce"]:
        medians = [statistics.median(r) * 1e3 for r in c["runs"]]
        fastest = min(range(len(medians)), key=medians.__getitem__)
        picked = c["calibrated"]
        test, verdict = "-", "the faster"
        if picked != fastest:
            _, p, verdict = _compare(c["runs"][picked], c["runs"][fastest])
            test = f"{p:.3g}"
        own = f"{medians[2]:.2f} ({'; '.join(c['plans'][2])})" if len(medians) > 2 else "-"
        print(
            f"| {'x'.join(map(str, c['shape']))} | {medians[0]:.2f} | {medians[1]:.2f} | {own} | "
            f"{_name(fastest)} | {_name(picked)} | {test} | {verdict} |"
        )


def _name(candidate: int) -> str:
    return ("hierarchical", "two all_reduces", "calibrated's own")[candidate]


if __name__ == "__main__":
    main()
