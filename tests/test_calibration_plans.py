"""Plans priced by calibrated figures: a hints file steers the plan, the step overhead, the copy,
the choice margin and large-message regimes price and choose plans as the brute force of
tests/test_planner_optimal.py does, and a hints file with bad values is a clear error naming the
file and the field."""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction
from pathlib import Path

import attrs
import pytest

import planner
from cli.main import main
from cli.plan_report import describe_plan_cost
from planner.spec_plan import plan_spec
from shardlang import Layout, Mesh, parse_layout, parse_spec
from tests.overhead_reference import ReferenceWithOverhead, assert_brute_force_optimal
from tests.test_planner_optimal import Reference, calibrated_looking, random_case, reference_for


def test_a_hints_file_round_trips_and_steers_the_plan(tmp_path):
    model = planner.CostModel(
        alpha=(2e-5, 3e-5),
        bandwidth=(1e9, 2e9),
        ops={"all_reduce": {"alpha": (2e-6, 2e-6), "bandwidth": (5e11, 5e11)}},
    )
    path = tmp_path / "hints.json"
    path.write_text(json.dumps({"mesh": "world = [dp=2, tp=2]", **model.to_json()}))
    assert planner.CostModel.from_file(path) == model
    src = Layout(((), ()), Mesh((2, 2)), ((0, "sum"), (1, "sum")))
    dst = Layout(((), ()), Mesh((2, 2)))
    assert [s.op for s in planner.plan(src, dst, (1024, 64), "f32").steps] == [
        "reduce_scatter",
        "all_reduce",
        "all_gather",
    ]
    measured = planner.plan(src, dst, (1024, 64), "f32", planner.CostModel.from_file(path))
    assert [s.op for s in measured.steps] == ["all_reduce"] * 2
    # The model travels with the plan: its JSON and repr read back equal.
    assert planner.Plan.from_json(json.loads(json.dumps(measured.to_json()))) == measured
    assert eval(repr(model), vars(planner)) == model


def _plan_refuses_hints(tmp_path, capsys, content: str) -> tuple[Path, str]:
    """``shardlang plan --costs`` of a hints file holding ``content``: it exits 1 without a
    traceback; the file and what the command wrote to stderr."""
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert main(["plan", "S0 over mesh[2]", "R over mesh[2]", "--shape", "8", "--costs", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return path, err


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ('{"alpha": -1}', "field 'alpha': expected zero or a positive number of seconds, got -1"),
        ('{"bandwidth": [1e9, 0]}', "field 'bandwidth[1]': expected a positive number of bytes per second, got 0"),
        ('{"ops": {"all_reduce": {"bandwidth": "fast"}}}', "field 'ops.all_reduce.bandwidth': expected a number"),
        ('{"ops": {"allreduce": {}}}', "field 'ops.allreduce': no such collective kind"),
        ('{"ops": {"all_gather": {"beta": 1}}}', "field 'ops.all_gather.beta': unknown"),
        ('{"latency": 1}', "unknown field 'latency'"),
        ('{"alpha": [1e-5, 1e-5], "ops": {"all_gather": {"alpha": [1e-5]}}}', "per-axis lists of different lengths"),
        ('{"alpha": 1e-5,}', ":1:16: not JSON"),
    ],
)
def test_a_bad_hints_file_names_the_file_and_field(tmp_path, capsys, content, field):
    path, err = _plan_refuses_hints(tmp_path, capsys, content)
    assert f"{path}" in err and field in err


def test_the_step_plan_uses_the_given_model():
    """``plan_spec(cost=...)``: the step's buckets are planned and priced by the given model's
    per-kind figures instead of the spec's hints."""
    spec = parse_spec(
        "mesh world = [dp=2, tp=2]  bandwidth [25e9, 300e9]  latency [10us, 2us]\n"
        "tensor w : f32[64, 32] { param = R,R over world  grad = R,R | P(dp):sum over world  "
        "state = S(dp),R over world }\n"
    )
    hinted = plan_spec(spec).step.buckets
    assert [(b.op, b.axis, b.bytes) for b in hinted] == [("reduce_scatter", 0, 4096), ("all_gather", 0, 4096)]
    assert hinted[0].seconds == pytest.approx(1e-5 + 4096 / 25e9)
    # A dear reduce_scatter: the grad is all-reduced instead, priced by the model's own figures.
    model = planner.CostModel(ops={"reduce_scatter": {"alpha": 3e-4, "bandwidth": 1e8}})
    measured = plan_spec(spec, cost=model).step.buckets
    assert [(b.op, b.axis, b.bytes) for b in measured] == [("all_reduce", 0, 8192), ("all_gather", 0, 4096)]
    assert measured[0].seconds == pytest.approx(2 * 5e-6 + 8192 / 1e11)


