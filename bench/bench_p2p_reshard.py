"""Point-to-point reshards against collective plans and DTensor.redistribute, on 4 and 8 gloo ranks.

    .venv/bin/python bench/bench_p2p_reshard.py                  # 16 and 64 MB, 7 runs each
    .venv/bin/python bench/bench_p2p_reshard.py --sizes 4 --reps 5 --worlds 4

For each pair and global tensor size (f32, [rows, 1024]) on one spawn of gloo ranks per world
size, up to three ways run the same resharding, interleaved run by run so machine noise hits
all alike:

* ``p2p``: ``runtime.reshard`` with the planner's point-to-point plan
  (``planner.point_to_point_plan``: one ``batch_isend_irecv`` step, each target rank receiving
  exactly what it lacks);
* ``coll``: ``runtime.reshard`` with the collective-only plan (``planner.plan``'s default on
  one mesh);
* ``dtensor``: ``DTensor.redistribute`` from the same pieces on a DeviceMesh of the same grid,
  where DTensor can express both layouts (not ``S10``, axis 1 outer, and never across meshes:
  ``torch/distributed/tensor/_redistribute.py`` raises ``NotImplementedError("Cross device mesh
  comm not supported yet!")``).

Time is the median over runs of the slowest rank. Bytes are the most any rank sent
(``runtime.recording``; the point-to-point plan's prediction is checked against them), next to
the receive lower bound; every result is compared with the target piece of the full tensor.
"""

from __future__ import annotations

import argparse
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
from runtime import recording, reshard, shard
from runtime.testing import run_ranks
from shardlang import InteropError, parse_layout
from shardlang.interop import to_dtensor_placements

PAIRS = {
    4: [
        ("swap", "S0,S1 over mesh[2,2]", "S1,S0 over mesh[2,2]"),
        ("rows -> columns", "S0,R over mesh[4]", "R,S0 over mesh[4]"),
        ("permutation", "S01,R over mesh[2,2]", "S10,R over mesh[2,2]"),
    ],
    8: [
        ("swap", "S0,S1 over mesh[2,4]", "S1,S0 over mesh[2,4]"),
        ("rows -> columns", "S0,R over mesh[8]", "R,S0 over mesh[8]"),
        ("permutation", "S01,R over mesh[2,4]", "S10,R over mesh[2,4]"),
        ("cross-mesh", "S0,S1 over mesh[2,2]", "S0,R over mesh[4] ranks 4..7"),
    ],
}
COLUMNS = 1024
_device_meshes: dict[tuple[int, ...], object] = {}


