"""``shardlang suggest FILE.shard --memory 24GiB``: layouts chosen per tensor under a memory
budget (``planner.suggest``), against the fixed strategies; and the main job's one line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cli.inputs import UsageError, bytes_arg, read_spec
from cli.tables import format_bytes, format_seconds
from planner.knapsack import smallest_memory, suggest
from planner.suggest import OPTIMIZERS, STRATEGY_NAMES, Choice, Problem, SuggestError, Suggestion, build_problem
from shardlang import Spec, format_spec
from shardlang.errors import SpecError
from shardlang.writer import fold_names

_FRONTIER_POINTS = 16
_WORTH = 1e-3  # the main job mentions a change that saves at least this share of the time


def add_suggest_parser(sub: Any) -> None:
    p = sub.add_parser(
        "suggest",
        help="choose every tensor's layouts under a per-rank memory budget",
        description="Choose per tensor its state layout, and where its gradient is a pending mean its param and "
        "grad layouts (ZeRO-1/2/3 forms), minimizing the modeled step time within a per-rank memory budget; "
        "solved exactly as an integer program (README, 'Choosing layouts').",
    )
    p.add_argument("file", metavar="FILE.shard")
    p.add_argument("--memory", required=True, type=bytes_arg, metavar="BYTES", help="per-rank budget: 24GiB, 8e9")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="whose states to count (default adamw)")
    p.add_argument("--states-only", action="store_true", help="keep every param and grad layout; choose states")
    p.add_argument("--time-limit", type=float, default=10.0, metavar="SECONDS", help="for the solver (default 10)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("-o", "--output", metavar="OUT.shard", help="write the spec with the chosen layouts")
    p.add_argument("--plot", metavar="FRONTIER.svg", help="draw the memory/time frontier")


def _choice_json(problem: Problem, choice: Choice) -> dict[str, Any]:
    return {"memory_bytes": choice.memory, "seconds": choice.seconds, "changed_tensors": problem.changed(choice)}


def _chosen_lines(problem: Problem, choice: Choice) -> list[str]:
    lines = []
    for group, picks in zip(problem.groups, choice.picks, strict=True):
        for c in sorted(set(picks)):
            names = fold_names([t.name for t, p in zip(group.tensors, picks, strict=True) if p == c])
            lay = group.candidates[c].layouts
            mark = "" if c == group.original else "  (changed)"
            for name in names:
                lines.append(f"  {name}{mark}")
                lines.append(f"      param = {lay.param}   grad = {lay.grad}   state = {lay.state()}")
    return lines


def format_suggestion(result: Suggestion) -> str:
    problem, best = result.problem, result.best
    n = sum(len(g.tensors) for g in problem.groups)
    out = [
        f"suggest: {problem.spec.filename}, {problem.optimizer}, budget {format_bytes(result.budget)} per rank",
        "",
        "chosen layouts:",
        *_chosen_lines(problem, best),
        "",
        f"suggested: {format_bytes(best.memory)} per rank, {format_seconds(best.seconds)} modeled; "
        f"{problem.changed(best)} of {n} tensors changed",
        "",
        "  strategy    memory/rank  modeled time  fits  time vs suggested",
    ]
    rows = [("this spec", problem.original())] + [(s, problem.strategy(s)) for s in STRATEGY_NAMES]
    fitting = []
    for name, choice in rows:
        if choice is None:
            out.append(f"  {name:<10}  (not a candidate of every tensor)")
            continue
        fits = choice.memory <= result.budget
        if fits and name != "this spec":
            fitting.append((choice.seconds, name))
        ratio = choice.seconds / best.seconds if best.seconds else 1.0
        out.append(
            f"  {name:<10}  {format_bytes(choice.memory):>11}  {format_seconds(choice.seconds):>12}  "
            f"{'yes' if fits else 'no':>4}  {ratio:.3f}x"
        )
    if fitting:
        seconds, name = min(fitting)
        ratio = seconds / best.seconds if best.seconds else 1.0
        out.append(f"best fixed strategy that fits: {name}, {ratio:.3f}x the suggested time")
    else:
        out.append("no fixed strategy fits the budget")
    status = "optimal" if result.optimal else f"stopped at the time limit, optimality gap {result.gap:.2%}"
    out.append(
        f"solved: {status} (HiGHS, {result.solve_seconds:.2f} s; pricing {problem.price_seconds:.2f} s, "
        f"{sum(len(g.candidates) for g in problem.groups)} candidates in {len(problem.groups)} groups)"
    )
    return "\n".join(out)


def suggestion_json(result: Suggestion) -> dict[str, Any]:
    problem = result.problem
    tensors = []
    for group, picks in zip(problem.groups, result.best.picks, strict=True):
        for t, c in zip(group.tensors, picks, strict=True):
            lay = group.candidates[c].layouts
            tensors.append(
                {
                    "tensor": t.name,
                    "param": str(lay.param),
                    "grad": str(lay.grad),
                    "state": str(lay.state()),
                    "changed": c != group.original,
                }
            )
    strategies = {}
    for name in STRATEGY_NAMES:
        choice = problem.strategy(name)
        if choice is not None:
            strategies[name] = _choice_json(problem, choice) | {"fits": choice.memory <= result.budget}
    return {
        "file": problem.spec.filename,
        "optimizer": problem.optimizer,
        "budget_bytes": result.budget,
        "suggested": _choice_json(problem, result.best),
        "this_spec": _choice_json(problem, problem.original()),
        "strategies": strategies,
        "optimal": result.optimal,
        "gap": result.gap,
        "solve_seconds": result.solve_seconds,
        "tensors": tensors,
    }


def frontier(problem: Problem, time_limit: float) -> list[Choice]:
    """The fastest choice at budgets from the smallest memory to the fastest choice's memory."""
    low = smallest_memory(problem, time_limit).memory
    fastest = suggest(problem, 2**62, time_limit).best
    high = max(low, fastest.memory)
    budgets = sorted({round(low + (high - low) * k / (_FRONTIER_POINTS - 1)) for k in range(_FRONTIER_POINTS)})
    return [suggest(problem, b, time_limit).best for b in budgets]


