"""Profile one optimizer step and save its trace for ``shardlang timeline`` (docs/stacks/profiler.md).

    torchrun --standalone --nproc-per-node 2 examples/profile_step.py --trace trace.rank{rank}.json
        [--bucket-bytes 32MiB] [--overlap] [--costs hints.json] [--steps 3]

A small MLP trained data-parallel with ZeRO-2 (ShardedAdamW: gradients reduce-scattered into
the states' halves, parameters all-gathered back). Its last step runs under torch.profiler and
every rank saves its trace with the optimizer's step plan (``runtime.stacks.profiler``); the
plan's seconds are the cost model's, the calibrated one of ``--costs`` (``shardlang
calibrate -o``) or the default.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import shardlang
from planner import CostModel
from runtime.optim import ShardedAdamW
from runtime.stacks.profiler import save_trace

SPEC = """
mesh world = [dp=2]
rule "*.weight" {
  param = R,R over world
  grad  = R,R | P(dp):avg over world
  state = S(dp),R over world
}
rule "*.bias" {
  param = R over world
  grad  = R | P(dp):avg over world
  state = S(dp) over world
}
"""
WIDTH, LAYERS = 256, 4


def size(text: str) -> int:
    """``65536``, ``64KiB`` or ``32MiB``."""
    for suffix, factor in (("KiB", 2**10), ("MiB", 2**20)):
        if text.endswith(suffix):
            return int(text.removesuffix(suffix)) * factor
    return int(text)


def profile_step(
    trace: str, bucket_bytes: int | None = None, costs: str | None = None, steps: int = 3, overlap: bool = False
) -> tuple[torch.profiler.profile, ShardedAdamW]:
    """Train ``steps`` steps on the initialized group, the last under torch.profiler, and save
    its trace to ``trace`` (``{rank}``: every rank its own)."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()) for _ in range(LAYERS)]
    model = torch.nn.Sequential(*layers)
    optimizer = ShardedAdamW(
        model.named_parameters(),
        shardlang.parse_spec(SPEC),
        lr=1e-3,
        bucket_bytes=bucket_bytes,
        overlap=overlap,
        cost=CostModel.from_file(costs) if costs else None,
    )
    generator = torch.Generator().manual_seed(dist.get_rank())  # each rank its own micro-batch

    def train_step() -> None:
        model(torch.randn(32, WIDTH, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(steps - 1):  # the first plans and compiles: the profiled step is a steady one
        train_step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        train_step()
    written = save_trace(profile, optimizer, trace)
    print(f"rank {dist.get_rank()}: trace {written}")
    return profile, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True, help="where each rank saves its trace; {rank} is its rank")
    parser.add_argument("--bucket-bytes", type=size, default=None, help="the optimizer's bucket_bytes")
    parser.add_argument("--overlap", action="store_true", help="start the buckets before the update during backward")
    parser.add_argument("--costs", help="a hints file of `shardlang calibrate -o`: the planned seconds' cost model")
    parser.add_argument("--steps", type=int, default=3, help="steps in all (at least 2); the last is profiled")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    profile_step(args.trace, args.bucket_bytes, args.costs, args.steps, args.overlap)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