def test_a_cross_mesh_plan_prices_and_describes_messages_by_the_point_to_point_figures():
    model = planner.CostModel(ops={"point_to_point": {"alpha": 2e-5, "bandwidth": 1e9}})
    src, dst = Layout(((0,), (1,)), Mesh((2, 2))), Layout(((0,), ()), Mesh((4,), ranks=(4, 5, 6, 7)))
    got = planner.plan(src, dst, (1000, 300), "f32", model)
    (step,) = got.steps
    # Each target rank holds 250 rows and receives them from the two ranks holding its columns,
    # two messages of 250 x 150 f32 on 1 GB/s links.
    assert step.bytes == 250 * 300 * 4 and step.seconds == pytest.approx(2 * 2e-5 + 250 * 300 * 4 / 1e9)
    text = describe_plan_cost(got)
    assert text.endswith("between the meshes the slowest of both: 1 GB/s, 20 us per message")


def test_plans_are_priced_with_the_overhead_and_the_copy():
    """By hand: every step pays the overhead; only a plan that sends nothing pays the copy of
    its target piece; a cross-mesh point-to-point step pays the overhead once, and its copies."""
    model = planner.CostModel(alpha=2e-5, bandwidth=1e9, overhead=1e-4, copy_bandwidth=4e9)
    mesh = "over mesh[4]"
    sliced = planner.plan(parse_layout(f"R,R {mesh}"), parse_layout(f"S0,R {mesh}"), (1000, 300), "f32", model)
    assert [s.op for s in sliced.steps] == ["slice"]
    assert sliced.total_seconds == pytest.approx(1e-4 + 250 * 300 * 4 / 4e9)
    gathered = planner.plan(parse_layout(f"S0,R {mesh}"), parse_layout(f"R,R {mesh}"), (1000, 300), "f32", model)
    assert gathered.total_seconds == pytest.approx(1e-4 + 3 * 2e-5 + 3 * 250 * 300 * 4 / 1e9)
    src, dst = Layout(((0,), (1,)), Mesh((2, 2))), Layout(((0,), ()), Mesh((4,), ranks=(4, 5, 6, 7)))
    (step,) = planner.plan(src, dst, (1000, 300), "f32", model).steps
    # Each target rank receives two 250x150 halves of its 250x300 rows: not runs of its piece,
    # so both are placed (copied); each sender's rows are runs of its piece, sent in place.
    assert step.seconds == pytest.approx(1e-4 + 2 * 2e-5 + 250 * 300 * 4 / 1e9 + 250 * 300 * 4 / 4e9)
    # The terms travel with the plan: its JSON and the model's repr read back equal.
    assert planner.Plan.from_json(json.loads(json.dumps(sliced.to_json()))) == sliced
    assert eval(repr(model), vars(planner)) == model
    # The default model's terms are free: the conformance data's costs are unchanged.
    free = planner.plan(parse_layout(f"R,R {mesh}"), parse_layout(f"S0,R {mesh}"), (1000, 300), "f32")
    assert free.total_seconds == 0


def test_the_overhead_steers_the_plan_to_fewer_steps():
    """``R,R | P01 -> R,R`` on [2,2]: three steps (reduce_scatter, all_reduce, all_gather) send
    less than two all-reduces; a large enough overhead per step makes the two cheaper."""
    src, dst = parse_layout("R,R | P01 over mesh[2,2]"), parse_layout("R,R over mesh[2,2]")
    # By the table, of a 64 KiB piece: the three steps send 32 + 32 + 32 KiB in 1 + 2 + 1
    # rounds, the two all-reduces 64 + 64 KiB in 2 + 2: 32 KiB more at 1 GB/s (32.8 us) in as
    # many rounds. One step more costs the three an overhead more: at 30 us they still win,
    # at 35 us the two do.
    shape = (2048, 8)
    steps = {
        overhead: [
            s.op
            for s in planner.plan(src, dst, shape, "f32", planner.CostModel(bandwidth=1e9, overhead=overhead)).steps
        ]
        for overhead in (3e-5, 3.5e-5)
    }
    assert steps == {3e-5: ["reduce_scatter", "all_reduce", "all_gather"], 3.5e-5: ["all_reduce", "all_reduce"]}


