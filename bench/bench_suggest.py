"""``shardlang suggest`` on examples/llama7b_dp4_tp8.shard: solve time, and the modeled step
time against the best fixed strategy that fits, at budgets from ZeRO-3's memory to DDP's.

    .venv/bin/python bench/bench_suggest.py [--spec examples/llama7b_dp4_tp8.shard] [--points 12]
        [--optimizer adamw|came] [--repeat 3] [--tensor NAME:LENGTHS:DTYPE ...] [--budget 80GiB]

``--budget``: one budget only, timed from pricing to the fixed strategies the report lists (what
``shardlang suggest`` does), with the process's peak RSS: the scale check of specs of thousands
of ranks (``shardlang init --shapes SHAPES.json --mesh 'world = [dp=131072]' --strategy zero2``).

The tensors are the spec's declared ones and those its rules match among ``--tensor`` (braces
expand; by default the Llama example's 65 RMSNorm weights, ``[4096]`` bf16). Candidates are
priced once (``pricing``: the plain problem and one per flat axis that is an option); each
budget is then solved ``--repeat`` times and the best time kept (a shared machine's other
processes stay out of the number). ``ratio`` is the suggested time over the best fixed
strategy's that fits (ddp, zero1, zero2, zero3, and the flat ones where offered): never above
1, since every fixed strategy is one of the choices.
"""

from __future__ import annotations

import argparse
import resource
import time

import results as bench_results

from planner.knapsack import suggest_best
from planner.suggest import build_problems
from shardlang import TensorSpec, load_spec
from shardlang.spec import Spec, expand_braces

NORMS = ("model.layers.{0..31}.{input,post_attention}_layernorm.weight:4096:bf16", "model.norm.weight:4096:bf16")


def _tensors(spec: Spec, named: list[str]) -> list[TensorSpec]:
    out = list(spec.tensors)
    for text in named:
        names, lengths, dtype = text.split(":")
        shape = tuple(int(n) for n in lengths.split("x"))
        out += [spec.resolve(name, shape, dtype) for name in expand_braces(names)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="examples/llama7b_dp4_tp8.shard")
    parser.add_argument("--points", type=int, default=12)
    parser.add_argument("--optimizer", choices=("adamw", "came"), default="adamw")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tensor", action="append", help="NAME:LENGTHS:DTYPE, LENGTHS as 4096 or 8x4096")
    parser.add_argument("--budget", help="one budget, timed end to end (24GiB, 8e9)")
    bench_results.add_json_option(parser)
    args = parser.parse_args()
    rows = []
    spec = load_spec(args.spec)
    if args.budget is not None:
        _one_budget(spec, args)
        return
    started = time.perf_counter()
    problems = build_problems(spec, args.optimizer, tensors=_tensors(spec, args.tensor or list(NORMS)))
    pricing = time.perf_counter() - started
    fixed = {}
    for p in problems:
        for name in p.strategy_names():
            choice = p.strategy(name)
            if choice is not None:
                fixed[name if p.flat_axis is None else f"{name} {p.flat_axis}"] = choice
    low, high = fixed["zero3"].memory, fixed["ddp"].memory
    n = len(problems[0].tensors)
    print(
        f"{args.spec}: {n} tensors in {len(problems[0].groups)} groups, {args.optimizer}; "
        f"{len(problems)} problem(s), pricing {pricing:.2f} s"
    )
    print("  " + ", ".join(f"{k} {c.memory / 2**30:.2f} GiB {c.seconds * 1e3:.1f} ms" for k, c in fixed.items()))
    heads = ("budget GiB", "solve s", "suggested ms", "best fixed", "fixed ms")
    print("  ".join(f"{h:>{w}}" for h, w in zip(heads, (10, 7, 12, 10, 8), strict=True)) + "  ratio  optimal")
    for k in range(args.points):
        budget = round(low + (high - low) * k / (args.points - 1))
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            result = suggest_best(problems, budget)
            times.append(time.perf_counter() - t)
        fitting = [(c.seconds, name) for name, c in fixed.items() if c.memory <= budget]
        seconds, name = min(fitting)
        ratio = result.best.seconds / seconds
        assert ratio <= 1 + 1e-9, (budget, ratio)  # every fixed strategy is a choice
        print(
            f"{budget / 2**30:>10.2f}  {min(times):>7.3f}  {result.best.seconds * 1e3:>12.2f}  {name:>10}  "
            f"{seconds * 1e3:>8.2f}  {ratio:.3f}  {result.optimal}"
        )
        cells = [f"{budget / 2**30:.2f}", f"{min(times):.3f}", f"{result.best.seconds * 1e3:.2f}", name]
        rows.append([*cells, f"{seconds * 1e3:.2f}", f"{ratio:.3f}", result.optimal])
    strategies = [[k, f"{c.memory / 2**30:.2f}", f"{c.seconds * 1e3:.1f}"] for k, c in fixed.items()]
    note = f"{n} tensors in {len(problems[0].groups)} groups; pricing {pricing:.2f} s; best of {args.repeat} solves."
    strategy_columns = ["strategy", "GiB per rank", "modeled ms"]
    tables = [
        bench_results.table(f"Fixed strategies, {args.optimizer}", strategy_columns, strategies),
        bench_results.table(f"Suggested within a budget, {args.spec}", [*heads, "ratio", "optimal"], rows, note),
    ]
    bench_results.write(args.json, f"suggest ({args.optimizer})", tables)


def _one_budget(spec: Spec, args: argparse.Namespace) -> None:
    from cli.inputs import bytes_arg

    started = time.perf_counter()
    tensors = _tensors(spec, args.tensor or [])
    problems = build_problems(spec, args.optimizer, tensors=tensors)
    priced = time.perf_counter()
    result = suggest_best(problems, bytes_arg(args.budget))
    solved = time.perf_counter()
    fixed = [
        (name if p.flat_axis is None else f"{name} {p.flat_axis}", c)
        for p, items in result.fixed
        for name, c in items
        if name is not None and c is not None
    ]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    candidates = sum(len(g.candidates) for p in problems for g in p.groups)
    print(
        f"{args.spec}: {len(tensors)} tensors, {candidates} candidates in {len(problems)} problems; pricing "
        f"{priced - started:.2f} s, solving {solved - priced:.2f} s, total {solved - started:.2f} s, "
        f"peak RSS {peak:.0f} MiB"
    )
    best = result.best
    print(
        f"  suggested {best.memory / 2**30:.2f} GiB {best.seconds * 1e3:.1f} ms, "
        f"{result.problem.changed(best)} changed; "
        + ", ".join(f"{n} {c.memory / 2**30:.2f} GiB {c.seconds * 1e3:.1f} ms" for n, c in fixed)
    )


if __name__ == "__main__":
    main()
