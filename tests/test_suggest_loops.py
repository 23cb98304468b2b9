"""``suggest`` proposes only what the user's training loop runs (planner.loops): the loop
inferred from the layouts ``shardlang init`` writes for each strategy, every candidate checked
against the loop by a predicate written here from what the loop holds (not by planner.loops),
and the CLI's text for a plain model at 2 MiB (tests/golden/planner_suggest_loops.txt), where
``--loop any`` reduces the gradients in backward (ZeRO-1, which a plain module does not run)
and the plain loop says no layout of its fits."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from cli.init import init_text
from planner.suggest import build_problems
from shardlang import parse_spec
from shardlang.generate import spec_for
from shardlang.layout import Layout
from tests.cli_support import no_traceback, run

GOLDEN = Path(__file__).parent / "golden" / "planner_suggest_loops.txt"
SHAPES = [
    ("embed.weight", (320, 128), "f32"),
    ("fc.weight", (320, 128), "f32"),
    ("fc.bias", (320,), "f32"),
    ("norm.weight", (320,), "f32"),
    ("lm_head.weight", (512, 192), "f32"),
]
DP = 0  # the data-parallel axis of mesh [dp=4]


def _spec(strategy: str) -> str:
    """The text ``shardlang init --strategy STRATEGY`` writes for the model over [dp=4]."""
    return init_text(spec_for(SHAPES, "world = [dp=4]", strategy), "--shapes model.json", strategy)


def _split(layout: Layout) -> set[int]:
    return {a for dim in layout.dims for a in dim}


def _runs(loop: str, param: Layout, grad: Layout, state: Layout) -> bool:
    """What each loop holds (planner.loops' module doc), said again over mesh [dp=4]."""
    pending = {a for a, _ in grad.partial}
    if loop == "plain":  # whole parameter, the rank's own gradient pending its mean
        return DP not in _split(param) and DP not in _split(grad) and pending == {DP}
    if loop == "ddp":  # whole parameter, gradient reduced by backward
        return DP not in _split(param) and DP not in _split(grad) and not pending
    assert loop == "fsdp2"  # dim 0 sharded over dp, the same for all three
    return param == grad == state and param.dims[0][-1:] == (DP,) and not pending


@pytest.mark.parametrize(
    ("strategy", "loop"), [("ddp", "plain"), ("zero2", "plain"), ("zero1", "ddp"), ("zero3", "fsdp2")]
)
def test_the_loop_is_inferred_and_every_candidate_runs_in_it(strategy: str, loop: str):
    spec = parse_spec(_spec(strategy))
    (problem, *flat) = build_problems(spec, loop="auto")
    assert problem.loop == loop
    # The flat problems run the inferred loop and say so (not "given": --loop was not).
    assert problem.loop_reason != "given"
    assert all((p.loop, p.loop_reason) == (problem.loop, problem.loop_reason) for p in flat)
    for p in (problem, *flat):
        for group in p.groups:
            for i, c in enumerate(group.candidates):
                lay = c.layouts
                assert i == group.original or _runs(loop, lay.param, lay.grad, lay.state()), (group.first.name, lay)
    assert not (flat and loop == "fsdp2")  # FSDP2's parameters are no flat chunks
    # --loop any keeps every ZeRO form, among them some this loop cannot run
    anything = build_problems(spec)[0]
    assert anything.loop == "any"
    assert any(
        not _runs(loop, c.layouts.param, c.layouts.grad, c.layouts.state())
        for g in anything.groups
        for c in g.candidates
    )


def test_layouts_of_no_one_loop_are_any():
    """A gradient reduced beside gradients pending their mean: no one loop gives both."""
    text = _spec("zero2").replace("grad  = R | P(dp):avg over world", "grad  = R over world", 1)
    assert text != _spec("zero2")
    assert build_problems(parse_spec(text), loop="auto")[0].loop == "any"


def test_suggest_on_a_plain_model_at_2mib_golden(tmp_path: Path):
    """The plain loop (inferred) refuses rather than reduce a plain module's gradients in
    backward; --loop any shows what it refused (lm_head's gradient reduced, R,R)."""
    spec = tmp_path / "plain.shard"
    spec.write_text(_spec("ddp"))
    got = []
    for loop in ("auto", "any"):
        done = run("suggest", "plain.shard", "--memory", "2MiB", "--loop", loop, cwd=tmp_path)
        no_traceback(done)
        got.append(f"$ shardlang suggest plain.shard --memory 2MiB --loop {loop}\n(exit {done.returncode})")
        got.append(re.sub(r"HiGHS, [0-9.]+ s; pricing [0-9.]+ s", "HiGHS, S s; pricing S s", done.stdout + done.stderr))
    text = "\n".join(got).rstrip() + "\n"
    refused = "lm_head.weight  (changed)\n      param = R,R over world   grad = R,R over world"
    assert refused in text.split("--loop any")[1]
    assert "param = S(" not in text.split("--loop any")[0]
    # By hand, held: whole f32 parameters, AdamW's two moments split over dp=4 (ZeRO-2: the
    # least a plain module holds) and their square roots, its buckets (the reduce-scatter's
    # results, the gathered parameters where its workspace was, its send buffer), and five
    # tensors' Python objects (planner.memory.HOST_BYTES_PER_TENSOR).
    numel = sum(math.prod(shape) for _, shape, _ in SHAPES)
    least = 4 * numel + 2 * 4 * numel // 4 + 4 * numel // 4 + (4 * numel // 4 + 4 * numel + 4 * numel) + 5 * 11_776
    assert f"the smallest budget that fits is {least} bytes" in text
    assert text == GOLDEN.read_text(), f"{GOLDEN.name}: got\n{text}"
