"""A profiled optimizer step: ``torch.profiler``'s trace holds one named range per bucket for
its start and one for its wait, in each stage, named after the bucket (2 gloo ranks)."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest
import torch

from runtime.testing import run_ranks
from shardlang import parse_layout
from shardlang.spec import Layouts

SHAPES = {f"w{i}": (32, 16) for i in range(6)} | {"b": (16,)}


def _run(rank: int, world_size: int) -> dict[str, Any]:
    from runtime.optim import ShardedAdamW

    spec = {}
    for name, shape in SHAPES.items():
        dims = ",".join("R" for _ in shape)
        spec[name] = Layouts(
            param=parse_layout(f"{dims} over mesh[dp=2]"),
            grad=parse_layout(f"{dims} | P(dp):avg over mesh[dp=2]"),
            states=(("", parse_layout(f"{','.join(['S(dp)', *('R' for _ in shape[1:])])} over mesh[dp=2]")),),
        )
    params = {n: torch.nn.Parameter(torch.ones(s)) for n, s in SHAPES.items()}
    optimizer = ShardedAdamW(list(params.items()), spec, bucket_bytes=4096)
    for p in params.values():
        p.grad = torch.full(p.shape, 0.5)
    optimizer.step()  # plans and compiles: the profiled step is a steady one
    for p in params.values():
        p.grad = torch.full(p.shape, 0.25)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        optimizer.step()
    plan = optimizer.step_plan()
    return {
        "names": [e.name for e in profile.events() if e.name.startswith("shardlang ")],
        "buckets": [(b.stage, b.describe()) for b in plan.buckets],
    }


@pytest.mark.slow
def test_a_profiled_step_names_every_bucket_start_and_wait() -> None:
    for got in run_ranks(_run, 2, timeout=120):
        names, buckets = got["names"], got["buckets"]
        assert len(buckets) >= 4, buckets  # several buckets before the update and after it
        counts = Counter(names)
        for index, (stage, described) in enumerate(buckets, start=1):
            for what in ("start", "wait"):
                wanted = [n for n in counts if n.startswith(f"shardlang {stage}: {what} bucket {index} of ")]
                assert len(wanted) == 1 and counts[wanted[0]] == 1, (stage, what, index, names)
                assert described in wanted[0], (described, wanted[0])
        shape = re.compile(r"shardlang (before|after) the update: (start|wait) bucket \d+ of \d+ \(")
        assert all(shape.match(n) for n in names), names
        assert len(names) == 2 * len(buckets), names
