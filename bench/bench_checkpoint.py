"""Our checkpoints against torch.distributed.checkpoint (DCP), on 4 gloo ranks.

    .venv/bin/python bench/bench_checkpoint.py             # a [4096, 4096] f32 tensor, 3 runs
    .venv/bin/python bench/bench_checkpoint.py --n 2048 --reps 5

The tensor is saved as row pieces (``S0,R over mesh[4]`` / ``Shard(0)``) and loaded as column
pieces (``R,S0 over mesh[4]`` / ``Shard(1)``), by both libraries in the same run, interleaved.
Per rank: wall time of save and load, and the bytes the process read while loading, counted by
the OS (``/proc/self/io`` rchar), independent of both libraries. Every load is checked against
the columns of the full tensor. Medians over ranks and runs.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import results as bench_results
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from runtime import checkpoint
from runtime.testing import run_ranks
from shardlang import parse_layout

WORLD = 4
MEASURES = ("save ours (s)", "save DCP (s)", "load ours (s)", "load DCP (s)", "read ours (MiB)", "read DCP (MiB)")


def bytes_read() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar"))


def timed(fn, *args, **kwargs) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """(seconds, bytes read) of one collective call, all ranks starting together."""
    dist.barrier()
    read, started = bytes_read(), time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - started, bytes_read() - read


def one_rank(rank: int, world_size: int, n: int, reps: int, root: Path) -> list[tuple[float, ...]]:
    full = torch.arange(n * n, dtype=torch.float32).reshape(n, n)
    rows, cols = parse_layout(f"S0,R over mesh[{WORLD}]"), parse_layout(f"R,S0 over mesh[{WORLD}]")
    mesh = init_device_mesh("cpu", (WORLD,))
    piece = full.chunk(WORLD, dim=0)[rank].clone()
    expected = full.chunk(WORLD, dim=1)[rank]
    runs = []
    for rep in range(reps):
        ours, theirs = root / f"ours{rep}", root / f"dcp{rep}"
        save_ours, _ = timed(checkpoint.save, ours, {"w": checkpoint.LocalPiece(piece, rows, (n, n))})
        save_dcp, _ = timed(dcp.save, {"w": DTensor.from_local(piece, mesh, [Shard(0)])}, checkpoint_id=str(theirs))
        target = torch.empty(n, n // WORLD)
        load_ours, read_ours = timed(checkpoint.load, ours, {"w": checkpoint.LocalPiece(target, cols, (n, n))})
        assert torch.equal(target, expected)
        loaded = DTensor.from_local(torch.empty(n, n // WORLD), mesh, [Shard(1)])
        load_dcp, read_dcp = timed(dcp.load, {"w": loaded}, checkpoint_id=str(theirs))
        assert torch.equal(loaded.to_local(), expected)
        runs.append((save_ours, save_dcp, load_ours, load_dcp, read_ours / 2**20, read_dcp / 2**20))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096, help="the tensor is [n, n] f32 (n divisible by 4)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="shardlang-bench-ckpt-"))
    try:
        per_rank = run_ranks(one_rank, WORLD, (args.n, args.reps, root), timeout=900)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = [statistics.median(run[i] for runs in per_rank for run in runs) for i in range(len(MEASURES))]
    print(f"[{args.n},{args.n}] f32 ({args.n * args.n * 4 / 2**20:.0f} MiB): saved as rows, loaded as columns, "
          f"{WORLD} gloo ranks, {args.reps} runs; medians over ranks and runs")  # fmt: skip
    print()
    print("| measure | ours | DCP | ours / DCP |")
    print("|---|---|---|---|")
    for what, ours, theirs in (
        ("save s", *median[0:2]),
        ("load s", *median[2:4]),
        ("read while loading MiB", *median[4:6]),
    ):
        print(f"| {what} | {ours:.3f} | {theirs:.3f} | {ours / theirs:.2f} |")


if __name__ == "__main__":
    # --json PATH: also write its table, with command, commit, date and machine (bench/results.py).
    bench_results.main(main, "Checkpoints")
