"""``shardlang timeline``: one profiled optimizer step, planned against measured, per bucket.

The trace is one rank's, written by ``runtime.stacks.profiler.save_trace``: torch.profiler's
Chrome trace, whose ranges name every bucket's start and wait (``shardlang before the update:
start bucket 2 of 5 (...)``), and the optimizer's step plan, whose buckets carry the seconds the
cost model gave their collectives. The picture has one row per bucket, by stage: the planned
bar (drawn from the bucket's measured start) above the measured one, from the start of its
start range to the end of its wait range; under them a row for each of the step's other ranges
(the math, the commit flags, backward's hooks: docs/stacks/profiler.md).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict
from html import escape
from pathlib import Path
from typing import Any

import attrs

from cli.render import write
from planner.errors import PlanError
from planner.step import StepPlan
from shardlang.errors import ShardlangError

RANGE = re.compile(
    r"shardlang (?P<stage>.+?): (?P<what>start|wait) bucket (?P<index>\d+) of (?P<count>\d+) \((?P<text>.*)\)"
)
STEP_RANGE = "Optimizer.step#"  # torch.optim.Optimizer.step's own range
# The step's other ranges (docs/stacks/profiler.md, the table); hooks and writes, one per
# gradient or layer, are drawn on one row each.
OTHER_RANGE = re.compile(r"shardlang (?P<where>[^:]+): (?P<what>.+)")
GROUPED = {"hook": "gradient hooks", "write": "parameter writes"}


class TraceError(ShardlangError):
    """The trace cannot be read, or its ranges do not fit its step plan."""


@attrs.frozen
class BucketTiming:
    """One bucket of the drawn step: times in seconds from the timeline's origin."""

    index: int  # 1-based, as the ranges name it
    stage: str
    name: str  # the bucket's part of the range name: 'bucket 2 of 5 (...)'
    planned: float  # the cost model's seconds for its collective
    start: float
    start_seconds: float
    wait: float
    wait_seconds: float

    @property
    def end(self) -> float:
        return self.wait + self.wait_seconds

    @property
    def measured(self) -> float:
        """From its start range's beginning to its wait range's end."""
        return self.end - self.start


@attrs.frozen
class StageTiming:
    """One of the step's other ranges (the math, a commit flag, ...): its row's name and each
    time it ran in the step, (start, seconds) from the timeline's origin."""

    name: str  # 'commit: flag 1 of 2', 'backward: gradient hooks'
    spans: tuple[tuple[float, float], ...]

    @property
    def seconds(self) -> float:
        return sum(length for _, length in self.spans)


@attrs.frozen
class StepTimeline:
    rank: int
    world_size: int
    optimizer: str
    step: int  # 1-based, of ``steps`` profiled
    steps: int
    buckets: tuple[BucketTiming, ...]
    step_range: tuple[float, float] | None  # optimizer.step()'s range (start, seconds), if traced
    # The step's other ranges, by their first start: from the end of the previous step's last
    # bucket range (its backward's hooks) to the end of this step.
    stages: tuple[StageTiming, ...] = ()

    @property
    def planned(self) -> float:
        return sum(b.planned for b in self.buckets)


def read_timeline(path: str, step: int | None = None) -> StepTimeline:
    """Step ``step`` (1-based; default the last) of the trace at ``path``."""
    from runtime.stacks.profiler import TRACE_KEY  # torch comes with it: only this command needs it

    try:
        trace = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise TraceError(f"cannot read {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{path} is not a JSON trace: {e}") from None
    saved = trace.get(TRACE_KEY) if isinstance(trace, dict) else None
    if not isinstance(saved, dict) or "step_plan" not in saved:
        raise TraceError(
            f"{path} holds no step plan: save the profile with runtime.stacks.profiler.save_trace, "
            "not export_chrome_trace (docs/stacks/profiler.md)"
        )
    try:
        plan = StepPlan.from_json(saved["step_plan"])
    except PlanError as e:
        raise TraceError(f"{path}: {e.message}") from None
    events = [e for e in trace.get("traceEvents", ()) if isinstance(e, dict) and e.get("ph") == "X"]
    ranges = _bucket_ranges(path, events, plan)
    steps = len(ranges[(1, "start")])
    chosen = steps if step is None else step
    if not 1 <= chosen <= steps:
        raise TraceError(f"{path} holds {steps} profiled step{'s' * (steps != 1)}; --step {step} is not one of them")
    picked = {key: found[chosen - 1] for key, found in ranges.items()}
    step_range = _step_range(events, picked)
    previous = max((t + d for found in ranges.values() for t, d, _ in found[chosen - 2 : chosen - 1]), default=None)
    end = max([t + d for t, d, _ in picked.values()] + ([sum(step_range)] if step_range else []))
    others = _other_ranges(events, previous, end)
    first = [at for spans in others.values() for at, _ in spans[:1]]
    origin = min([picked[(1, "start")][0], *([step_range[0]] if step_range else []), *first])
    buckets = []
    for i, bucket in enumerate(plan.buckets, start=1):
        (start, start_length, name), (wait, wait_length, _) = picked[(i, "start")], picked[(i, "wait")]
        seconds = [t / 1e6 for t in (start - origin, start_length, wait - origin, wait_length)]
        buckets.append(BucketTiming(i, bucket.stage, name, bucket.seconds, *seconds))
    return StepTimeline(
        rank=int(saved.get("rank", plan.rank)),
        world_size=int(saved.get("world_size", 1)),
        optimizer=str(saved.get("optimizer", "optimizer")),
        step=chosen,
        steps=steps,
        buckets=tuple(buckets),
        step_range=None if step_range is None else ((step_range[0] - origin) / 1e6, step_range[1] / 1e6),
        stages=tuple(
            StageTiming(name, tuple(((at - origin) / 1e6, length / 1e6) for at, length in spans))
            for name, spans in others.items()
        ),
    )