def frontier_svg(problem: Problem, points: list[Choice]) -> str:
    """Modeled time against memory per rank: the frontier as a line, the strategies as dots."""
    marks = [(s, c) for s in STRATEGY_NAMES if (c := problem.strategy(s)) is not None]
    xs = [c.memory for c in points] + [c.memory for _, c in marks]
    ys = [c.seconds for c in points] + [c.seconds for _, c in marks]
    width, height, pad = 640, 400, 60
    x0, x1, y0, y1 = min(xs), max(xs) or 1, 0.0, max(ys) or 1.0

    def px(x: float) -> float:
        return pad + (x - x0) / ((x1 - x0) or 1) * (width - 2 * pad)

    def py(y: float) -> float:
        return height - pad - (y - y0) / ((y1 - y0) or 1) * (height - 2 * pad)

    line = " ".join(f"{px(c.memory):.1f},{py(c.seconds):.1f}" for c in points)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{pad}" y="24" font-size="14">{problem.spec.filename}: fastest layouts per memory budget '
        f"({problem.optimizer})</text>",
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
        f'<text x="{width / 2}" y="{height - 20}" text-anchor="middle">memory per rank '
        f"({format_bytes(x0)} to {format_bytes(x1)})</text>",
        f'<text x="16" y="{height / 2}" transform="rotate(-90 16 {height / 2})" text-anchor="middle">modeled time '
        f"(0 to {format_seconds(y1)})</text>",
        f'<polyline points="{line}" fill="none" stroke="#1f77b4" stroke-width="2"/>',
    ]
    out += [f'<circle cx="{px(c.memory):.1f}" cy="{py(c.seconds):.1f}" r="3" fill="#1f77b4"/>' for c in points]
    for name, c in marks:
        x, y = px(c.memory), py(c.seconds)
        out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" fill="none" stroke="#d62728" stroke-width="2"/>')
        out.append(f'<text x="{x + 7:.1f}" y="{y - 7:.1f}" fill="#d62728">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise SpecError(f"{path}: cannot write: {e.strerror}") from None


def cmd_suggest(args: argparse.Namespace) -> int:
    if args.time_limit <= 0:
        raise UsageError("--time-limit must be positive")
    spec = read_spec(args.file)
    problem = build_problem(spec, args.optimizer, states_only=args.states_only)
    result = suggest(problem, args.memory, args.time_limit)
    if args.format == "json":
        json.dump(suggestion_json(result), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_suggestion(result))
    if args.output:
        command = f"shardlang suggest {args.file} --memory {args.memory} --optimizer {args.optimizer}"
        header = [f"Layouts chosen by `{command}`."]
        _write(args.output, format_spec(result.spec(), header=header))
        print(f"wrote {args.output}", file=sys.stderr)
    if args.plot:
        _write(args.plot, frontier_svg(problem, frontier(problem, args.time_limit)))
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def suggest_line(spec: Spec) -> str:
    """The main job's line: what ``suggest`` changes within the spec's own memory (AdamW)."""
    try:
        problem = build_problem(spec, "adamw")
        own = problem.original()
        best = suggest(problem, own.memory).best
    except SuggestError as e:
        return f"suggest: not for this spec: {e.message}"
    changed = problem.changed(best)
    within = f"within this spec's own {format_bytes(own.memory)} per rank (AdamW)"
    if not changed or best.seconds > own.seconds * (1 - _WORTH):
        return f"suggest: {within}, no other layouts are {_WORTH:.1%} faster ({format_seconds(own.seconds)} modeled)"
    return (
        f"suggest: {within}, `shardlang suggest` would change the layouts of {changed} of "
        f"{len(spec.tensors)} tensors: {format_seconds(own.seconds)} -> {format_seconds(best.seconds)} modeled "
        f"({1 - best.seconds / own.seconds:.1%} less)"
    )
