"""``shardlang suggest``: the integer program's choice equals brute force over every
combination of candidates (with and without the optimizers' flat sharding), always fits its
budget, and an impossible budget names the smallest one that fits. Brute force prices each
combination on its own: the whole spec's step plan (``plan_spec``, buckets unbounded, the flat
axis as the optimizers take it), the training loop's gathers and reductions planned pair by
pair, steps of one collective kind sharing one latency, and memory as ``shardlang suggest``
prints it held: ``planner.memory.predict_memory`` of the whole chosen spec (what the optimizers'
``memory_report()`` counts, tests/test_suggest_memory_dist.py), never the program's sums."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import attrs
import pytest

from cli.main import main
from planner import CostModel, plan
from planner.cost import collective_rounds
from planner.knapsack import smallest_memory, suggest, suggest_best
from planner.memory import predict_memory
from planner.spec_plan import plan_spec
from planner.suggest import SuggestError, build_problems, state_layouts
from shardlang import load_spec, parse_spec
from tests.conftest import REPO

SMALL = """
mesh world = [dp=4]  bandwidth 25e9  latency 20us
tensor a : f32[64, 24] { param = R,R over world  grad = R,R | P(dp):avg over world }
tensor b : f32[40, 30] { param = R,R over world  grad = R,R | P(dp):avg over world }
tensor c : bf16[48, 16] { param = R,R over world  grad = R,R | P(dp):avg over world }
tensor d : f32[96, 8] { param = R,R over world  grad = R,R | P(dp):avg over world }
tensor e : f32[64] { param = R over world  grad = R | P(dp):avg over world }
tensor f : bf16[36] { param = R over world  grad = R | P(dp):avg over world }
"""
TWO_AXES = """
mesh world = [dp=2, x=2]  bandwidth [25e9, 5e10]  latency [20us, 8us]
tensor a : f32[6, 24] { param = R,R over world  grad = R,R | P(dp,x):avg over world }
tensor c : f32[10] { param = R over world  grad = R | P(dp,x):avg over world }
"""
MIXED = """
mesh world = [dp=2, tp=2]  bandwidth [25e9, 3e11]  latency [20us, 3us]
tensor w : bf16[64, 32] { param = S(tp),R over world  grad = S(tp),R | P(dp):avg over world }
tensor v : f32[48, 40] { param = R,S(tp) over world  grad = R,S(tp) | P(dp):avg over world }
tensor n : f32[24] { param = R over world  grad = R | P(dp):avg over world }
"""


def _brute(problem, spec, optimizer: str) -> list[tuple[int, float, tuple]]:
    """(memory, seconds, layouts) of every combination of the problem's candidates."""
    options = [g.candidates for g in problem.groups]
    assert all(len(g.tensors) == 1 for g in problem.groups)
    flat = problem.flat_axis
    out = []
    for combo in itertools.product(*options):
        tensors = tuple(attrs.evolve(g.first, layouts=c.layouts) for g, c in zip(problem.groups, combo, strict=True))
        chosen = attrs.evolve(spec, tensors=tensors)
        step = plan_spec(chosen, bucket_bytes=2**62, flat_axis=flat).step
        seconds = step.total_seconds
        # What shardlang suggest prints as held, and the budget bounds: planner.memory's
        # prediction of the optimizer's memory_report() (checked against torch in
        # tests/test_suggest_memory_dist.py), at the bucket cap the optimizers run with.
        memory = predict_memory(chosen, optimizer, flat_axis=flat, bucket_bytes=problem.bucket_bytes).total_bytes
        loop: dict[tuple, list] = {}  # the loop's steps by the collective they share
        for before, t in zip(spec.tensors, tensors, strict=True):
            cost = CostModel.from_hints(spec.hints(t.param.mesh))
            compute = before.param  # the specs' parameters use no data-parallel axis
            if t.param != compute:  # gathered for forward and for backward
                for s in plan(t.param, compute, t.shape, t.dtype, cost).steps:
                    loop.setdefault(("forward", s.op, s.axis, s.reduce_op, t.dtype), []).append((s, cost))
            if t.grad != before.grad:  # reduced in backward
                for s in plan(before.grad, t.grad, t.shape, t.dtype, cost).steps:
                    loop.setdefault(("backward", s.op, s.axis, s.reduce_op, t.dtype), []).append((s, cost))
        for (stage, op, axis, _, _), steps in loop.items():
            if op in ("slice", "partial"):
                continue
            # one collective (the buffers are far under the cap): one latency, every step's bytes
            cost = steps[0][1]
            mesh = steps[0][0].layout.mesh
            alpha = cost.alpha if isinstance(cost.alpha, float) else cost.alpha[axis]
            latency = collective_rounds(op, mesh.shape[axis]) * alpha
            seconds += (2 if stage == "forward" else 1) * (
                sum(s.seconds for s, _ in steps) - (len(steps) - 1) * latency
            )
        out.append((memory, seconds, tuple(c.layouts for c in combo)))
    return out


