"""``shardlang timeline``: one profiled step's buckets, planned against measured, as an SVG.

The traces are those stored for docs/stacks/profiler.md (written by examples/profile_step.py
through ``runtime.stacks.profiler.save_trace``); the bars are checked against the trace's
ranges and the step plan's seconds as read here from the raw JSON, and the pictures on the page
against what the page's commands draw."""

from __future__ import annotations

import json
import re
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from cli.main import main
from tests.conftest import REPO

PAGE = REPO / "docs" / "stacks" / "profiler.md"
TRACES = sorted((REPO / "docs" / "stacks" / "profiler").glob("zero2_*.json"))
SVG = "{http://www.w3.org/2000/svg}"
RANGE = re.compile(r"shardlang (.+?): (start|wait) (bucket (\d+) of (\d+) \(.*\))")


def expected_bars(trace: dict[str, Any], step: int = -1) -> list[dict[str, Any]]:
    """Per bucket, from the raw trace: its name, stage, planned seconds (the stored plan's) and
    measured seconds (its start range's beginning to its wait range's end) in step ``step``."""
    seen: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for event in sorted(trace["traceEvents"], key=lambda e: e.get("ts", 0)):
        m = RANGE.fullmatch(event.get("name", ""))
        if m and event.get("ph") == "X":
            seen.setdefault((m[3], m[2]), []).append({"stage": m[1], "index": int(m[4]), **event})
    planned = trace["shardlang"]["step_plan"]["buckets"]
    bars = []
    for name in sorted({name for name, _ in seen}, key=lambda n: int(n.split()[1])):
        start, wait = seen[(name, "start")][step], seen[(name, "wait")][step]
        bars.append(
            {
                "name": name,
                "stage": start["stage"],
                "planned": planned[start["index"] - 1]["seconds"],
                "measured": (wait["ts"] - start["ts"] + wait["dur"])
                / 1e6,  # microseconds since the epoch: subtract first
                "wait": wait["dur"] / 1e6,
            }
        )
    return bars


def drawn_bars(svg: Path) -> list[dict[str, Any]]:
    root = ET.parse(svg).getroot()
    bars = []
    for group in root.iter(f"{SVG}g"):
        if group.get("class") != "bucket":
            continue
        planned = [r for r in group.iter(f"{SVG}rect") if r.get("class") == "planned"]
        measured = [g for g in group.iter(f"{SVG}g") if g.get("class") == "measured"]
        assert len(planned) == 1 and len(measured) == 1, group.get("id")
        wait = [r for r in measured[0].iter(f"{SVG}rect") if r.get("class") == "wait"]
        bars.append(
            {
                "name": group.find(f"{SVG}title").text,
                "stage": group.get("data-stage"),
                "planned": float(planned[0].get("data-seconds")),
                "measured": float(measured[0].get("data-seconds")),
                "wait": float(wait[0].get("data-seconds")),
                "id": group.get("id"),
            }
        )
    return bars


