"""A profiled step drawn by ``shardlang timeline`` (2 gloo ranks): examples/profile_step.py
trains and saves every rank's trace (``runtime.stacks.profiler.save_trace``); each rank's
picture has one planned and one measured bar per bucket of its step plan, named after the
bucket as torch.profiler's own events name it, the measured bar from the start range's
beginning to the wait range's end of those events, the planned one the plan's seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cli.main import main
from runtime.testing import run_ranks
from tests.stack_support import example
from tests.test_timeline import RANGE, drawn_bars


def _run(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    profile, optimizer = example("profile_step.py").profile_step(
        f"{folder}/trace.rank{{rank}}.json", bucket_bytes=64 * 1024, steps=2
    )
    events = [
        (e.name, e.time_range.start, e.time_range.end) for e in profile.events() if e.name.startswith("shardlang ")
    ]
    plan = optimizer.step_plan()
    return {"events": events, "planned": [(b.stage, b.seconds) for b in plan.buckets]}


@pytest.mark.slow
def test_each_ranks_timeline_has_the_profilers_ranges_and_the_plans_seconds(tmp_path: Path) -> None:
    results = run_ranks(_run, 2, (str(tmp_path),), timeout=180)
    for rank, got in enumerate(results):
        svg = tmp_path / f"rank{rank}.svg"
        assert main(["timeline", str(tmp_path / f"trace.rank{rank}.json"), "-o", str(svg)]) == 0
        assert f"rank {rank} of 2" in svg.read_text(encoding="utf-8")
        ranges: dict[tuple[str, str], tuple[float, float]] = {}
        for name, start, end in got["events"]:
            m = RANGE.fullmatch(name)
            if m is None:  # the step's other stages (docs/stacks/profiler.md, the table)
                continue
            assert (m[3], m[2]) not in ranges, f"{name} twice in one profiled step"
            ranges[(m[3], m[2])] = (start, end)
        names = sorted({n for n, _ in ranges}, key=lambda n: int(n.split()[1]))
        drawn = drawn_bars(svg)
        assert len(got["planned"]) >= 8 and len(drawn) == len(got["planned"]) == len(names)
        for bar, name, (stage, seconds) in zip(drawn, names, got["planned"], strict=True):
            assert (bar["name"], bar["stage"]) == (name, stage)
            assert bar["planned"] == pytest.approx(seconds, rel=1e-8)
            (start, _), (wait, end) = ranges[(name, "start")], ranges[(name, "wait")]
            assert bar["measured"] == pytest.approx((end - start) / 1e6, abs=2e-6), name  # microseconds
            assert bar["wait"] == pytest.approx((end - wait) / 1e6, abs=2e-6), name
