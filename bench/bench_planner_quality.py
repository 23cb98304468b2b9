"""Plan quality against DTensor's own redistribute planners, costed under our model.

    .venv/bin/python bench/bench_planner_quality.py [--pairs 600] [--seed 0]

For random layout pairs that DTensor can express (meshes up to 3-D and 64 ranks, uneven
shapes, partial sources), ask torch's redistribute planner for its transform sequence, both
its default greedy order and its graph planner (``use_min_cost_redistribution_plan``), in one
process on a fake process group. Each DTensor sequence is costed under our cost model, step
by step, and compared with our plan under two cost models: the default (every axis alike) and
a hierarchical one (axis 0 across nodes at 25 GB/s, the others at 300 GB/s).

Our plan must never cost more than either DTensor plan (asserted). The report gives the
our/DTensor total ratio, how often DTensor's plan costs more, the worst and best single
cases, and the cases where ours is cheaper with the reason.
"""

from __future__ import annotations

import argparse
import math
import random
from collections import Counter

import results as bench_results
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor import _redistribute as dtensor_redistribute
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.testing._internal.distributed.fake_pg import FakeStore

import planner
from shardlang import InteropError, Layout, Mesh
from shardlang.dtypes import itemsize as dtype_itemsize
from shardlang.interop import from_dtensor_placements, to_dtensor_placements

MESHES = [(8,), (3,), (64,), (2, 8), (4, 4), (2, 3), (8, 8), (2, 2, 2), (2, 4, 8), (4, 4, 4), (2, 2, 16), (3, 2, 4)]
LENGTHS = (1, 3, 7, 37, 64, 100, 1000, 1024, 4096, 11008, 50304)
WORLD = 64
TORCH_DTYPE = {"f32": torch.float32, "bf16": torch.bfloat16}
# The cost models plans are compared under, per mesh.
COST_MODELS = {
    "default (5 us, 100 GB/s every axis)": lambda mesh: planner.CostModel(),
    "hierarchical (axis 0 25 GB/s, others 300 GB/s)": lambda mesh: planner.CostModel(
        bandwidth=(25e9,) + (300e9,) * (mesh.ndim - 1)
    ),
}


def random_layout(rng: random.Random, mesh: Mesh, ndim: int, partial: bool) -> Layout:
    dims: list[list[int]] = [[] for _ in range(ndim)]
    pending = []
    op = rng.choice(("sum", "sum", "avg", "max", "min"))
    for axis in range(mesh.ndim):  # ascending, so nestings are in mesh-axis order as DTensor needs
        r = rng.random()
        if partial and r < 0.35:
            pending.append((axis, op if op in ("max", "min") else rng.choice(("sum", "avg"))))
        elif r < 0.6:
            dims[rng.randrange(ndim)].append(axis)
    return Layout(dims=dims, mesh=mesh, partial=pending)


def random_pairs(rng: random.Random, count: int) -> list[tuple[Layout, Layout, tuple[int, ...], str]]:
    pairs = []
    while len(pairs) < count:
        mesh = Mesh(rng.choice(MESHES))
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice(LENGTHS) for _ in range(ndim))
        src = random_layout(rng, mesh, ndim, partial=rng.random() < 0.6)
        dst = random_layout(rng, mesh, ndim, partial=False)
        if src != dst:
            pairs.append((src, dst, shape, rng.choice(("f32", "bf16"))))
    return pairs


# --- DTensor's plans ------------------------------------------------------------------------
_device_meshes: dict[tuple[int, ...], DeviceMesh] = {}


def device_mesh(shape: tuple[int, ...]) -> DeviceMesh:
    if shape not in _device_meshes:
        _device_meshes[shape] = init_device_mesh("cpu", shape)
    return _device_meshes[shape]


def dtensor_spec(layout: Layout, shape: tuple[int, ...], dtype: str) -> DTensorSpec:
    stride = torch.empty(shape, device="meta").stride()
    meta = TensorMeta(torch.Size(shape), stride, TORCH_DTYPE[dtype])
    return DTensorSpec(device_mesh(layout.mesh.shape), to_dtensor_placements(layout), tensor_meta=meta)


def dtensor_transforms(src: Layout, dst: Layout, shape: tuple[int, ...], dtype: str, graph: bool) -> list:
    """DTensor's (mesh axis, (from, to)) placement changes, planned cold."""
    dtensor_redistribute.clear_redistribute_planner_cache()
    infos = dtensor_redistribute._gen_transform_infos_non_cached(
        dtensor_spec(src, shape, dtype), dtensor_spec(dst, shape, dtype), use_graph_based_transform=graph
    )
    return [(info.mesh_dim, info.src_dst_placements) for info in infos]