def assert_bars(svg: Path, expected: list[dict[str, Any]]) -> None:
    drawn = drawn_bars(svg)
    assert [b["id"] for b in drawn] == [f"bucket-{i}" for i in range(1, len(expected) + 1)]
    assert [(b["name"], b["stage"]) for b in drawn] == [(b["name"], b["stage"]) for b in expected]
    for got, want in zip(drawn, expected, strict=True):
        for key in ("planned", "measured", "wait"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (got["name"], key)


def test_the_stored_traces_are_drawn_with_one_planned_and_one_measured_bar_per_bucket(tmp_path: Path) -> None:
    assert len(TRACES) == 3, TRACES
    for trace_path in TRACES:
        out = tmp_path / f"{trace_path.stem}.svg"
        assert main(["timeline", str(trace_path), "-o", str(out)]) == 0
        trace = json.loads(trace_path.read_text(encoding="utf-8"))
        expected = expected_bars(trace)
        assert len(expected) == len(trace["shardlang"]["step_plan"]["buckets"]) >= 2
        assert_bars(out, expected)


def expected_others(trace: dict[str, Any]) -> dict[str, tuple[int, float]]:
    """Per row of the step's other ranges, from the raw trace (one profiled step): how many
    ranges and their seconds; a gradient's hook and a layer's write are a row each of its kind."""
    rows: dict[str, tuple[int, float]] = {}
    for event in trace["traceEvents"]:
        name = event.get("name", "")
        if event.get("ph") != "X" or not name.startswith("shardlang ") or RANGE.fullmatch(name):
            continue
        where, what = name.removeprefix("shardlang ").split(": ", 1)
        what = {"hook": "gradient hooks", "write": "parameter writes"}.get(what.split()[0], what)
        count, seconds = rows.get(f"{where}: {what}", (0, 0.0))
        rows[f"{where}: {what}"] = (count + 1, seconds + event["dur"] / 1e6)
    return rows


def drawn_others(svg: Path) -> dict[str, tuple[int, float]]:
    rows = {}
    for group in ET.parse(svg).getroot().iter(f"{SVG}g"):
        if group.get("class") == "stage":
            ranges = [r for r in group.iter(f"{SVG}rect") if r.get("class") == "range"]
            assert float(group.get("data-seconds")) == pytest.approx(sum(float(r.get("data-seconds")) for r in ranges))
            rows[group.find(f"{SVG}title").text] = (len(ranges), float(group.get("data-seconds")))
    return rows


def test_the_stored_traces_draw_the_steps_other_ranges_a_row_each(tmp_path: Path) -> None:
    """The math, the flags, the overlap agreement and backward's hooks, as the raw traces hold
    them (docs/stacks/profiler.md, the table)."""
    rows = {}
    for trace_path in TRACES:
        out = tmp_path / f"{trace_path.stem}.svg"
        assert main(["timeline", str(trace_path), "-o", str(out)]) == 0
        expected = expected_others(json.loads(trace_path.read_text(encoding="utf-8")))
        drawn = rows[trace_path.stem] = drawn_others(out)
        assert drawn.keys() == expected.keys(), trace_path.name
        for name, (count, seconds) in expected.items():
            assert drawn[name][0] == count and drawn[name][1] == pytest.approx(seconds, rel=1e-6), name
    for drawn in rows.values():
        assert {"commit: flag 1 of 2", "the update: ShardedAdamW math", "commit: flag 2 of 2"} <= drawn.keys()
    overlap = rows["zero2_64KiB_overlap"]
    assert overlap["backward: gradient hooks"][0] == 8 and "before the update: overlap agreement" in overlap
    assert "backward: gradient hooks" not in rows["zero2_64KiB"]


def test_the_pages_pictures_are_what_its_commands_draw(tmp_path: Path) -> None:
    """Generated, not drawn by hand: every ``shardlang timeline`` line of the page, run again on
    the stored trace, gives the stored SVG byte for byte, and the page shows that SVG."""
    text = PAGE.read_text(encoding="utf-8")
    commands = [shlex.split(line) for line in text.splitlines() if line.startswith("shardlang timeline ")]
    assert len(commands) == len(TRACES)
    for argv in commands:
        trace, output = argv[2], argv[argv.index("-o") + 1]
        assert (REPO / trace).is_file()
        out = tmp_path / Path(output).name
        assert main(["timeline", str(REPO / trace), *argv[3:-1], str(out)]) == 0
        assert out.read_bytes() == (REPO / output).read_bytes(), f"{output} is not what `{' '.join(argv)}` draws"
        assert f"]({Path(output).relative_to('docs/stacks')})" in text, f"the page does not show {output}"
        traced = [line for line in text.splitlines() if line.startswith("torchrun") and f"--trace {trace}" in line]
        assert traced and "examples/profile_step.py" in traced[0], f"no command on the page writes {trace}"


def test_smaller_buckets_plan_and_take_more_time() -> None:
    """What the page says of the two stored runs: more buckets, more planned and measured time."""
    runs = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in TRACES}
    big, small = expected_bars(runs["zero2_32MiB"]), expected_bars(runs["zero2_64KiB"])
    assert len(big) == 2 and len(small) == 16
    assert sum(b["planned"] for b in small) > sum(b["planned"] for b in big)
    assert sum(b["measured"] for b in small) > sum(b["measured"] for b in big)