@pytest.mark.parametrize("seed", range(2))
def test_plans_are_optimal_with_a_step_overhead(seed):
    """The planner (its bound, its pruning rules, the fewer-steps tie rule) finds the optimum
    of the brute force when every step also pays an overhead."""
    rng = random.Random(700 + seed)
    for _ in range(250):
        src, dst, shape, dtype, _ = random_case(rng, naxes=rng.choice((1, 2, 2, 3)))
        base = calibrated_looking(rng, src.mesh.ndim)
        cost = attrs.evolve(base, overhead=rng.choice((1e-6, 3e-5, 1e-4, 1e-3)))
        ref = ReferenceWithOverhead(reference_for(src, dst, shape, dtype, base), cost.overhead)
        assert_brute_force_optimal(ref, planner.plan(src, dst, shape, dtype, cost), cost)


def test_the_margin_decides_near_ties_and_is_no_time():
    """``R,R | P0 -> R,R`` on [4] of 1000x256 f32, every kind at 100 us a round and 1 GB/s but
    all_reduce at 150 us a round: by the table the all_reduce costs 6 * 150 us and the
    reduce_scatter and all_gather 3 * 100 + 3 * 100 us, and both send 1,536,000 bytes (1.536 ms)
    in all, so the pair is 0.3 ms cheaper for one step more. A margin under 0.3 ms a step keeps the
    pair, one over it takes the all_reduce; the predicted times leave the margin out."""
    src, dst = parse_layout("R,R | P0 over mesh[4]"), parse_layout("R,R over mesh[4]")
    ops = {"all_reduce": {"alpha": 1.5e-4, "bandwidth": 1e9}}
    chosen = {}
    for margin in (2.9e-4, 3.1e-4):
        model = planner.CostModel(alpha=1e-4, bandwidth=1e9, ops=ops, margin=margin)
        plan = planner.plan(src, dst, (1000, 256), "f32", model)
        chosen[margin] = ([s.op for s in plan.steps], plan.total_seconds)
    assert chosen[2.9e-4][0] == ["reduce_scatter", "all_gather"]
    assert chosen[2.9e-4][1] == pytest.approx(6 * 1e-4 + 1.536e-3)
    assert chosen[3.1e-4][0] == ["all_reduce"]
    assert chosen[3.1e-4][1] == pytest.approx(6 * 1.5e-4 + 1.536e-3)
    # The margin travels with the model: its hints JSON, the plan's JSON and its repr read back.
    model = planner.CostModel(alpha=1e-4, bandwidth=1e9, ops=ops, margin=3.1e-4)
    assert planner.CostModel.from_json(json.loads(json.dumps(model.to_json()))) == model
    plan = planner.plan(src, dst, (1000, 256), "f32", model)
    assert planner.Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    assert eval(repr(model), vars(planner)) == model


def test_the_plan_command_says_it_chose_with_a_margin(tmp_path, capsys):
    """The near tie above from a hints file: ``shardlang plan`` takes the all_reduce and says
    under the table that a margin chose it, which its times leave out; without one, it says
    nothing of a margin."""
    hints = {"alpha": 1e-4, "bandwidth": 1e9, "ops": {"all_reduce": {"alpha": 1.5e-4, "bandwidth": 1e9}}}
    pair = ["plan", "R,R | P0 over mesh[4]", "R,R over mesh[4]", "--shape", "1000x256", "--costs"]
    outputs = []
    for extra in ({"margin": 3.1e-4}, {}):
        path = tmp_path / f"hints{len(extra)}.json"
        path.write_text(json.dumps({**hints, **extra}))
        assert main([*pair, str(path)]) == 0
        outputs.append(capsys.readouterr().out.splitlines())
    with_margin, without = outputs
    assert with_margin[3].split()[:2] == ["1", "all_reduce"] and with_margin[4].split()[-2:] == ["2.44", "ms"]
    assert with_margin[-1] == (
        "  chosen with a margin of 310 us a step, not in the times: "
        "a plan of more steps wins only by more than that for each step it adds"
    )
    assert [line.split()[1] for line in without[3:5]] == ["reduce_scatter", "all_gather"]
    assert not any("margin" in line for line in without)


