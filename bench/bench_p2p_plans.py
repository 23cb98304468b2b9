"""Point-to-point plan quality: bytes against the receive lower bound, modeled time against the
collective-only plan and DTensor's planners.

    .venv/bin/python bench/bench_p2p_plans.py [--same 300] [--cross 300] [--seed 0]

Random pairs: same-mesh pairs DTensor can express (the generator of
``bench_planner_quality.py``: meshes up to 3-D and 64 ranks, uneven shapes, partial sources),
planned with ``point_to_point=True``; and cross-mesh pairs (two meshes of up to 64 ranks each,
all within 64 global ranks: disjoint, overlapping, or the same ranks in another order or shape).

Reported: for non-partial sources, the bytes the plan makes a rank receive over the receive
lower bound (goal 1.00), for the point-to-point step alone and for the whole plan; the modeled
time of the chosen plan over the collective-only plan (same mesh) and over DTensor's greedy and
graph planners costed under our model (``bench_planner_quality.cost_steps``); for cross-mesh
pairs, the chosen plan over the plain one-step point-to-point plan; planning time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_planner_quality as quality  # the DTensor helpers, shared
import results as bench_results

import planner
from planner import cheapest, search
from planner.messages import step_messages
from shardlang import Layout, Mesh

WORLD = 64


def random_mesh(rng: random.Random, shape: tuple[int, ...], avoid: tuple[int, ...]) -> Mesh:
    """A mesh of ``shape`` on ranks within WORLD: disjoint from ``avoid`` where room allows,
    else overlapping it; in order or shuffled."""
    size = Mesh(shape).size
    free = [r for r in range(WORLD) if r not in avoid]
    if len(free) >= size and rng.random() < 0.6:
        start = rng.randrange(len(free) - size + 1)
        ranks = free[start : start + size]
    else:
        ranks = rng.sample(range(WORLD), size)
    if rng.random() < 0.5:
        ranks = sorted(ranks)
    return Mesh(shape, ranks)


def cross_pairs(rng: random.Random, count: int) -> list[tuple[Layout, Layout, tuple[int, ...], str]]:
    pairs = []
    while len(pairs) < count:
        src_mesh = random_mesh(rng, rng.choice(quality.MESHES), ())
        dst_mesh = random_mesh(rng, rng.choice(quality.MESHES), src_mesh.ranks)
        if dst_mesh.shape == src_mesh.shape and dst_mesh.ranks == src_mesh.ranks:
            continue
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice(quality.LENGTHS) for _ in range(ndim))
        src = quality.random_layout(rng, src_mesh, ndim, partial=rng.random() < 0.4)
        dst = quality.random_layout(rng, dst_mesh, ndim, partial=rng.random() < 0.15)
        pairs.append((src, dst, shape, rng.choice(("f32", "bf16"))))
    return pairs


def received(plan: planner.Plan) -> int:
    """The most bytes a rank receives over the plan: each collective step's modeled bytes (a
    rank receives what it sends in them) plus the point-to-point step's largest receive."""
    return sum(
        step_messages(step, plan.dtype).most_received if step.op == "point_to_point" else step.bytes
        for step in plan.steps
    )


