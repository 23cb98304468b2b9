"""``shardlang suggest FILE.shard --memory 24GiB``: layouts chosen per tensor under a memory
budget (``planner.suggest``), with and without the optimizers' flat sharding, against the fixed
strategies; and the main job's one line.

Tensors that the spec's rules give layouts are chosen for too when their shapes are known:
``--shapes FILE`` (as ``shardlang init`` reads it), ``--model MODULE:FACTORY`` or ``--tensor
NAME:SHAPE[:DTYPE]`` (braces expand). ``-o`` declares every chosen tensor, the rules kept."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from cli.buckets import cap_warning
from cli.init import named_tensors
from cli.inputs import UsageError, bucket_cap_arg, bytes_arg, read_spec, shape_arg
from cli.tables import format_bytes, format_seconds
from planner.bucket_cap import AUTO
from planner.knapsack import NODE_LIMIT, better, fixed_choices, problem_kind, smallest_memory, suggest_best
from planner.loops import AUTO as LOOP_AUTO
from planner.loops import LOOPS
from planner.memory import MemoryPrediction
from planner.suggest import OPTIMIZERS, Choice, Problem, SuggestError, Suggestion, build_problems
from shardlang import Spec, TensorSpec, format_spec
from shardlang.errors import ShardlangError, SpecError
from shardlang.generate import named_entries
from shardlang.parser import MAX_EXPANDED_NAMES
from shardlang.spec import expand_braces
from shardlang.writer import fold_names

_FRONTIER_POINTS = 16
_WORTH = 1e-3  # the main job mentions a change that saves at least this share of the time


def add_suggest_parser(sub: Any) -> None:
    p = sub.add_parser(
        "suggest",
        help="choose every tensor's layouts under a per-rank memory budget",
        description="Choose per tensor its state layout, and where its gradient is a pending mean its param and "
        "grad layouts (ZeRO-1/2/3 forms), minimizing the modeled step time within a per-rank memory budget; "
        "solved as an integer program, exactly or with its gap stated where the node limit stops it (README, "
        "'Choosing layouts').",
    )
    p.add_argument("file", metavar="FILE.shard")
    p.add_argument("--memory", required=True, type=bytes_arg, metavar="BYTES", help="per-rank budget: 24GiB, 8e9")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--shapes", metavar="FILE", help="JSON list of [name, shape(, dtype)]: tensors rules match")
    source.add_argument("--model", metavar="MODULE:FACTORY", help="a function returning the nn.Module, called bare")
    p.add_argument(
        "--tensor",
        action="append",
        default=[],
        type=_tensor_arg,
        metavar="NAME:SHAPE[:DTYPE]",
        help="a tensor a rule matches (repeatable; braces expand): 'h.{0..31}.norm.weight:4096:bf16' (default f32)",
    )
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="whose states to count (default adamw)")
    p.add_argument("--states-only", action="store_true", help="keep every param and grad layout; choose states")
    p.add_argument(
        "--loop",
        choices=(LOOP_AUTO, *LOOPS),
        default=LOOP_AUTO,
        help="the training loop the layouts must run in: a plain module (the step reduces the gradients), ddp "
        "(backward reduces them), fsdp2 or fsdp2-tp (fully_shard: dim 0 sharded over the data-parallel axes), "
        "any (every ZeRO form); default auto: inferred from the spec's layouts",
    )
    p.add_argument(
        "--node-limit",
        type=int,
        default=NODE_LIMIT,
        metavar="N",
        help=f"branch-and-bound nodes per solve (default {NODE_LIMIT}; the same answer on any machine, its gap said)",
    )
    p.add_argument(
        "--bucket-bytes",
        type=bucket_cap_arg,
        metavar="BYTES",
        help="the most buffer bytes a bucket holds per rank, as `plan --bucket-bytes` (default 32MiB; auto: "
        "each choice under the cost model's cap for it, as `plan --bucket-bytes auto`)",
    )
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("-o", "--output", metavar="OUT.shard", help="write the spec with the chosen layouts")
    p.add_argument("--plot", metavar="FRONTIER.svg", help="draw the memory/time frontier")


def _tensor_arg(text: str) -> list[tuple[str, tuple[int, ...], str]]:
    name, _, rest = text.partition(":")
    shape_text, _, dtype = rest.partition(":")
    if not name or not rest:
        raise argparse.ArgumentTypeError(f"'{text}': write NAME:SHAPE or NAME:SHAPE:DTYPE, e.g. norm.weight:4096:bf16")
    try:
        names = expand_braces(name, limit=MAX_EXPANDED_NAMES)
        return named_entries([(n, shape_arg(shape_text), dtype or "f32") for n in names])
    except ShardlangError as e:
        raise argparse.ArgumentTypeError(f"'{text}': {e.message}") from None


def chosen_tensors(spec: Spec, args: argparse.Namespace) -> list[TensorSpec]:
    """The declared tensors, then those the options name (declared: checked; else a rule's)."""
    entries = [e for group in args.tensor for e in group]
    if args.shapes is not None or args.model is not None:
        entries += named_entries(named_tensors(args))
    out = {t.name: t for t in spec.tensors}
    for name, shape, dtype in entries:
        resolved = spec.resolve(name, shape, dtype)
        out.setdefault(name, resolved)
    return list(out.values())


def _label(problem: Problem, name: str) -> str:
    return name if problem.flat_axis is None else f"{name} {problem.flat_axis}"


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


def _fixed(result: Suggestion, problems: Sequence[Problem]) -> list[tuple[Problem, tuple]]:
    """Every problem's fixed choices, as ``suggest_best`` priced them (else priced here)."""
    known = {id(p): fixed for p, fixed in result.fixed}
    return [(p, known[id(p)] if id(p) in known else fixed_choices(p)) for p in problems]


def _fixed_rows(result: Suggestion, problems: Sequence[Problem]) -> list[tuple[str, Choice | None]]:
    """``this spec`` (the plain problem's own layouts), then every fixed strategy."""
    every = _fixed(result, problems)
    rows: list[tuple[str, Choice | None]] = [("this spec", every[0][1][0][1])]
    rows += [(_label(p, name), c) for p, fixed in every for name, c in fixed if name is not None]
    return rows


def format_suggestion(result: Suggestion, problems: Sequence[Problem]) -> str:
    """The chosen layouts, then every fixed strategy of ``problems`` (the plain one first)."""
    problem, best = result.problem, result.best
    n = len(problem.tensors)
    flat = "" if problem.flat_axis is None else f", states flat over {problem.flat_axis} (the optimizers' flat_axis)"
    out = [
        f"suggest: {problem.spec.filename}, {problem.optimizer}, budget {format_bytes(result.budget)} per rank",
        f"loop: {problem.loop} ({_loop_reason(problem)})",
        "",
        "chosen layouts:",
        *_chosen_lines(problem, best),
        "",
        f"suggested: {format_bytes(best.memory)} per rank, {format_seconds(best.seconds)} modeled{flat}; "
        f"{problem.changed(best)} of {n} tensors changed",
        f"held as the runtime counts it (memory_report()'s kinds; the budget bounds it): "
        f"{_kinds(problem.prediction(best.picks))}",
        "",
        "  strategy        memory/rank  modeled time  fits  time vs suggested",
    ]
    rows = _fixed_rows(result, problems)
    fitting: list[tuple[Choice, str]] = []
    for name, choice in rows:
        if choice is None:
            out.append(f"  {name:<14}  (not a candidate of every tensor in this loop)")
            continue
        fits = choice.memory <= result.budget
        if fits and name != "this spec" and (not fitting or better(choice, fitting[0][0], None)):
            fitting = [(choice, name)]  # the fastest, then the least memory, then the first
        ratio = choice.seconds / best.seconds if best.seconds else 1.0
        out.append(
            f"  {name:<14}  {format_bytes(choice.memory):>11}  {format_seconds(choice.seconds):>12}  "
            f"{'yes' if fits else 'no':>4}  {ratio:.3f}x"
        )
    if fitting:
        choice, name = fitting[0]
        ratio = choice.seconds / best.seconds if best.seconds else 1.0
        out.append(f"best fixed strategy that fits: {name}, {ratio:.3f}x the suggested time")
    else:
        out.append("no fixed strategy fits the budget")
    status = "optimal" if result.optimal else f"stopped at the node limit, optimality gap {result.gap:.2%}"
    if not result.solved:
        status = "no solution taken from the solver (fallback below)"
    candidates = sum(len(g.candidates) for p in problems for g in p.groups)
    pricing = sum(p.price_seconds for p in problems)
    kinds = ", ".join(problem_kind(p) for p in problems)
    cap = f"{format_bytes(problem.cap_of(best.picks))} (as `shardlang plan`)"
    if problem.bucket_bytes == AUTO:
        cap = f"{format_bytes(problem.cap_of(best.picks))}, the cost model's cap for the suggested layouts (auto)"
    ties = "ties: less memory, then fewer changes"
    out.append(f"modeled time: buckets of at most {cap}, the training loop's too; {ties}")
    out += cap_lines(problem, best)
    out.append(
        f"solved: {status} (HiGHS, {result.solve_seconds:.2f} s; pricing {pricing:.2f} s, "
        f"{candidates} candidates in {len(problems)} problem{'s' * (len(problems) != 1)}: {kinds})"
    )
    out += [f"fallback: {note}" for note in result.fallback]
    return "\n".join(out)


def _kinds(prediction: MemoryPrediction) -> str:
    """``params 64.0 KiB + states 32.0 KiB + buffers 96.0 KiB = 192 KiB``: the kinds held."""
    parts = [f"{k} {format_bytes(v)}" for k, v in attrs.asdict(prediction).items() if v]
    return f"{' + '.join(parts)} = {format_bytes(prediction.total_bytes)} per rank"


def _loop_reason(problem: Problem) -> str:
    if problem.loop_reason == "given":
        return "--loop"
    return f"inferred: {problem.loop_reason}; --loop to choose another"


def cap_lines(problem: Problem, choice: Choice) -> list[str]:
    """A warning where the bucket cap is far from the cost model's for the chosen layouts
    (``planner.bucket_cap``: the step and the loop slower than under the model's cap, or
    buckets far larger for at most 5% of the time), naming the model's cap."""
    if not choice.seconds or problem.bucket_bytes == AUTO:
        return []
    model = problem.model_cap(choice.picks)
    in_use = problem.priced(choice.picks)(int(problem.bucket_bytes))
    advice = f"--bucket-bytes {format_bytes(model.bytes).replace(' ', '')} (here and in the optimizers) takes it"
    return cap_warning(problem.bucket_bytes, in_use, model, advice)


def suggestion_json(result: Suggestion, problems: Sequence[Problem]) -> dict[str, Any]:
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
    for p, fixed in _fixed(result, problems):
        for name, choice in fixed:
            if name is not None and choice is not None:
                strategies[_label(p, name)] = _choice_json(p, choice) | {"fits": choice.memory <= result.budget}
    return {
        "file": problem.spec.filename,
        "optimizer": problem.optimizer,
        "loop": problem.loop,
        "loop_reason": problem.loop_reason,
        "budget_bytes": result.budget,
        "flat_axis": problem.flat_axis,
        "suggested": _choice_json(problem, result.best),
        "runtime_memory": problem.prediction(result.best.picks).to_json(),
        "this_spec": _choice_json(problems[0], _fixed(result, problems)[0][1][0][1] or problems[0].original()),
        "strategies": strategies,
        "optimal": result.optimal,
        "gap": result.gap,
        "solved": result.solved,
        "fallback": list(result.fallback),
        "solve_seconds": result.solve_seconds,
        "bucket_bytes": problem.cap_of(result.best.picks),
        "bucket_bytes_auto": problem.bucket_bytes == AUTO,
        "tensors": tensors,
    }


def frontier(problems: Sequence[Problem], node_limit: int) -> list[Suggestion]:
    """The fastest choice at budgets from the smallest memory to the fastest choice's memory."""
    low = min(smallest_memory(p, node_limit).memory for p in problems)
    fastest = suggest_best(problems, 2**62, node_limit).best
    high = max(low, fastest.memory)
    budgets = sorted({round(low + (high - low) * k / (_FRONTIER_POINTS - 1)) for k in range(_FRONTIER_POINTS)})
    return [suggest_best(problems, b, node_limit) for b in budgets]


def frontier_svg(problems: Sequence[Problem], points: list[Choice]) -> str:
    """Modeled time against memory per rank: the frontier as a line, the strategies as dots."""
    problem = problems[0]
    marks = [(_label(p, s), c) for p in problems for s in p.strategy_names() if (c := p.strategy(s)) is not None]
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
    if args.node_limit < 1:
        raise UsageError("--node-limit must be at least 1")
    spec = read_spec(args.file)
    problems = build_problems(
        spec,
        args.optimizer,
        states_only=args.states_only,
        tensors=chosen_tensors(spec, args),
        bucket_bytes=args.bucket_bytes,
        loop=args.loop,
    )
    result = suggest_best(problems, args.memory, args.node_limit)
    if args.format == "json":
        json.dump(suggestion_json(result, problems), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_suggestion(result, problems))
    if args.output:
        command = f"shardlang suggest {args.file} --memory {args.memory} --optimizer {args.optimizer}"
        command += f" --loop {result.problem.loop}"
        if args.bucket_bytes is not None:
            command += f" --bucket-bytes {args.bucket_bytes}"
        header = [f"Layouts chosen by `{command}`."]
        axis = result.problem.flat_axis
        if axis is not None:
            header += [
                f"Flat sharding: run the optimizers with flat_axis={axis!r} (each state the rank's chunk of its",
                f"layout without {axis}); `shardlang check --flat-axis {axis}` plans it so.",
            ]
        _write(args.output, format_spec(result.spec(), header=header))
        print(f"wrote {args.output}", file=sys.stderr)
    if args.plot:
        points = frontier(problems, args.node_limit)
        _write(args.plot, frontier_svg(problems, [p.best for p in points]))
        print(f"wrote {args.plot}", file=sys.stderr)
        for point in points:  # a point's fallback is said as the suggestion's is (docs/reference/suggest.md)
            for note in point.fallback:
                print(f"{args.plot}: at {point.budget} bytes, fallback: {note}", file=sys.stderr)
    return 0


def suggest_line(spec: Spec) -> str:
    """The main job's line: what ``suggest`` changes within the spec's own memory (AdamW), in
    the training loop the spec implies."""
    try:
        problems = build_problems(spec, "adamw", loop=LOOP_AUTO)  # what the spec's loop runs
        own = problems[0].original()
        result = suggest_best(problems, own.memory)
    except SuggestError as e:
        return f"suggest: not for this spec: {e.message}"
    problem, best = result.problem, result.best
    if not result.solved:  # a fallback is never passed off as what suggest finds (docs/reference/suggest.md)
        return f"suggest: not solved for this spec: {result.fallback[0]}"
    changed = problem.changed(best)
    within = f"within this spec's own {format_bytes(own.memory)} per rank (AdamW)"
    if (not changed and problem.flat_axis is None) or best.seconds > own.seconds * (1 - _WORTH):
        return f"suggest: {within}, no other layouts are {_WORTH:.1%} faster ({format_seconds(own.seconds)} modeled)"
    flat = "" if problem.flat_axis is None else f" and keep the states flat over {problem.flat_axis}"
    return (
        f"suggest: {within}, `shardlang suggest` would change the layouts of {changed} of "
        f"{len(spec.tensors)} tensors{flat}: {format_seconds(own.seconds)} -> {format_seconds(best.seconds)} modeled "
        f"({1 - best.seconds / own.seconds:.1%} less)"
    )
