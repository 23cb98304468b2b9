"""Does the training step regress? ``bench_step.py`` on this tree and on an earlier commit, in turns.

    .venv/bin/python bench/bench_step_pair.py                        # against BEFORE, 2 rounds
    .venv/bin/python bench/bench_step_pair.py --before HEAD~5 --rounds 3 --models small
    .venv/bin/python bench/bench_step_pair.py --json docs/benchmarks/data/step_pair.json

One ``bench_step.py`` run measures its variants' ratios to DDP within itself; two runs made at
different hours on this shared 2-core machine differ by more than the changes worth knowing
about (a ratio moves by 0.05-0.3 with the load). So this script checks the earlier commit out
into a temporary git worktree and runs ``bench/bench_step.py --json`` there and here in turns,
``--rounds`` times (before, after, before, after, ...), with the same interpreter, variants and
models, and reports each variant's ratio per run and the median per side: the train step's ratio
to DDP + AdamW and ``optimizer.step()`` alone's ratio to its flat all-reduce reference (see
``bench_step.py`` for what each measures). A change is worth reading only where the two sides'
runs do not overlap.

``BEFORE`` is the commit before the optimizers updated in place behind an early commit point
(the memory work, docs/memory.md): the step as it was when its memory was first measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import results as bench_results

REPO = Path(__file__).resolve().parent.parent
BEFORE = "8d5b969^"
VARIANTS = "ddp,sharded,sharded-flat,sharded-overlap"


def run_step_bench(tree: Path, options: list[str], out: Path, timeout: float) -> dict[str, Any]:
    """``bench/bench_step.py OPTIONS`` of ``tree`` run in ``tree``, its JSON report's models."""
    command = [sys.executable, "bench/bench_step.py", *options, "--json", str(out)]
    env = os.environ | {"PYTHONPATH": str(tree)}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        sys.exit(f"bench_step.py in {tree} failed (rc {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    report = json.loads(out.read_text())
    return report.get("data", report)["models"]  # earlier versions wrote the report bare


def ratios(models: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    """(model, section, variant) -> the ratio the run measured."""
    found = {}
    for model, result in models.items():
        for key, row in result["train"].items():
            if key != "ddp" and row.get("ratio_to_ddp") is not None:
                found[(model, "train step x DDP", key)] = row["ratio_to_ddp"]
        for key, row in result.get("step_alone", {}).items():
            if not key.endswith("-ref"):
                found[(model, "step() alone x reference", key)] = row["ratio_to_reference"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=BEFORE, help=f"the earlier commit (default {BEFORE})")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side, in turns (default 2)")
    parser.add_argument("--models", default="small,medium")
    parser.add_argument("--variants", default=VARIANTS, help=f"bench_step.py's (default {VARIANTS})")
    parser.add_argument("--steps", type=int, default=None, help="bench_step.py's --steps (default: its own)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per bench_step.py run")
    bench_results.add_json_option(parser)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    before = subprocess.run(
        ["git", "rev-parse", "--verify", args.before + "^{commit}"], cwd=REPO, capture_output=True, text=True
    )
    if before.returncode != 0:
        parser.error(f"--before {args.before}: not a commit of {REPO}")
    commit = before.stdout.strip()
    options = ["--models", args.models, "--variants", args.variants]
    options += [] if args.steps is None else ["--steps", str(args.steps)]
    runs: dict[str, list[dict[tuple[str, str, str], float]]] = {"before": [], "after": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_step_pair_") as scratch:
        earlier = Path(scratch) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(earlier), commit], cwd=REPO, check=True,
                       capture_output=True)  # fmt: skip
        try:
            for k in range(args.rounds):
                for side, tree in (("before", earlier), ("after", REPO)):
                    out = Path(scratch) / f"{side}{k}.json"
                    runs[side].append(ratios(run_step_bench(tree, options, out, args.timeout)))
                    print(f"round {k + 1}, {side}: done at {time.perf_counter() - started:.0f} s", file=sys.stderr)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(earlier)], cwd=REPO, capture_output=True)
    keys = sorted(set().union(*runs["before"]) & set().union(*runs["after"]))
    with bench_results.printed() as shown:
        print(
            f"**Training step, {commit[:7]} ({args.before}) against this tree** (runs of "
            f"`bench_step.py {' '.join(options)}`, {args.rounds} per side, in turns; ratios as each run "
            "measured them; median per side):\n"
        )
        print("| model | measure | variant | before, each run | after, each run | before | after | after / before |")
        print("|---|---|---|---|---|---|---|---|")
        for key in keys:
            b = [r[key] for r in runs["before"] if key in r]
            a = [r[key] for r in runs["after"] if key in r]
            mb, ma = statistics.median(b), statistics.median(a)
            each_b, each_a = (", ".join(f"{x:.2f}" for x in side) for side in (b, a))
            print(f"| {' | '.join(key)} | {each_b} | {each_a} | {mb:.2f} | {ma:.2f} | {ma / mb:.2f} |")
        print(f"\n{time.perf_counter() - started:.0f} s in all")
    listed = {side: [[[*k, v] for k, v in sorted(r.items())] for r in rs] for side, rs in runs.items()}
    data = {"before": commit, "rounds": args.rounds, "options": options, "runs": listed}
    tables = bench_results.markdown_tables(shown.getvalue())
    bench_results.write(args.json, "Training step against an earlier commit", tables, data=data)


if __name__ == "__main__":
    main()