# --- costing a sequence of placement changes under our model --------------------------------
def step_of(change, before: Layout) -> tuple[str, int | None, int | None]:
    """The op of our move set that a DTensor placement change is, with its dims."""
    _, (old, new) = change
    if isinstance(old, Shard) and isinstance(new, Replicate):
        return "all_gather", old.dim, None
    if isinstance(old, Shard) and isinstance(new, Shard):
        return "all_to_all", old.dim, new.dim
    if isinstance(old, Partial) and isinstance(new, Replicate):
        return "all_reduce", None, None
    if isinstance(old, Partial) and isinstance(new, Shard):
        return "reduce_scatter", new.dim, None
    if isinstance(old, Replicate) and isinstance(new, Shard):
        return "slice", new.dim, None
    raise ValueError(f"DTensor change {change} from {before} has no move in our move set")


def cost_steps(src: Layout, changes: list, shape: tuple[int, ...], dtype: str, cost: planner.CostModel):
    """(seconds, [(op, axis), ...]) of DTensor's changes under our model: each step costs what
    the issue's table gives for the local sizes before and after it."""
    alpha, bandwidth = cost.for_mesh(src.mesh)
    itemsize = dtype_itemsize(dtype)
    placements = list(to_dtensor_placements(src))
    layout, total, ops = src, 0.0, []
    for change in changes:
        axis, (_, new) = change
        op, dim, to_dim = step_of(change, layout)
        placements[axis] = new
        after = from_dtensor_placements(placements, len(shape), src.mesh)
        n = src.mesh.shape[axis]
        elements = math.prod(layout.local_shape(shape))
        if op == "all_gather":
            nbytes, rounds = (n - 1) * elements * itemsize, n - 1
        elif op == "reduce_scatter":
            nbytes, rounds = (n - 1) * math.prod(after.local_shape(shape)) * itemsize, n - 1
        elif op == "all_reduce":
            nbytes, rounds = 2 * (n - 1) * -(-elements // n) * itemsize, 2 * (n - 1)
        elif op == "all_to_all":
            length = layout.local_shape(shape)[to_dim]
            cut = elements // length * -(-length // n) if length else 0
            nbytes, rounds = (n - 1) * cut * itemsize, n - 1
        else:
            nbytes, rounds = 0, 0
        total += rounds * alpha[axis] + nbytes / bandwidth[axis]
        ops.append(label(op, axis, dim, to_dim))
        layout = after
    return total, ops


def label(op: str, axis: int, dim: int | None, to_dim: int | None) -> str:
    """``all_to_all(2: d0->d1)``: the op, its mesh axis and the tensor dims it touches."""
    dims = "" if dim is None else f": d{dim}" + ("" if to_dim is None else f"->d{to_dim}")
    return f"{op}({axis}{dims})"


def labels(plan: planner.Plan) -> list[str]:
    return [label(s.op, s.axis, s.dim, s.to_dim) for s in plan.steps]


def why_cheaper(ours: planner.Plan, theirs: list[str]) -> str:
    """A short reason for the saving, from the two step lists."""
    mine = labels(ours)
    ops_axes = sorted(label.split(":")[0].rstrip(")") for label in mine)
    their_ops_axes = sorted(label.split(":")[0].rstrip(")") for label in theirs)
    first_reduce = next((i for i, s in enumerate(ours.steps) if s.op in ("all_reduce", "reduce_scatter")), None)
    their_reduce = next((i for i, o in enumerate(theirs) if o.startswith(("all_reduce", "reduce_scatter"))), None)
    if (
        first_reduce is not None
        and their_reduce is not None
        and any(s.op == "slice" for s in ours.steps[:first_reduce])
        and not any(o.startswith("slice") for o in theirs[:their_reduce])
    ):
        return "slices before reducing, so the reduction moves a smaller tensor"
    if sorted(mine) == sorted(theirs):
        return "the same collectives in a cheaper order (each on a smaller piece)"
    if ops_axes == their_ops_axes:
        return "the same collectives along other tensor dims (less padding of uneven dims)"
    if any(o.startswith("reduce_scatter") for o in mine) and any(o.startswith("all_reduce") for o in theirs):
        return "reduce_scatter, later all_gather (hierarchical) instead of a flat all_reduce"
    if any(o.startswith("all_to_all") for o in mine) and not any(o.startswith("all_to_all") for o in theirs):
        return "all_to_all instead of all_gather then slice"
    touched = {s.axis for s in ours.steps if s.op == "slice"} & {s.axis for s in ours.steps if s.op == "all_gather"}
    their_axes = {int(label.split("(")[1].split(":")[0].rstrip(")")) for label in theirs}
    if touched - their_axes:
        return "slices an axis DTensor leaves alone, so a costly step moves a smaller tensor, then gathers it back"
    return "a different set of collectives"


def markdown(columns: list[str], rows: list[list[object]]) -> str:
    """A markdown table, pipes in cells escaped (bench/results.py reads it back)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=12, help="cheaper cases to list per comparison")
    args = parser.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    rng = random.Random(args.seed)
    pairs = random_pairs(rng, args.pairs)
    transforms = {
        name: [dtensor_transforms(src, dst, shape, dtype, graph) for src, dst, shape, dtype in pairs]
        for name, graph in (("greedy", False), ("graph", True))
    }
    summary, reasons, cases = [], [], []
    for model_name, model in COST_MODELS.items():
        for name, sequences in transforms.items():
            ours_total = theirs_total = 0.0
            rows = []
            for (src, dst, shape, dtype), changes in zip(pairs, sequences, strict=True):
                cost = model(src.mesh)
                ours = planner.plan(src, dst, shape, dtype, cost)
                theirs, their_ops = cost_steps(src, changes, shape, dtype, cost)
                assert ours.total_seconds <= theirs * (1 + 1e-9), (src, dst, shape, ours.total_seconds, theirs)
                if their_ops == labels(ours):  # the same steps: the costing must agree with ours
                    assert math.isclose(ours.total_seconds, theirs, rel_tol=1e-9), (src, dst, shape)
                ours_total += ours.total_seconds
                theirs_total += theirs
                rows.append((ours.total_seconds / theirs if theirs else 1.0, src, dst, shape, dtype, ours, their_ops))
            rows.sort(key=lambda r: r[0])
            cheaper = [r for r in rows if r[0] < 1 - 1e-9]
            summary.append([
                model_name, name, f"{ours_total / theirs_total:.4f}", f"{theirs_total / ours_total:.3f}",
                f"{len(cheaper)}/{len(rows)} ({100 * len(cheaper) / len(rows):.1f}%)",
                f"{rows[0][0]:.3f}", f"{rows[-1][0]:.3f}",
            ])  # fmt: skip
            for reason, count in Counter(why_cheaper(r[5], r[6]) for r in cheaper).most_common():
                reasons.append([model_name, name, reason, count])
            for ratio, src, dst, shape, dtype, ours, their_ops in cheaper[: args.show]:
                cases.append([
                    model_name, name, f"{ratio:.3f}", f"{src} -> {dst}", f"{'x'.join(map(str, shape))} {dtype}",
                    ", ".join(labels(ours)), ", ".join(their_ops), why_cheaper(ours, their_ops),
                ])  # fmt: skip
    print("Modeled time of our plans against DTensor's planners' (their steps costed under our model)\n")
    print(markdown(
        ["cost model", "DTensor planner", "ours / DTensor, total", "DTensor / ours, total", "DTensor costs more on",
         "best single case (ours / DTensor)", "worst"],
        summary,
    ))  # fmt: skip
    meshes = ", ".join(f"{list(shape)} {n}" for shape, n in sorted(Counter(p[0].mesh.shape for p in pairs).items()))
    print(
        f"\n{len(pairs)} random pairs DTensor can express (seed {args.seed}), "
        f"{sum(p[0].is_partial for p in pairs)} with partial sources; pairs per mesh: {meshes}."
    )
    print("\nWhy ours is cheaper, pairs per reason\n")
    print(markdown(["cost model", "DTensor planner", "reason", "pairs"], reasons))
    print(f"\nThe {args.show} cheapest cases per comparison (steps as op(mesh axis: tensor dims))\n")
    print(
        markdown(["cost model", "DTensor planner", "ours / DTensor", "pair", "shape", "ours", "DTensor", "why"], cases)
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        # --json PATH: also write its tables, with command, commit, date and machine (bench/results.py).
        bench_results.main(main, "Plan quality")
    except InteropError as e:  # a layout DTensor cannot express slipped through
        raise SystemExit(f"error: {e}") from None
