"""``shardlang suggest`` on examples/llama7b_dp4_tp8.shard: solve time, and the modeled step
time against the best fixed strategy that fits, at budgets from ZeRO-3's memory to DDP's.

    .venv/bin/python bench/bench_suggest.py [--spec examples/llama7b_dp4_tp8.shard] [--points 12]
        [--optimizer adamw|came] [--repeat 3]

Candidates are priced once (``pricing``); each budget is then solved ``--repeat`` times and
the best time kept (a shared machine's other processes stay out of the number). ``ratio`` is
the suggested time over the best fixed strategy's that fits (ddp, zero1, zero2, zero3): never
above 1, since every fixed strategy is one of the choices.
"""

from __future__ import annotations

import argparse
import time

from planner.knapsack import suggest
from planner.suggest import STRATEGY_NAMES, build_problem
from shardlang import load_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="examples/llama7b_dp4_tp8.shard")
    parser.add_argument("--points", type=int, default=12)
    parser.add_argument("--optimizer", choices=("adamw", "came"), default="adamw")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    started = time.perf_counter()
    problem = build_problem(load_spec(args.spec), args.optimizer)
    pricing = time.perf_counter() - started
    fixed = {name: problem.strategy(name) for name in STRATEGY_NAMES}
    low, high = fixed["zero3"].memory, fixed["ddp"].memory
    n = sum(len(g.tensors) for g in problem.groups)
    print(f"{args.spec}: {n} tensors in {len(problem.groups)} groups, {args.optimizer}; pricing {pricing:.2f} s")
    print("  " + ", ".join(f"{k} {c.memory / 2**30:.2f} GiB {c.seconds * 1e3:.1f} ms" for k, c in fixed.items()))
    heads = ("budget GiB", "solve s", "suggested ms", "best fixed", "fixed ms")
    print("  ".join(f"{h:>{w}}" for h, w in zip(heads, (10, 7, 12, 10, 8), strict=True)) + "  ratio  optimal")
    for k in range(args.points):
        budget = round(low + (high - low) * k / (args.points - 1))
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            result = suggest(problem, budget)
            times.append(time.perf_counter() - t)
        fitting = [(c.seconds, name) for name, c in fixed.items() if c.memory <= budget]
        seconds, name = min(fitting)
        ratio = result.best.seconds / seconds
        print(
            f"{budget / 2**30:>10.2f}  {min(times):>7.3f}  {result.best.seconds * 1e3:>12.2f}  {name:>10}  "
            f"{seconds * 1e3:>8.2f}  {ratio:.3f}  {result.optimal}"
        )


if __name__ == "__main__":
    main()