def describe(values: list[float]) -> list[str]:
    """Cells: pairs, mean, worst, and how many are exactly 1.00 (the bound met)."""
    if not values:
        return ["0", "-", "-", "-"]
    exact = sum(abs(v - 1) < 1e-12 for v in values)
    return [
        str(len(values)),
        f"{statistics.fmean(values):.4f}",
        f"{max(values):.3f}",
        f"{exact}/{len(values)} ({100 * exact / len(values):.1f}%)",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--same", type=int, default=300)
    parser.add_argument("--cross", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=4, help="cheapest cases to list against the collective plan")
    args = parser.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=quality.WORLD)
    rng = random.Random(args.seed)
    same = quality.random_pairs(rng, args.same)
    cross = cross_pairs(rng, args.cross)
    timings: list[float] = []

    def chosen_plan(src, dst, shape, dtype, cost=None):
        cheapest._cheapest.cache_clear()
        search._plan_cached.cache_clear()
        start = time.perf_counter()
        p = planner.plan(src, dst, shape, dtype, cost, point_to_point=True)
        timings.append(time.perf_counter() - start)
        return p

    # --- bytes against the receive lower bound -------------------------------------------
    step_ratio, plan_ratio, total_ratio, large_ratio, kinds = [], [], [], [], Counter()
    for src, dst, shape, dtype in same + cross:
        p = chosen_plan(src, dst, shape, dtype)
        ops = [s.op for s in p.steps]
        kinds["point-to-point only" if ops == ["point_to_point"] else
              "mixed" if "point_to_point" in ops else "collectives only"] += 1  # fmt: skip
        bound = p.lower_bound_bytes
        if src.is_partial or not bound:
            continue
        direct = planner.point_to_point_plan(src, Layout(dims=dst.dims, mesh=dst.mesh), shape, dtype)
        step_ratio.append(received(direct) / bound)
        plan_ratio.append(received(p) / bound)
        total_ratio.append(p.total_bytes / bound)
        if bound >= 1 << 20:
            large_ratio.append(received(p) / bound)
    print(
        f"{len(same)} same-mesh pairs (DTensor can express them; {sum(p[0].is_partial for p in same)} partial "
        f"sources), {len(cross)} cross-mesh pairs ({sum(p[0].is_partial for p in cross)} partial); seed {args.seed}"
    )
    print("\nBytes received by the busiest rank over the receive lower bound (non-partial sources, bound > 0)\n")
    print(
        quality.markdown(
            ["plan", "pairs", "mean", "worst", "exactly 1.00"],
            [
                ["the point-to-point step alone", *describe(step_ratio)],
                ["the chosen plan", *describe(plan_ratio)],
                ["the chosen plan, bound >= 1 MiB (bandwidth-bound)", *describe(large_ratio)],
            ],
        )
    )
    print(
        f"\nChosen plans: {', '.join(f'{k} {v}' for k, v in kinds.items())}. The chosen plan's total_bytes "
        f"(per-step max of sent or received, summed) over the bound: mean {statistics.fmean(total_ratio):.3f}."
    )

    # --- modeled time: same mesh --------------------------------------------------------------
    transforms = {
        name: [quality.dtensor_transforms(src, dst, shape, dtype, graph) for src, dst, shape, dtype in same]
        for name, graph in (("greedy", False), ("graph", True))
    }
    summary, best_cases = [], []
    for model_name, model in quality.COST_MODELS.items():
        ours_total = collective_total = 0.0
        cheaper, ratios = 0, []
        ours_times = []
        for src, dst, shape, dtype in same:
            cost = model(src.mesh)
            ours = chosen_plan(src, dst, shape, dtype, cost)
            collective = planner.plan(src, dst, shape, dtype, cost)
            assert ours.total_seconds <= collective.total_seconds * (1 + 1e-9), (src, dst, shape)
            ours_total += ours.total_seconds
            collective_total += collective.total_seconds
            ours_times.append(ours.total_seconds)
            ratio = ours.total_seconds / collective.total_seconds if collective.total_seconds else 1.0
            ratios.append((ratio, src, dst, shape, ours, collective))
            cheaper += ratio < 1 - 1e-9
        positive = [r[0] for r in ratios if r[0] > 0]
        row = [
            model_name,
            f"{collective_total / ours_total:.3f}",
            f"{1 / statistics.geometric_mean(positive):.3f} ({len(positive)})",
            f"{cheaper}/{len(same)} ({100 * cheaper / len(same):.1f}%)",
            f"{min(ratios, key=lambda r: r[0])[0]:.3f}",
        ]
        for ratio, src, dst, shape, ours, collective in sorted(ratios, key=lambda r: r[0])[: args.show]:
            best_cases.append([
                model_name, f"{ratio:.3f}", f"{src} -> {dst}", "x".join(map(str, shape)),
                ", ".join(s.describe() for s in ours.steps), ", ".join(s.describe() for s in collective.steps),
            ])  # fmt: skip
        for sequences in transforms.values():
            theirs_total, more = 0.0, 0
            for (src, dst, shape, dtype), changes, ours in zip(same, sequences, ours_times, strict=True):
                theirs, _ = quality.cost_steps(src, changes, shape, dtype, model(src.mesh))
                assert ours <= theirs * (1 + 1e-9), (src, dst, shape)
                theirs_total += theirs
                more += theirs > ours * (1 + 1e-9)
            row += [f"{theirs_total / ours_total:.3f}", f"{more}/{len(same)} ({100 * more / len(same):.1f}%)"]
        summary.append(row)
    print("\nSame mesh, modeled time: the collective-only plan and DTensor's planners over the chosen plan\n")
    print(
        quality.markdown(
            [
                "cost model", "collective-only / chosen, total", "geometric mean per pair (pairs)",
                "chosen cheaper on", "best single case", "DTensor greedy / chosen, total", "greedy costs more on",
                "DTensor graph / chosen, total", "graph costs more on",
            ],
            summary,
        )
    )  # fmt: skip
    print("\nThe geometric mean leaves out the pairs whose chosen plan only copies locally (it costs 0).")
    print(f"\nSame mesh, the {args.show} cheapest cases against the collective-only plan, per cost model\n")
    print(quality.markdown(["cost model", "chosen / collective", "pair", "shape", "chosen", "collective"], best_cases))

    # --- modeled time: cross mesh ------------------------------------------------------------
    gains, total_direct, total_chosen = [], 0.0, 0.0
    for src, dst, shape, dtype in cross:
        if src.is_partial or dst.is_partial:
            continue
        p = chosen_plan(src, dst, shape, dtype)
        direct = planner.point_to_point_plan(src, dst, shape, dtype)
        total_chosen += p.total_seconds
        total_direct += direct.total_seconds
        gains.append(direct.total_seconds / p.total_seconds if p.total_seconds else 1.0)
    better = sum(g > 1 + 1e-9 for g in gains)
    print("\nCross mesh, default cost model: one point-to-point step over the chosen plan\n")
    print(
        quality.markdown(
            ["non-partial pairs", "one step / chosen, total", "a mix cheaper on", "best"],
            [[len(gains), f"{total_direct / total_chosen:.3f}", f"{better} ({100 * better / len(gains):.1f}%)",
              f"{max(gains):.2f}"]],
        )
    )  # fmt: skip
    print("\nDTensor cannot plan across meshes (NotImplementedError).")

    timings.sort()
    print("\nPlanning time, cold (the plan caches cleared before each plan)\n")
    print(
        quality.markdown(
            ["plans", "median ms", "p99 ms", "max ms"],
            [[len(timings), f"{1e3 * statistics.median(timings):.2f}",
              f"{1e3 * timings[int(0.99 * (len(timings) - 1))]:.1f}", f"{1e3 * timings[-1]:.1f}"]],
        )
    )  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    # --json PATH: also write its tables, with command, commit, date and machine (bench/results.py).
    bench_results.main(main, "Point-to-point plan quality")