@pytest.mark.parametrize(
    ("text", "optimizer", "states_only", "counts", "checked"),
    [
        # the state layouts R, S(dp) on each dim; flat over dp, one base each
        (SMALL, "adamw", True, [[2, 2, 3, 3, 3, 3], [1, 1, 1, 1, 1, 1]], slice(0, 2)),
        # and the ZeRO-1 and ZeRO-3 forms; flat over dp
        (MIXED, "came", False, [[5, 8, 8], [2, 2, 2]], slice(0, 2)),
        # flat over dp: states of distinct bases (x on no dim or any one), ZeRO-1 and ZeRO-2 forms
        # (brute force over the flat problem only: the plain one has 286 combinations)
        (TWO_AXES, "adamw", False, [[11, 26], [4, 6], [4, 6]], slice(1, 2)),
    ],
)
def test_suggest_equals_brute_force_and_fits(
    text: str, optimizer: str, states_only: bool, counts: list, checked: slice
) -> None:
    spec = parse_spec(text)
    problems = build_problems(spec, optimizer, states_only=states_only)[checked.start :]
    assert [p.flat_axis for p in problems] == [None, "dp", "x"][checked.start : len(counts)]
    assert [sorted(len(g.candidates) for g in p.groups) for p in problems] == counts[checked.start :]
    problems = problems[: checked.stop - checked.start]
    everything = [(m, s, lay, p) for p in problems for m, s, lay in _brute(p, spec, optimizer)]
    memories = sorted({m for m, _, _, _ in everything})
    for p in problems:  # the least memory, found without the solver
        assert smallest_memory(p).memory == min(m for m, _, _, q in everything if q is p)
    sample = memories[:: max(1, len(memories) // 8)]
    for budget in [memories[0], *sample, memories[len(memories) // 2] + 1, memories[-1]]:
        fitting = [s for m, s, _, _ in everything if m <= budget]
        result = suggest_best(problems, budget)
        layouts = tuple(t.layouts for t in result.spec().tensors)
        (mine,) = [(m, s) for m, s, lay, p in everything if lay == layouts and p is result.problem]
        # What the command prints as held is the brute force's, within the budget.
        assert mine[0] <= budget and result.best.memory == mine[0]
        assert result.problem.prediction(result.best.picks).total_bytes == mine[0]
        assert math.isclose(mine[1], min(fitting), rel_tol=1e-9), (budget, mine, min(fitting))
        assert math.isclose(result.best.seconds, mine[1], rel_tol=1e-9)
    with pytest.raises(SuggestError, match=f"the smallest budget that fits is {memories[0]} bytes"):
        suggest_best(problems, memories[0] - 1)
    with pytest.raises(SuggestError, match="the smallest budget that fits is"):
        suggest(problems[0], memories[0] - 1)


def test_the_command_text_json_output_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mixed.shard"
    path.write_text(MIXED)
    out = tmp_path / "chosen.shard"
    plot = str(tmp_path / "f.svg")
    assert main(["suggest", str(path), "--memory", "52KiB", "--loop", "any", "-o", str(out), "--plot", plot]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "loop: any (--loop)"  # every ZeRO form, ZeRO-3 among them (tests/test_suggest_loops.py)
    # By hand: w holds 2 KiB of bf16 per rank under S(tp), v 3.75 KiB of f32 under S(tp); DDP
    # keeps both moments (and w's f32 master) whole, and its bucket buffers all its gradients.
    # Times, 20 us a round on dp (2 ranks), bytes over 25 GB/s about 0.2 us: one collective per
    # kind and wire dtype (bf16 for w, f32 for v and n), so DDP and ZeRO-2 pay 2 x 40 us (an
    # all-reduce, 2 rounds) or 2 x (20 + 20) us; ZeRO-1 and ZeRO-3 2 x (40 + 20) us: the loop's
    # all-reduce (ZeRO-1) or gathers for forward and backward and a reduce-scatter (ZeRO-3).
    # ZeRO-3 on every tensor is the one choice within 52 KiB held; ties go to less memory, so
    # not ZeRO-2 for n (same time, its bucket buffers more), and between equal candidates (dp
    # on either dim, no piece padded) to the first, dp on the outer dim.
    assert lines[3:] == [
        "chosen layouts:",
        "  w  (changed)",
        "      param = S(tp,dp),R over world   grad = S(tp,dp),R over world   state = S(tp,dp),R over world",
        "  v  (changed)",
        "      param = S(dp),S(tp) over world   grad = S(dp),S(tp) over world   state = S(dp),S(tp) over world",
        "  n  (changed)",
        "      param = S(dp) over world   grad = S(dp) over world   state = S(dp) over world",
        "",
        "suggested: 51.2 KiB per rank, 120 us modeled; 3 of 3 tensors changed",
        # By hand, on the first rank: pieces of 512 (w, bf16), 480 and 12 floats; the two moments
        # and w's f32 master; no bucket (ZeRO-3 steps in place); the square roots of all three
        # shards at once (1004 floats); three tensors' Python objects (11.5 KiB each,
        # planner.memory.HOST_BYTES_PER_TENSOR). The loop's gathered parameters are not the optimizer's.
        "held as the runtime counts it (memory_report()'s kinds; the budget bounds it): params 2.92 KiB + "
        "states 7.84 KiB + masters 2 KiB + scratch 3.92 KiB + host 34.5 KiB = 51.2 KiB per rank",
        "",
        "  strategy        memory/rank  modeled time  fits  time vs suggested",
        "  this spec          73.7 KiB       80.2 us    no  0.667x",
        "  ddp                73.7 KiB       80.2 us    no  0.667x",
        "  zero1                60 KiB        120 us    no  1.000x",
        "  zero2              68.7 KiB       80.2 us    no  0.667x",
        "  zero3              51.2 KiB        120 us   yes  1.000x",
        # flat chunks of unpadded pieces: ZeRO-1 and ZeRO-2's memory and time
        "  zero1 flat dp        60 KiB        120 us    no  1.000x",
        "  zero2 flat dp      68.7 KiB       80.2 us    no  0.667x",
        "best fixed strategy that fits: zero3, 1.000x the suggested time",
        "modeled time: buckets of at most 32 MiB (as `shardlang plan`), the training loop's too; ties: less memory, "
        "then fewer changes",
        lines[-1],
    ]
    assert lines[-1].startswith("solved: optimal (HiGHS, ") and lines[-1].endswith("2 problems: plain, flat over dp)")
    assert main(["check", str(out)]) == 0
    assert "<polyline" in (tmp_path / "f.svg").read_text()
    capsys.readouterr()
    assert main(["suggest", str(path), "--memory", "1MiB", "--format", "json", "--optimizer", "came"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["suggested"]["memory_bytes"] <= 2**20 and data["optimal"] and len(data["tensors"]) == 3
    assert main(["suggest", str(path), "--memory", "1KiB"]) == 1
    assert "the smallest budget that fits is" in capsys.readouterr().err


def _uneven(tmp_path: Path, *tensors: str) -> Path:
    """``uneven.shard``: the ``tensors`` (a line each) on [dp=4] at 25 GB/s and 20 us."""
    path = tmp_path / "uneven.shard"
    path.write_text("mesh world = [dp=4]  bandwidth 25e9  latency 20us\n" + "".join(f"{t}\n" for t in tensors))
    return path


def test_the_main_job_says_what_suggest_would_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # States split over dim 0 (6 rows on 4 ranks: pieces padded to 2 rows) cost more than over dim 1.
    path = _uneven(
        tmp_path,
        "tensor t : f32[6, 65536] { param = R,R over world  grad = R,R | P(dp):avg over world "
        "state = S(dp),R over world }",
    )
    assert main([str(path)]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("suggest:")]
    assert line == (
        "suggest: within this spec's own 7.51 MiB per rank (AdamW), `shardlang suggest` would change the layouts of "
        "1 of 1 tensors: 246 us -> 214 us modeled (12.8% less)"
    )


def test_state_candidates_put_each_data_parallel_axis_on_any_dim_or_none() -> None:
    spec = parse_spec("mesh m = [dp=2, tp=2, x=2]\ntensor t : f32[4, 4] { param = S(tp),R over m }")
    compute = spec.tensor("t").param
    layouts = state_layouts(compute, (0, 2))
    assert len(set(layouts)) == 3 * 3 and layouts[0] == compute  # dp and x: no dim, dim 0 or dim 1 each
    for layout in layouts:
        assert [tuple(a for a in d if a == 1) for d in layout.dims] == [(1,), ()]  # tp stays, outermost
        assert layout.dims[0][:1] == (1,)


def test_tensors_a_rule_matches_are_chosen_for_and_declared(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    llama = str(REPO / "examples" / "llama7b_dp4_tp8.shard")
    norms = ["--tensor", "model.layers.{0..31}.{input,post_attention}_layernorm.weight:4096:bf16"]
    norms += ["--tensor", "model.norm.weight:4096:bf16"]
    out = tmp_path / "chosen.shard"
    assert main(["suggest", llama, "--memory", "24GiB", "--format", "json", "-o", str(out), *norms]) == 0
    data = json.loads(capsys.readouterr().out)
    assert main(["suggest", llama, "--memory", "24GiB", "--format", "json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert len(data["tensors"]) == len(alone["tensors"]) + 65
    # The norms' parameters and gradients are counted: 65 x 4096 bf16 each, at least 1/4 of it per rank.
    assert data["suggested"]["memory_bytes"] >= alone["suggested"]["memory_bytes"] + 2 * 65 * 4096 * 2 // 4
    written = load_spec(out)
    assert written.tensor("model.layers.7.input_layernorm.weight").shape == (4096,)
    assert written.rules == load_spec(llama).rules  # kept for tensors not named
    assert main(["check", str(out)]) == 0
    capsys.readouterr()
    # The same names from a shapes file; a name no rule matches is an error naming it.
    shapes = tmp_path / "shapes.json"
    shapes.write_text(
        json.dumps(
            [
                [f"model.layers.{i}.{k}_layernorm.weight", [4096], "bf16"]
                for i in range(32)
                for k in ("input", "post_attention")
            ]
            + [["model.norm.weight", [4096], "bf16"]]
        )
    )
    assert main(["suggest", llama, "--memory", "24GiB", "--format", "json", "--shapes", str(shapes)]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == data["tensors"]
    assert main(["suggest", llama, "--memory", "24GiB", "--tensor", "model.bias:8"]) == 1
    assert "tensor 'model.bias' is not declared and no rule matches it" in capsys.readouterr().err


def test_flat_over_dp_is_offered_where_other_axes_split_the_blocks() -> None:
    # On dp=4, tp=8 the flat hops of a tp-split tensor stay among the ranks holding its block
    # (planner.legs.flat_group), so flat over dp is a problem of its own beside the plain one.
    problems = build_problems(load_spec(REPO / "examples" / "llama7b_dp4_tp8.shard"))
    assert [p.flat_axis for p in problems] == [None, "dp"]


def test_flat_wins_where_pieces_are_padded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _uneven(
        tmp_path,
        "tensor t : f32[6, 10] { param = R,R over world  grad = R,R | P(dp):avg over world }",
        "tensor u : f32[7] { param = R over world  grad = R | P(dp):avg over world }",
    )
    out = tmp_path / "flat.shard"
    budget = ["--memory", "24636", "--loop", "any", "--states-only"]
    assert main(["suggest", str(path), *budget, "-o", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    # By hand, held on the first rank: t's param 240 B, u's 28 B, and both tensors' Python
    # objects (2 x 11,776 B, planner.memory.HOST_BYTES_PER_TENSOR). ZeRO-2 splits t's 10 columns
    # into pieces of 3 (AdamW's two moments: 2 x 18 floats, 144 B) and u's 7 into 2 (16 B), the
    # square roots of both shards (20 floats, 80 B) and its buckets: the reduce-scatter's result
    # (80 B), the gathered parameters (4 x 20 floats, 320 B), in the place of the reduce-scatter's
    # workspace (320 B), and its send buffer (320 B): 24,780 B. Flat chunks are 60 / 4 = 15
    # floats and 2: moments 120 + 16 B, square roots 68 B, buckets 68 + 272 + 272 B: 24,636 B.
    assert lines[9] == (
        "suggested: 24.1 KiB per rank, 120 us modeled, states flat over dp (the optimizers' flat_axis); "
        "0 of 2 tensors changed"
    )
    held = "params 268 B + states 136 B + buffers 612 B + scratch 68 B + host 23 KiB = 24.1 KiB per rank"
    assert lines[10].endswith(held)
    assert lines[13:21] == [
        # DDP: the moments (536 B) and square roots (268 B) whole, the all-reduce's buffer (272 B)
        "  this spec          24.3 KiB        120 us    no  1.000x",
        "  ddp                24.3 KiB        120 us    no  1.000x",
        "  zero1           (not a candidate of every tensor in this loop)",
        "  zero2              24.2 KiB        120 us    no  1.000x",
        "  zero3           (not a candidate of every tensor in this loop)",
        "  zero1 flat dp   (not a candidate of every tensor in this loop)",
        "  zero2 flat dp      24.1 KiB        120 us   yes  1.000x",
        "best fixed strategy that fits: zero2 flat dp, 1.000x the suggested time",
    ]
    assert main(["suggest", str(path), *budget[:1], "24635", *budget[2:]]) == 1  # a byte less: none fits
    assert "the smallest budget that fits is 24636 bytes" in capsys.readouterr().err
    text = out.read_text()
    assert "# Flat sharding: run the optimizers with flat_axis='dp'" in text
    assert load_spec(out).tensors == parse_spec(path.read_text()).tensors  # the same layouts, run flat
    assert main(["check", "--flat-axis", "dp", str(out)]) == 0