def _other_ranges(
    events: list[dict[str, Any]], after: float | None, until: float
) -> dict[str, list[tuple[float, float]]]:
    """The step's ranges other than its buckets' starting after ``after`` (the previous step's
    end, microseconds) and by ``until``: per row name, (start, duration), by first start."""
    rows: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for event in sorted(events, key=lambda e: e.get("ts") if isinstance(e.get("ts"), int | float) else 0):
        m = OTHER_RANGE.fullmatch(str(event.get("name", "")))
        at, length = event.get("ts"), event.get("dur")
        if not m or RANGE.fullmatch(m[0]) or not isinstance(at, int | float) or not isinstance(length, int | float):
            continue
        if (after is not None and at <= after) or at > until:
            continue
        kind = m["what"].split(" ", 1)[0]
        rows[f"{m['where']}: {GROUPED.get(kind, m['what'])}"].append((float(at), float(length)))
    return dict(rows)


def _bucket_ranges(
    path: str, events: list[dict[str, Any]], plan: StepPlan
) -> dict[tuple[int, str], list[tuple[float, float, str]]]:
    """Per (bucket, start or wait) its ranges in time order: (start, duration, bucket name), in
    the trace's microseconds (seconds since the epoch lose the nanoseconds)."""
    stages = {b.stage for b in plan.buckets}
    found: dict[tuple[int, str], list[tuple[float, float, str]]] = defaultdict(list)
    for event in sorted(events, key=lambda e: e.get("ts") if isinstance(e.get("ts"), int | float) else 0):
        m = RANGE.fullmatch(str(event.get("name", "")))
        if not m or m["stage"] not in stages:  # Muon's matrix buckets are in stages of their own
            continue
        index, count = int(m["index"]), int(m["count"])
        if count != len(plan.buckets) or not 1 <= index <= count:
            raise TraceError(
                f"{path}: the trace's step has {count} buckets and its step plan {len(plan.buckets)}: "
                "save the trace right after the profiled step (docs/stacks/profiler.md)"
            )
        bucket = plan.buckets[index - 1]
        if m["stage"] != bucket.stage or not m["text"].startswith(bucket.describe()):
            raise TraceError(
                f"{path}: bucket {index} is '{m['stage']}: {m['text']}' in the trace but '{bucket.stage}: "
                f"{bucket.describe()}' in its step plan: save the trace right after the profiled step"
            )
        at, length = event.get("ts"), event.get("dur")
        if not isinstance(at, int | float) or not isinstance(length, int | float):
            raise TraceError(f"{path}: the range '{m[0]}' has no numeric ts and dur")
        found[(index, m["what"])].append((float(at), float(length), m[0].split(": ", 1)[1]))
    if not found:
        raise TraceError(f"{path} holds no shardlang bucket ranges: was the optimizer's step profiled?")
    counts = {(i, what): len(found[(i, what)]) for i in range(1, len(plan.buckets) + 1) for what in ("start", "wait")}
    if len(set(counts.values())) != 1:
        uneven = ", ".join(f"bucket {i} {what} x{n}" for (i, what), n in counts.items())
        raise TraceError(f"{path}: the buckets' ranges do not make whole steps ({uneven}): profile whole steps")
    return {key: [(t, d, name.split(" ", 1)[1]) for t, d, name in found[key]] for key in counts}