def test_with_overlap_the_buckets_before_the_update_start_during_backward() -> None:
    """What the page says of the overlap run, from the raw trace: every bucket before the update
    starts before optimizer.step()'s range, in the reverse order of the layers."""
    trace = json.loads((REPO / "docs" / "stacks" / "profiler" / "zero2_64KiB_overlap.json").read_text(encoding="utf-8"))
    step = next(e for e in trace["traceEvents"] if e.get("name", "").startswith("Optimizer.step#"))
    events = sorted(trace["traceEvents"], key=lambda e: e.get("ts", 0))
    starts = [e for e in events if (m := RANGE.fullmatch(e.get("name", ""))) and m[2] == "start"]
    before = [e for e in starts if e["name"].startswith("shardlang before the update")]
    assert len(before) == 8 and all(e["ts"] + e["dur"] <= step["ts"] for e in before)
    assert all(e["ts"] >= step["ts"] for e in starts if e["name"].startswith("shardlang after the update"))
    assert "'3.0.bias'" in before[0]["name"] and "'0.0.weight'" in before[-1]["name"]
    waits = {e["name"].replace(": wait ", ": start "): e for e in events if " wait bucket " in e.get("name", "")}
    in_flight = sum(waits[e["name"]]["ts"] - e["ts"] - e["dur"] for e in before)
    assert in_flight > sum(waits[e["name"]]["dur"] + e["dur"] for e in before)  # most of their time


def _stored(tmp_path: Path, change: Any = None) -> Path:
    trace = json.loads(TRACES[0].read_text(encoding="utf-8"))
    if change is not None:
        change(trace)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace), encoding="utf-8")
    return path


def _twice(trace: dict[str, Any]) -> None:
    """The step's bucket ranges again, a second later: a trace of two profiled steps."""
    again = [
        e | {"ts": e["ts"] + 1e6, "dur": e["dur"] * 2}
        for e in trace["traceEvents"]
        if RANGE.fullmatch(e.get("name", ""))
    ]
    trace["traceEvents"] += again


def test_step_picks_one_of_several_profiled_steps(tmp_path: Path) -> None:
    path = _stored(tmp_path, _twice)
    trace = json.loads(path.read_text(encoding="utf-8"))
    for step, index in ((None, -1), (1, 0), (2, 1)):
        out = tmp_path / f"{step}.svg"
        assert main(["timeline", str(path), "-o", str(out), *(["--step", str(step)] if step else [])]) == 0
        assert_bars(out, expected_bars(trace, index))
    assert drawn_bars(tmp_path / "1.svg") != drawn_bars(tmp_path / "2.svg")


@pytest.mark.parametrize(
    ("change", "args", "said"),
    [
        (
            lambda t: t.pop("shardlang"),
            [],
            "holds no step plan: save the profile with runtime.stacks.profiler.save_trace",
        ),
        (
            lambda t: t["shardlang"]["step_plan"]["buckets"].pop(),
            [],
            "the trace's step has 2 buckets and its step plan 1",
        ),
        (
            lambda t: t["shardlang"]["step_plan"]["buckets"].reverse(),
            [],
            "bucket 1 is 'before the update: reduce_scatter",
        ),
        (None, ["--step", "2"], "holds 1 profiled step; --step 2 is not one of them"),
        (
            lambda t: [e.pop("dur") for e in t["traceEvents"] if " wait bucket 1 " in e.get("name", "")],
            [],
            "'0.0.bias', '1.0.weight' and 5 more)' has no numeric ts and dur",
        ),
        (
            lambda t: t.update(
                traceEvents=[e for e in t["traceEvents"] if not e.get("name", "").startswith("shardlang")]
            ),
            [],
            "holds no shardlang bucket ranges",
        ),
        (
            lambda t: t.update(traceEvents=[e for e in t["traceEvents"] if " wait bucket 2 " not in e.get("name", "")]),
            [],
            "do not make whole steps (bucket 1 start x1, bucket 1 wait x1, bucket 2 start x1, bucket 2 wait x0)",
        ),
    ],
)
def test_a_trace_that_does_not_fit_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: Any, args: list[str], said: str
) -> None:
    path = _stored(tmp_path, change)
    assert main(["timeline", str(path), "-o", str(tmp_path / "x.svg"), *args]) == 1
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err
    assert not (tmp_path / "x.svg").exists()


def test_save_trace_takes_a_sharded_optimizer_only(tmp_path: Path) -> None:
    import torch

    from runtime.optim import OptimizerError
    from runtime.stacks.profiler import save_trace

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(OptimizerError, match="save_trace needs a sharded optimizer, got AdamW"):
        save_trace(None, optimizer, tmp_path / "trace.json")  # type: ignore[arg-type]
    assert not (tmp_path / "trace.json").exists()


def test_a_file_that_is_no_trace_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    assert main(["timeline", str(tmp_path / "bad.json")]) == 1
    assert "bad.json is not a JSON trace" in capsys.readouterr().err
    assert main(["timeline", str(tmp_path / "missing.json")]) == 1
    assert "cannot read" in capsys.readouterr().err
