"""Planner speed: time per layout pair, cold (no memo), and whole-model planning.

    .venv/bin/python bench/bench_planner_speed.py [--pairs 300] [--repeat 3] [--seed 0] [--dtensor-pairs 60]

Random pairs on the meshes [8], [4,8], [4,4,4], [2,2,2,8] and the 5-D [2,2,2,2,4], tensors of
1-3 dims with uneven lengths, sources partial about half the time (all reduce ops), any
nesting order. Every pair is planned cold (the plan memo cleared first) ``--repeat`` times;
the best of those runs is the pair's time, which keeps other processes on a shared machine
out of the numbers (the first run alone is reported too). Tables that depend only on the mesh
and cost model stay cached between pairs, as in any process that plans more than one pair;
a third line clears those too ("nothing cached"). For the first pairs DTensor can
express, DTensor's graph planner (its Dijkstra) is timed once each (it takes seconds on 5-D
meshes), in this process on a fake process group, with its planner cache cleared first.

Last, the whole-spec planning of examples/llama7b_dp4_tp8.shard, cold.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path

import results as bench_results
import torch
import torch.distributed as dist
from bench_search_speed import random_layout  # one home for the random pairs' layouts
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import _redistribute as dtensor_redistribute
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.testing._internal.distributed.fake_pg import FakeStore

import planner
from planner import search
from planner.spec_plan import plan_spec
from planner.units import integer_rates
from shardlang import InteropError, Layout, Mesh, load_spec
from shardlang.interop import to_dtensor_placements

LENGTHS = (1, 3, 7, 16, 37, 64, 100, 1000, 4096, 50304)
OPS = ("sum", "sum", "avg", "max", "min")
REPO = Path(__file__).resolve().parent.parent


def random_pairs(rng: random.Random, mesh: Mesh, count: int) -> list[tuple[Layout, Layout, tuple[int, ...]]]:
    pairs = []
    while len(pairs) < count:
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice(LENGTHS) for _ in range(ndim))
        # An axis is partial a quarter of the time in a partial layout, split 55% of the time in any.
        src = random_layout(rng, mesh, ndim, partial=0.25 if rng.random() < 0.5 else 0.0, split=(0.45, 1.0), ops=OPS)
        dst = random_layout(rng, mesh, ndim, partial=0.25 if rng.random() < 0.2 else 0.0, split=(0.45, 1.0), ops=OPS)
        if src != dst:
            pairs.append((src, dst, shape))
    return pairs


def best_of(repeat: int, run) -> tuple[float, float]:
    """(first run, best run) in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times[0], min(times)


def ours_cold(src: Layout, dst: Layout, shape: tuple[int, ...]) -> None:
    """The pair was never planned: the plan memo is cleared. Tables that depend only on the
    mesh and the cost model (not on the pair) stay, as when a process plans many pairs."""
    search._plan_cached.cache_clear()
    planner.plan(src, dst, shape)


def ours_all_cold(src: Layout, dst: Layout, shape: tuple[int, ...]) -> None:
    """Nothing cached at all: the plan memo and the per-mesh tables (the cost model's integer
    scaling, the bound's rates) are cleared too, as for the first pair a process plans."""
    integer_rates.cache_clear()
    search._TABLES.clear()
    ours_cold(src, dst, shape)


def dtensor_specs(src: Layout, dst: Layout, shape: tuple[int, ...], device_mesh) -> tuple[DTensorSpec, DTensorSpec]:
    meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), torch.float32)
    return tuple(DTensorSpec(device_mesh, to_dtensor_placements(x), tensor_meta=meta) for x in (src, dst))


def dtensor_graph_cold(specs: tuple[DTensorSpec, DTensorSpec]) -> None:
    dtensor_redistribute.clear_redistribute_planner_cache()
    dtensor_redistribute._gen_transform_infos_non_cached(*specs, use_graph_based_transform=True)


def quantiles(times: list[float]) -> tuple[float, float]:
    """Median and p99, ms."""
    times = sorted(times)
    return statistics.median(times) * 1e3, times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3