def _step_range(
    events: list[dict[str, Any]], picked: dict[tuple[int, str], tuple[float, float, str]]
) -> tuple[float, float] | None:
    """optimizer.step()'s range around the step's last wait (microseconds), if the trace has one."""
    last = max(t + d for t, d, _ in picked.values())
    for event in events:
        if str(event.get("name", "")).startswith(STEP_RANGE):
            start, length = float(event["ts"]), float(event["dur"])
            if start <= last <= start + length + 1e-3:
                return start, length
    return None


# --- the picture ---------------------------------------------------------------------------
WIDTH, LABEL, RIGHT, ROW, HEAD = 1000, 360, 24, 36, 96
COLORS = {
    "planned": "#4c72b0",
    "start": "#c44e52",
    "flight": "#f2c4a0",
    "wait": "#dd8452",
    "step": "#8c8c8c",
    "range": "#55a868",
}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _short(text: str, limit: int = 50) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _ticks(span: float) -> list[float]:
    raw = span / 6
    step = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1e-3
    step *= next(f for f in (1, 2, 5, 10) if f * step >= raw)
    return [i * step for i in range(int(span / step) + 1)]


def timeline_svg(timeline: StepTimeline) -> str:
    """The timeline as an SVG: per bucket a group ``bucket-N`` titled with the bucket's name,
    holding its planned bar and its measured one (start, in flight, wait)."""
    ends = [b.end for b in timeline.buckets] + [b.start + b.planned for b in timeline.buckets]
    ends += [at + length for stage in timeline.stages for at, length in stage.spans]
    if timeline.step_range:
        ends.append(sum(timeline.step_range))
    span = max(ends) or 1e-6
    scale = (WIDTH - LABEL - RIGHT) / span
    stages = list(dict.fromkeys(b.stage for b in timeline.buckets))
    rows = len(timeline.buckets) + len(stages) + (1 if timeline.step_range else 0)
    rows += len(timeline.stages) + (1 if timeline.stages else 0)
    height = HEAD + rows * ROW + 60
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="12" y="22" font-size="15" font-weight="bold">{escape(timeline.optimizer)} step {timeline.step} '
        f"of {timeline.steps} profiled, rank {timeline.rank} of {timeline.world_size}: planned against measured</text>",
        f'<text x="12" y="42">planned: the cost model\'s seconds per bucket ({_ms(timeline.planned)} in all), '
        "drawn from the bucket's measured start; measured: torch.profiler's ranges</text>",
    ]
    legend = [("planned", "planned"), ("start", "start (pack, launch)"), ("flight", "in flight"), ("wait", "wait")]
    legend += [("range", "the step's other ranges")] if timeline.stages else []
    x = 12
    for key, text in legend:
        out.append(f'<rect x="{x}" y="54" width="14" height="10" fill="{COLORS[key]}"/>')
        out.append(f'<text x="{x + 18}" y="63">{text}</text>')
        x += 24 + 7 * len(text)
    axis_y = HEAD - 10
    for tick in _ticks(span):
        tx = LABEL + tick * scale
        out.append(f'<line x1="{tx:.1f}" y1="{axis_y}" x2="{tx:.1f}" y2="{height - 50}" stroke="#e0e0e0"/>')
        out.append(f'<text x="{tx:.1f}" y="{axis_y - 4}" text-anchor="middle" fill="#555">{_ms(tick)}</text>')
    y = HEAD
    if timeline.step_range:
        start, seconds = timeline.step_range
        out.append('<g class="step"><title>optimizer.step()</title>')
        out.append(f'<text x="12" y="{y + 22}" font-weight="bold">optimizer.step()</text>')
        out.append(_bar("measured", start, seconds, y + 14, scale, COLORS["step"], f"{_ms(seconds)} measured"))
        out.append("</g>")
        y += ROW
    for stage in stages:
        out.append(f'<text x="12" y="{y + 22}" font-weight="bold">{escape(stage)}</text>')
        y += ROW
        for b in (b for b in timeline.buckets if b.stage == stage):
            out.extend(_bucket(b, y, scale))
            y += ROW
    if timeline.stages:
        out.append(f'<text x="12" y="{y + 22}" font-weight="bold">the step\'s other ranges</text>')
        y += ROW
        for stage in timeline.stages:
            out.extend(_stage(stage, y, scale))
            y += ROW
    out.append(
        f'<text x="12" y="{height - 28}" fill="#555">measured: from the start range\'s beginning to the wait '
        "range's end; time from the step's first range (docs/stacks/profiler.md)</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _bucket(b: BucketTiming, y: int, scale: float) -> list[str]:
    head, _, members = b.name.partition(" (")
    return [
        f'<g class="bucket" id="bucket-{b.index}" data-stage="{escape(b.stage)}">',
        f"<title>{escape(b.name)}</title>",
        f'<text x="24" y="{y + 14}">{escape(head)}</text>',
        f'<text x="24" y="{y + 28}" fill="#555">{escape(_short(members.removesuffix(")")))}</text>',
        _bar("planned", b.start, b.planned, y + 3, scale, COLORS["planned"], f"{_ms(b.planned)} planned"),
        f'<g class="measured" data-seconds="{b.measured:.9g}">',
        _rect("start", b.start, b.start_seconds, y + 18, scale, COLORS["start"]),
        _rect("flight", b.start + b.start_seconds, b.wait - b.start - b.start_seconds, y + 18, scale, COLORS["flight"]),
        _rect("wait", b.wait, b.wait_seconds, y + 18, scale, COLORS["wait"]),
        _value(b.start, b.measured, y + 18, scale, f"{_ms(b.measured)} measured"),
        "</g>",
        "</g>",
    ]


def _stage(stage: StageTiming, y: int, scale: float) -> list[str]:
    times = f" x{len(stage.spans)}" if len(stage.spans) > 1 else ""
    return [
        f'<g class="stage" data-seconds="{stage.seconds:.9g}">',
        f"<title>{escape(stage.name)}</title>",
        f'<text x="24" y="{y + 22}">{escape(_short(stage.name))}</text>',
        *(_rect("range", at, length, y + 12, scale, COLORS["range"]) for at, length in stage.spans),
        _value(stage.spans[0][0], stage.spans[-1][0] + stage.spans[-1][1] - stage.spans[0][0], y + 12, scale,
               f"{_ms(stage.seconds)}{times}"),
        "</g>",
    ]  # fmt: skip


def _rect(kind: str, start: float, seconds: float, y: int, scale: float, color: str) -> str:
    return (
        f'<rect class="{kind}" x="{LABEL + start * scale:.2f}" y="{y}" width="{max(seconds, 0) * scale:.2f}" '
        f'height="12" fill="{color}" data-seconds="{seconds:.9g}"/>'
    )


def _value(start: float, seconds: float, y: int, scale: float, text: str) -> str:
    """The bar's value right of it, or left of it where the plot ends."""
    right = LABEL + (start + seconds) * scale + 4
    if right + 7 * len(text) < WIDTH:
        return f'<text x="{right:.1f}" y="{y + 10}" font-size="11">{text}</text>'
    return f'<text x="{LABEL + start * scale - 4:.1f}" y="{y + 10}" font-size="11" text-anchor="end">{text}</text>'


def _bar(kind: str, start: float, seconds: float, y: int, scale: float, color: str, text: str) -> str:
    return _rect(kind, start, seconds, y, scale, color) + _value(start, seconds, y, scale, text)


# --- the command ---------------------------------------------------------------------------
def add_timeline_parser(sub: Any) -> None:
    p = sub.add_parser(
        "timeline",
        help="one profiled step's buckets, planned against measured (SVG)",
        description="Draw one optimizer step of a trace that runtime.stacks.profiler.save_trace wrote: per "
        "bucket, the cost model's planned seconds beside the measured time from its start to the end of its "
        "wait; print the same as a table.",
    )
    p.add_argument("trace", metavar="TRACE.json")
    p.add_argument("--step", type=int, metavar="N", help="which profiled step (1-based; default the last)")
    p.add_argument("-o", "--output", metavar="FILE.svg", help="where to write the SVG (default: standard output)")


def cmd_timeline(args: argparse.Namespace) -> int:
    timeline = read_timeline(args.trace, args.step)
    written = write(timeline_svg(timeline).encode(), args.output, "svg")
    if written is not None:
        print(format_timeline(timeline))
        print(f"timeline: {written}")
    return 0


def format_timeline(timeline: StepTimeline) -> str:
    lines = [f"{'bucket':<60} {'planned':>10} {'measured':>10} {'wait':>10}"]
    for b in timeline.buckets:
        lines.append(
            f"{_short(b.stage + ': ' + b.name, 60):<60} {_ms(b.planned):>10} {_ms(b.measured):>10} "
            f"{_ms(b.wait_seconds):>10}"
        )
    for stage in timeline.stages:
        lines.append(f"{_short(stage.name, 60):<60} {'':>10} {_ms(stage.seconds):>10}")
    if timeline.step_range:
        lines.append(f"{'optimizer.step()':<60} {_ms(timeline.planned):>10} {_ms(timeline.step_range[1]):>10}")
    return "\n".join(lines)