@pytest.mark.parametrize("seed", range(2))
def test_plans_are_optimal_with_a_margin(seed):
    """With a margin, the planner's plan is the brute force's optimum when every step pays the
    overhead and the margin, and its predicted time is the brute force's time of that plan with
    the overhead alone."""
    rng = random.Random(900 + seed)
    for _ in range(150):
        src, dst, shape, dtype, _ = random_case(rng, naxes=rng.choice((1, 2, 2, 3)))
        base = calibrated_looking(rng, src.mesh.ndim)
        cost = attrs.evolve(base, overhead=rng.choice((0.0, 1e-4)), margin=rng.choice((3e-5, 3e-4, 3e-3)))
        got = planner.plan(src, dst, shape, dtype, cost)
        reference = reference_for(src, dst, shape, dtype, base)
        chooses = ReferenceWithOverhead(reference, cost.overhead + cost.margin)
        want = chooses.solve(chooses.state_of(src), chooses.state_of(dst), len(got.steps) + 3)
        assert (chooses.replay(got, check_seconds=False), len(got.steps)) == want, f"{src} -> {dst}, {shape}, {cost}"
        priced = ReferenceWithOverhead(reference, cost.overhead)  # checks every step's seconds
        assert got.total_seconds == pytest.approx(priced.replay(got) / priced.scale, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ('{"overhead": -1}', "field 'overhead': expected zero or a positive number of seconds, got -1"),
        ('{"overhead": [1e-4, 1e-4]}', "field 'overhead': expected one number"),
        ('{"copy_bandwidth": 0}', "field 'copy_bandwidth': expected a positive number of bytes per second, got 0"),
        ('{"copy_bandwidth": "fast"}', "field 'copy_bandwidth': expected a number"),
        ('{"margin": -1e-4}', "field 'margin': expected zero or a positive number of seconds, got -0.0001"),
        ('{"margin": [1e-4]}', "field 'margin': expected one number"),
    ],
)
def test_bad_executor_terms_name_the_file_and_field(tmp_path, capsys, content, field):
    path, err = _plan_refuses_hints(tmp_path, capsys, content)
    assert f"{path}: {field}" in err


def test_each_step_is_priced_by_the_regime_of_its_bytes(tmp_path):
    """``R,R | P01 -> R,R`` on [2,2], all kinds at 100 us a round and 1 GB/s, all_reduce 4 GB/s
    from 4 MiB. By hand, of 2 MiB f32 (a 2 MiB all_reduce per axis, or 1 MiB steps): the two
    all_reduces cost 2 * (0.2 + 2.097) ms, the reduce_scatter, all_reduce and all_gather
    (0.1 + 1.049) * 2 + (0.2 + 1.049) ms, less. Of 8 MiB: the two all_reduces are large,
    2 * (0.2 + 2.097) ms, and the three 4.294 + 1.249 + 4.294 ms."""
    large = {"from_bytes": 4 * 2**20, "alpha": 1e-4, "bandwidth": 4e9}
    model = planner.CostModel(
        alpha=1e-4, bandwidth=1e9, ops={"all_reduce": {"alpha": 1e-4, "bandwidth": 1e9, "large": large}}
    )
    src, dst = parse_layout("R,R | P01 over mesh[2,2]"), parse_layout("R,R over mesh[2,2]")
    small = planner.plan(src, dst, (512, 1024), "f32", model)
    assert [s.op for s in small.steps] == ["reduce_scatter", "all_reduce", "all_gather"]
    assert small.total_seconds == pytest.approx(2 * (1e-4 + 2**20 / 1e9) + 2e-4 + 2**20 / 1e9)
    big = planner.plan(src, dst, (2048, 1024), "f32", model)
    assert [s.op for s in big.steps] == ["all_reduce", "all_reduce"]
    assert [s.seconds for s in big.steps] == pytest.approx([2e-4 + 8 * 2**20 / 4e9] * 2)
    # Without the regime the three steps are the cheaper at 8 MiB too.
    line = attrs.evolve(model, ops=[planner.OpCost("all_reduce", 1e-4, 1e9)])
    assert len(planner.plan(src, dst, (2048, 1024), "f32", line).steps) == 3
    # The regime travels with the model: the hints file, the plan's JSON and the repr read back equal.
    path = tmp_path / "hints.json"
    path.write_text(json.dumps(model.to_json()))
    assert planner.CostModel.from_file(path) == model
    assert planner.Plan.from_json(json.loads(json.dumps(big.to_json()))) == big
    assert eval(repr(model), vars(planner)) == model
    assert "all_reduce, large messages: every axis: from 4 MiB, 4 GB/s, 100 us per round" in describe_plan_cost(big)