def _measure(rank: int, name: str, src_text: str, dst_text: str, megabytes: int, reps: int) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    src, dst = parse_layout(src_text), parse_layout(dst_text)
    shape = (megabytes * 2**20 // (4 * COLUMNS), COLUMNS)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    local = shard(full, src, rank) if rank in src.mesh.ranks else None
    p2p = planner.point_to_point_plan(src, dst, shape, "f32")
    one_mesh = src.mesh.same_geometry(dst.mesh)
    methods: dict[str, Callable[[], torch.Tensor | None]] = {
        "p2p": lambda: reshard(local, src, dst, global_shape=shape, plan=p2p, dtype="f32")
    }
    if one_mesh:
        collective = planner.plan(src, dst, shape, "f32")
        methods["coll"] = lambda: reshard(local, src, dst, global_shape=shape, plan=collective)
        try:
            placements = to_dtensor_placements(src), to_dtensor_placements(dst)
        except InteropError:
            placements = None
        if placements is not None:
            device_mesh = _device_meshes.setdefault(src.mesh.shape, init_device_mesh("cpu", src.mesh.shape))
            dtensor = DTensor.from_local(
                local, device_mesh, placements[0], run_check=False, shape=shape, stride=(COLUMNS, 1)
            )

            def redistribute() -> torch.Tensor:
                out = dtensor.redistribute(device_mesh, placements[1]).to_local()
                return out.wait() if hasattr(out, "wait") else out

            methods["dtensor"] = redistribute
    in_union = rank in src.mesh.ranks or rank in dst.mesh.ranks
    expected = shard(full, dst, rank) if rank in dst.mesh.ranks else None
    agree, sent = True, {}
    for method, call in methods.items():  # warm-up: groups, plans, caches; check the result
        with recording() as log:
            out = call() if in_union else None
        sent[method] = log.total_bytes
        if expected is not None:
            agree &= bool(torch.equal(out, expected))
    names = list(methods)
    times: dict[str, list[float]] = {method: [] for method in names}
    for rep in range(reps):
        for method in names[rep % len(names) :] + names[: rep % len(names)]:
            dist.barrier()
            started = time.perf_counter()
            out = methods[method]() if in_union else None
            times[method].append(time.perf_counter() - started)
            del out
    # The slowest rank per run, the most bytes any rank sent, and agreement everywhere.
    packed = torch.tensor(
        [*(t for m in names for t in times[m]), *(float(sent[m]) for m in names), float(not agree)],
        dtype=torch.float64,
    )
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    values = packed.tolist()
    row: dict[str, object] = {"name": name, "pair": f"{src} -> {dst}", "mb": megabytes, "agree": values[-1] == 0.0}
    for i, method in enumerate(names):
        row[f"{method}_ms"] = statistics.median(values[i * reps : (i + 1) * reps]) * 1e3
        row[f"{method}_bytes"] = int(values[len(names) * reps + i])
    row["p2p_planned"] = p2p.total_bytes
    row["lower_bound"] = p2p.lower_bound_bytes
    if one_mesh:
        row["coll_planned"] = collective.total_bytes
    return row


def _bench_rank(rank: int, world_size: int, sizes: list[int], reps: int) -> list[dict[str, object]]:
    return [_measure(rank, *pair, mb, reps) for pair in PAIRS[world_size] for mb in sizes]


HEADER = (
    "ranks", "case", "pair", "MB", "p2p ms", "coll ms", "DTensor ms", "p2p / coll", "p2p / DTensor",
    "sent MB p2p / coll", "bound MB", "agree",
)  # fmt: skip


def _row(world: int, r: dict[str, object]) -> str:
    """One markdown row (the pair's pipes escaped, so the table keeps its cells)."""

    def ms(key: str) -> str:
        return f"{r[key]:.2f}" if key in r else ("n/a" if key == "dtensor_ms" else "-")

    ratio_coll = f"{r['p2p_ms'] / r['coll_ms']:.2f}" if "coll_ms" in r else "-"
    ratio_dt = f"{r['p2p_ms'] / r['dtensor_ms']:.2f}" if "dtensor_ms" in r else "n/a"
    sent = " / ".join(f"{r[k] / 2**20:.2f}" if k in r else "-" for k in ("p2p_bytes", "coll_bytes"))
    cells = [
        world, r["name"], str(r["pair"]).replace("|", "\\|"), r["mb"], ms("p2p_ms"), ms("coll_ms"), ms("dtensor_ms"),
        ratio_coll, ratio_dt, sent, f"{r['lower_bound'] / 2**20:.2f}", r["agree"],
    ]  # fmt: skip
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16,64", help="global tensor sizes in MB (f32)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--worlds", default="4,8", help="gloo world sizes to run (4 and/or 8)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"Point-to-point reshard against collectives and DTensor, f32, median of {args.reps} runs")
    print()
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for world in (int(w) for w in args.worlds.split(",")):
        rows = run_ranks(_bench_rank, world, (sizes, args.reps), timeout=3600, collective_timeout=600)[0]
        for r in rows:
            # The plan's bytes are the largest max(sent, received): no rank sends more.
            assert r["p2p_bytes"] <= r["p2p_planned"], f"{r['pair']}: sent {r['p2p_bytes']} > {r['p2p_planned']}"
            print(_row(world, r), flush=True)


if __name__ == "__main__":
    # --json PATH: also write its table, with command, commit, date and machine (bench/results.py).
    bench_results.main(main, "Point-to-point reshard wall time")