def summary(times: list[float]) -> str:
    times = sorted(times)
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
    return f"median {statistics.median(times) * 1e3:8.3f} ms   p99 {p99 * 1e3:8.2f} ms   max {times[-1] * 1e3:8.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=300, help="pairs per mesh")
    parser.add_argument("--repeat", type=int, default=3, help="cold runs per pair (the best counts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--meshes", default="8;4,8;4,4,4;2,2,2,8;2,2,2,2,4", help="mesh shapes, ';'-separated")
    parser.add_argument("--dtensor-pairs", type=int, default=60, help="pairs per mesh to time DTensor on (0: none)")
    bench_results.add_json_option(parser)
    args = parser.parse_args()
    rows = []
    meshes = [tuple(int(n) for n in text.split(",")) for text in args.meshes.split(";")]
    if args.dtensor_pairs:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=max(math.prod(m) for m in meshes))
    print(f"{args.pairs} random pairs per mesh, seed {args.seed}, best of {args.repeat} cold runs per pair")
    for shape in meshes:
        mesh = Mesh(shape)
        pairs = random_pairs(random.Random(f"{args.seed}-{shape}"), mesh, args.pairs)
        first, best = zip(*(best_of(args.repeat, lambda p=p: ours_cold(*p)) for p in pairs), strict=True)
        print(f"\nmesh{list(shape)}: {len(pairs)} pairs")
        all_cold = [best_of(args.repeat, lambda p=p: ours_all_cold(*p))[1] for p in pairs]
        print(f"  ours, best of {args.repeat}:      {summary(list(best))}")
        print(f"  ours, first run:      {summary(list(first))}")
        print(f"  ours, nothing cached: {summary(all_cold)}")
        (median, p99), first_median = quantiles(list(best)), quantiles(list(first))[0]
        row = [f"{list(shape)}", len(pairs), f"{median:.3f}", f"{p99:.2f}", f"{first_median:.3f}"]
        row.append(f"{quantiles(all_cold)[0]:.3f}")
        rows.append([*row, "-", "-"])
        if not args.dtensor_pairs:
            continue
        device_mesh = init_device_mesh("cpu", shape)
        ours_same, theirs = [], []
        for p, our_time in zip(pairs, best, strict=True):
            try:
                specs = dtensor_specs(*p, device_mesh)
            except InteropError:
                continue  # a nesting order or mix of partial ops DTensor cannot express
            ours_same.append(our_time)
            theirs.append(best_of(1, lambda s=specs: dtensor_graph_cold(s))[1])  # slow: one run
            if len(theirs) == args.dtensor_pairs:
                break
        print(f"  on the first {len(theirs)} pairs DTensor can express (DTensor timed once each):")
        print(f"    ours:               {summary(ours_same)}")
        print(f"    DTensor graph:      {summary(theirs)}")
        if theirs:
            ours_median, (their_median, their_p99) = quantiles(ours_same)[0], quantiles(theirs)
            rows[-1][-2:] = [f"{ours_median:.3f} / {their_median:.3f} ({len(theirs)} pairs)", f"{their_p99:.2f}"]
        ratios = sorted(t / o for t, o in zip(theirs, ours_same, strict=True))
        print(f"    DTensor/ours per pair: median {statistics.median(ratios):.1f}x, min {ratios[0]:.2f}x")
    spec = load_spec(REPO / "examples" / "llama7b_dp4_tp8.shard")

    def whole_spec() -> None:
        search._plan_cached.cache_clear()
        integer_rates.cache_clear()
        search._TABLES.clear()
        plan_spec(spec)

    first, best = best_of(args.repeat, whole_spec)
    info = search._plan_cached.cache_info()
    print(
        f"\nwhole spec examples/llama7b_dp4_tp8.shard: {len(spec.tensors)} tensors, "
        f"{info.misses} distinct plans searched, {info.hits} memo hits: "
        f"cold {first * 1e3:.1f} ms (first run), {best * 1e3:.1f} ms (best of {args.repeat})"
    )
    if args.dtensor_pairs:
        dist.destroy_process_group()
    columns = [
        "mesh",
        "pairs",
        f"median ms (best of {args.repeat})",
        "p99 ms",
        "median ms, first run",
        "median ms, nothing cached",
        "pairs DTensor can express: ours / DTensor graph, median ms",
        "DTensor p99 ms",
    ]
    note = (
        f"Cold plans of random layout pairs (seed {args.seed}), tensors of 1-3 dims: the plan memo cleared "
        "before each pair; tables that depend only on the mesh and cost model stay cached, as in any process "
        "that plans more than one pair. DTensor's graph planner timed once per pair, its cache cleared."
    )
    spec_cells = [len(spec.tensors), info.misses, f"{first * 1e3:.1f}", f"{best * 1e3:.1f}"]
    spec_row = [["examples/llama7b_dp4_tp8.shard", *spec_cells]]
    spec_columns = ["spec", "tensors", "distinct searches", "cold ms, first run", f"cold ms, best of {args.repeat}"]
    tables = [
        bench_results.table("Planner speed per mesh", columns, rows, note),
        bench_results.table("Whole-spec planning, the step plan with its buckets", spec_columns, spec_row),
    ]
    bench_results.write(args.json, "Planner speed", tables)


if __name__ == "__main__":
    main()