class _ReferenceWithRegimes(Reference):
    """The brute force of tests/test_planner_optimal.py, each kind with a large-message regime
    priced by its own figures where a move's bytes reach its start, on one exact scale."""

    def __init__(self, base: Reference, regimes: dict[str, tuple[int, float, float]]) -> None:
        self.__dict__.update(base.__dict__)
        fractions = {op: (Fraction(alpha), 1 / Fraction(bandwidth)) for op, (_, alpha, bandwidth) in regimes.items()}
        scale = math.lcm(base.scale, *(f.denominator for pair in fractions.values() for f in pair))
        grow = scale // base.scale
        self.op_units = {op: tuple([u * grow for u in v] for v in f) for op, f in base.op_units.items()}
        self.copy_units, self.scale = base.copy_units * grow, scale
        self.large = {op: (regimes[op][0], int(r * scale), int(b * scale)) for op, (r, b) in fractions.items()}

    def units(self, axis, nbytes, rounds, op="all_gather", copied=0):
        if op in self.large and nbytes >= self.large[op][0]:
            _, per_round, per_byte = self.large[op]
            return rounds * per_round + nbytes * per_byte + copied * self.copy_units
        return super().units(axis, nbytes, rounds, op, copied)


@pytest.mark.parametrize("seed", range(2))
def test_plans_are_optimal_with_large_message_regimes(seed):
    """The planner (its bound, its pruning rules, exact comparison) finds the brute force's
    optimum when kinds change figures at a size, cheaper or dearer."""
    rng = random.Random(900 + seed)
    for _ in range(200):
        src, dst, shape, dtype, _ = random_case(rng, naxes=rng.choice((1, 2, 2, 3)))
        base = calibrated_looking(rng, src.mesh.ndim)
        regimes = {
            op: (
                rng.choice((8, 100, 4096, 65536, 10**6)),
                float(f"{math.exp(rng.uniform(math.log(1e-7), math.log(3e-4))):.2e}"),
                float(f"{math.exp(rng.uniform(math.log(1e8), math.log(1e12))):.2e}"),
            )
            for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
            if rng.random() < 0.6
        }
        own = {c.op: c for c in base.ops}
        ops = [
            planner.OpCost(
                op,
                *(own[op].alpha, own[op].bandwidth) if op in own else (base.alpha, base.bandwidth),
                planner.Regime(*regimes[op]) if op in regimes else None,
            )
            for op in planner.PRICED_OPS
            if op in own or op in regimes
        ]
        cost = attrs.evolve(base, ops=ops)
        plain = attrs.evolve(base, ops=[attrs.evolve(c, large=None) for c in ops])
        ref = _ReferenceWithRegimes(reference_for(src, dst, shape, dtype, plain), regimes)
        assert_brute_force_optimal(ref, planner.plan(src, dst, shape, dtype, cost), cost)


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ('{"ops": {"all_reduce": {"large": 5}}}', "field 'ops.all_reduce.large': expected an object"),
        ('{"ops": {"all_reduce": {"large": {"from_bytes": 8, "alpha": 1e-5}}}}',
         "field 'ops.all_reduce.large.bandwidth': missing"),
        ('{"ops": {"all_reduce": {"large": {"from_bytes": 0, "alpha": 0, "bandwidth": 1e9}}}}',
         "field 'ops.all_reduce.large.from_bytes': expected a positive whole number of bytes, got 0"),
        ('{"ops": {"all_reduce": {"large": {"from_bytes": [8, 1.5], "alpha": 0, "bandwidth": 1e9}}}}',
         "field 'ops.all_reduce.large.from_bytes[1]': expected a positive whole number of bytes, got 1.5"),
        ('{"ops": {"all_reduce": {"large": {"from_bytes": 8, "alpha": 0, "bandwidth": -1}}}}',
         "field 'ops.all_reduce.large.bandwidth': expected a positive number of bytes per second, got -1"),
        ('{"ops": {"all_reduce": {"large": {"from_bytes": 8, "alpha": 0, "bandwidth": 1, "beta": 1}}}}',
         "field 'ops.all_reduce.large.beta': unknown"),
        ('{"ops": {"point_to_point": {"large": {"from_bytes": 8, "alpha": 0, "bandwidth": 1}}}}',
         "field 'ops.point_to_point.large': point-to-point steps have one regime"),
        ('{"alpha": [0, 0], "ops": {"all_reduce": {"large": {"from_bytes": [8, 9, 10], "alpha": 0, "bandwidth": 1}}}}',
         "per-axis lists of different lengths"),
    ],
)  # fmt: skip
def test_bad_large_message_regimes_name_the_file_and_field(tmp_path, capsys, content, field):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert main(["plan", "S0 over mesh[2]", "R over mesh[2]", "--shape", "8", "--costs", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}" in err and field in err and "Traceback" not in err
