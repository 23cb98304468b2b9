"""The calibration fit recovers known latencies and bandwidths from synthetic timings, and a
hints file with bad values is a clear error naming the file and the field."""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction

import attrs
import pytest

import planner
from cli.calibrate import fit_table
from cli.main import main
from cli.plan_report import describe_plan_cost
from planner.cost import collective_rounds
from planner.fit import (
    Line,
    Sample,
    choice_margin,
    fit_line,
    fit_model,
    fit_regimes,
    holm,
    median_relative_error,
    pooling_p_value,
    shared_slope_p_value,
    spearman,
)
from planner.spec_plan import plan_spec
from runtime.measure.calibrate import SWEEP_BYTES
from shardlang import Layout, Mesh, parse_layout, parse_spec
from tests.test_planner_optimal import Reference, calibrated_looking, random_case, reference_for

SIZES = [4096 * 4**k for k in range(7)]  # 4 KiB .. 16 MiB


def synthetic(
    truth: dict[str, tuple[tuple[float, float], ...]], rng: random.Random, noise: float, shape: tuple[int, ...] = (2, 4)
) -> list[Sample]:
    """Times ``rounds * alpha + bytes / bandwidth`` per kind and axis of a mesh (default
    [2, 4]), each with relative noise, and one wild outlier per series (a repetition series the
    machine hit)."""
    samples = []
    for op, per_axis in truth.items():
        for axis, (alpha, bandwidth) in enumerate(per_axis):
            n = shape[axis]
            rounds = 1 if op == "point_to_point" else collective_rounds(op, n)
            for k, nbytes in enumerate(SIZES):
                seconds = (rounds * alpha + nbytes / bandwidth) * (1 + rng.uniform(-noise, noise))
                if k == 3:
                    seconds *= 4
                samples.append(Sample(op, axis, rounds, nbytes, seconds))
    return samples


def test_the_fit_recovers_known_figures():
    rng = random.Random(1)
    truth = {op: tuple((rng.uniform(1e-5, 2e-4), rng.uniform(2e8, 8e9)) for _ in range(2)) for op in planner.PRICED_OPS}
    model, lines = fit_model(synthetic(truth, rng, noise=0.03))
    mesh = Mesh((2, 4))
    for op, per_axis in truth.items():
        alphas, bandwidths = model.for_op(op, mesh)
        for axis, (alpha, bandwidth) in enumerate(per_axis):
            assert alphas[axis] == pytest.approx(alpha, rel=0.15), (op, axis)
            assert bandwidths[axis] == pytest.approx(bandwidth, rel=0.08), (op, axis)
            assert lines[op, axis].kept == len(SIZES) - 1  # the outlier, and only it, dropped


def test_axes_that_cannot_be_told_apart_share_one_line():
    """Two axes of one size with the same true figures, timed with 10% noise (and an outlier a
    series): each kind gets one line over both axes' samples, so the figures are equal and
    close to the truth."""
    pooled = 0
    for seed in range(20):
        rng = random.Random(100 + seed)
        figures = {op: (rng.uniform(1e-4, 1e-3), rng.uniform(2e8, 2e9)) for op in planner.PRICED_OPS}
        model, lines = fit_model(synthetic({op: (f, f) for op, f in figures.items()}, rng, 0.10, (2, 2)))
        for op, (alpha, bandwidth) in figures.items():
            alphas, bandwidths = model.for_op(op, Mesh((2, 2)))
            if lines[op, 0].axes == (0, 1):
                pooled += 1
                assert lines[op, 1] == lines[op, 0] and alphas[0] == alphas[1] and bandwidths[0] == bandwidths[1]
                assert lines[op, 0].total == 2 * len(SIZES)
                assert alphas[0] == pytest.approx(alpha, rel=0.3) and bandwidths[0] == pytest.approx(bandwidth, rel=0.2)
            else:  # told apart: each axis keeps its own line
                assert lines[op, 0].axes == lines[op, 1].axes == () and alphas[0] != alphas[1]
    # At the test's 1% level about one kind in a hundred would be told apart by chance.
    assert pooled >= 97, pooled


def test_a_symmetric_machine_gets_the_default_models_tie_break():
    """``R,R | P01 -> R,R`` of 16 MiB on [2,2] whose two axes are alike, all_reduce 1.2x the
    bandwidth of the other kinds: by the table the hierarchical plan (reduce_scatter,
    all_reduce, all_gather) is the cheapest, over either axis alike (four steps without the
    all_reduce send 1.2x its bytes, two all_reduces 1.6x at its rate). The default model breaks
    the tie to reduce-scatter over axis 0, and a model fitted to noisy timings of such a
    machine must too (with a line per axis, the noise would pick the axis)."""
    src, dst = parse_layout("R,R | P01 over mesh[2,2]"), parse_layout("R,R over mesh[2,2]")
    default = [s.describe() for s in planner.plan(src, dst, (4096, 1024), "f32").steps]
    assert default == [
        "reduce_scatter(axis=0, dim=0, op=sum)",
        "all_reduce(axis=1, op=sum)",
        "all_gather(axis=0, dim=0)",
    ]
    truth = {op: ((2e-4, 6e8 if op == "all_reduce" else 5e8),) * 2 for op in planner.PRICED_OPS}
    for seed in range(6):
        model, _ = fit_model(synthetic(truth, random.Random(300 + seed), 0.10, (2, 2)))
        assert [s.describe() for s in planner.plan(src, dst, (4096, 1024), "f32", model).steps] == default, seed


def test_axes_that_differ_keep_their_own_lines():
    """Axes of one size whose bandwidths are 3x apart (a node's own links against the
    network's), and in every other case their latencies too, with the same 10% noise: never
    pooled, never one bandwidth, each axis's figures recovered."""
    for seed in range(20):
        rng = random.Random(200 + seed)
        truth = {}
        for op in planner.PRICED_OPS:
            alpha, bandwidth = rng.uniform(1e-4, 1e-3), rng.uniform(2e8, 2e9)
            truth[op] = ((alpha, 3 * bandwidth), ((3 if seed % 2 else 1) * alpha, bandwidth))
        model, lines = fit_model(synthetic(truth, rng, 0.10, (2, 2)))
        for op, per_axis in truth.items():
            alphas, bandwidths = model.for_op(op, Mesh((2, 2)))
            for axis, (alpha, bandwidth) in enumerate(per_axis):
                line = lines[op, axis]
                assert line.axes == line.shared_slope == () and line.total == len(SIZES), (seed, op, axis)
                assert alphas[axis] == pytest.approx(alpha, rel=0.3), (seed, op, axis)
                assert bandwidths[axis] == pytest.approx(bandwidth, rel=0.2), (seed, op, axis)


def test_axes_that_differ_in_fixed_cost_alone_share_one_bandwidth():
    """Axes of one size with the same bandwidth, axis 1's fixed cost 2x axis 0's (what the
    sweeps of [2,2] here showed), 10% noise: told apart, yet they share one slope, so the
    bandwidths are equal and close to the truth, and each axis keeps its own latency."""
    shared = 0
    for seed in range(20):
        rng = random.Random(500 + seed)
        figures = {op: (rng.uniform(1e-4, 1e-3), rng.uniform(2e8, 2e9)) for op in planner.PRICED_OPS}
        truth = {op: ((alpha, bandwidth), (2 * alpha, bandwidth)) for op, (alpha, bandwidth) in figures.items()}
        model, lines = fit_model(synthetic(truth, rng, 0.10, (2, 2)))
        for op, per_axis in truth.items():
            alphas, bandwidths = model.for_op(op, Mesh((2, 2)))
            assert lines[op, 0].axes == lines[op, 1].axes == (), (seed, op)  # never one line
            if lines[op, 0].shared_slope == (0, 1):
                shared += 1
                assert lines[op, 1].shared_slope == (0, 1) and bandwidths[0] == bandwidths[1]
                assert bandwidths[0] == pytest.approx(per_axis[0][1], rel=0.2), (seed, op)
            for axis, (alpha, _) in enumerate(per_axis):
                assert alphas[axis] == pytest.approx(alpha, rel=0.3), (seed, op, axis)
    # At the slope test's 1% level about one kind in a hundred keeps two slopes by chance.
    assert shared >= 97, shared


def test_pooled_axes_and_a_dearer_one_share_the_bandwidth():
    """[2,2,2] timed without noise: axes 0 and 1 alike, axis 2 at the same bandwidth with 3x
    the latency. Axes 0 and 1 get one line; all three one slope; each set its own latency."""
    samples = []
    for axis, alpha in enumerate((3e-4, 3e-4, 9e-4)):
        for nbytes in SIZES:
            for op in planner.PRICED_OPS:
                rounds = 1 if op == "point_to_point" else collective_rounds(op, 2)
                samples.append(Sample(op, axis, rounds, nbytes, rounds * alpha + nbytes / 1e9))
    model, lines = fit_model(samples)
    for op in planner.PRICED_OPS:
        assert [(lines[op, a].axes, lines[op, a].shared_slope) for a in range(3)] == [
            ((0, 1), (0, 1, 2)),
            ((0, 1), (0, 1, 2)),
            ((), (0, 1, 2)),
        ]
        alphas, bandwidths = model.for_op(op, Mesh((2, 2, 2)))
        assert alphas == pytest.approx((3e-4, 3e-4, 9e-4), rel=1e-3) and bandwidths == (1e9,) * 3


def test_a_dearer_axis_in_fixed_cost_gets_the_cheaper_mirror_image():
    """``R,R | P01 -> R,R`` on [2,2], every kind 1 ms dearer per step on axis 1 at the same
    bandwidth: by the table the hierarchical plan that reduce-scatters and gathers over axis 0
    (and all-reduces over axis 1) is the cheapest at 10.6 and 16 MiB, 1 ms less than its mirror
    image (the plans the true model chooses). Models fitted to noisy timings of it choose it
    there in at least 90 of 100 (model, size): with a slope fitted per axis, 16% apart by the
    noise alone at times, the slopes decide at large sizes (about 3 in 10 chose the mirror)."""
    src, dst = parse_layout("R,R | P01 over mesh[2,2]"), parse_layout("R,R over mesh[2,2]")
    per_round = {op: 1e-3 / (1 if op == "point_to_point" else collective_rounds(op, 2)) for op in planner.PRICED_OPS}
    truth = {op: ((5e-4, 5e8), (5e-4 + per_round[op], 5e8)) for op in planner.PRICED_OPS}
    true_model = planner.CostModel(
        ops=[planner.OpCost(op, tuple(a for a, _ in f), tuple(b for _, b in f)) for op, f in truth.items()]
    )
    want = {
        rows: [s.describe() for s in planner.plan(src, dst, (rows, 1024), "f32", true_model).steps]
        for rows in (2716, 4096)
    }
    assert set(map(tuple, want.values())) == {
        ("reduce_scatter(axis=0, dim=0, op=sum)", "all_reduce(axis=1, op=sum)", "all_gather(axis=0, dim=0)")
    }
    chosen = 0
    for seed in range(50):
        model, _ = fit_model(synthetic(truth, random.Random(600 + seed), 0.10, (2, 2)))
        for rows, steps in want.items():
            chosen += [s.describe() for s in planner.plan(src, dst, (rows, 1024), "f32", model).steps] == steps
    assert chosen >= 90, chosen


def test_the_pooling_test_is_the_f_test():
    """The closed form of the pooling p-value against scipy's F distribution."""
    from scipy.stats import f

    for apart, pooled, count in [(0.5, 0.6, 14), (0.2, 0.9, 14), (1.0, 1.3, 9), (0.1, 0.4, 30)]:
        statistic = ((pooled - apart) / 2) / (apart / (count - 4))
        assert pooling_p_value(apart, pooled, count) == pytest.approx(f.sf(statistic, 2, count - 4), rel=1e-9)
    assert pooling_p_value(0.0, 0.1, 14) == 0 and pooling_p_value(0.0, 0.0, 14) == 1
    assert pooling_p_value(0.1, 0.1, 4) == 0  # two lines through four points: nothing to compare
    # One slope against one per group: F(1, dof), the closed form's even and odd dof alike.
    for apart, shared, dof in [(0.5, 0.6, 10), (0.2, 0.9, 11), (1.0, 1.3, 1), (0.3, 0.31, 2), (0.1, 0.4, 25)]:
        statistic = (shared - apart) / (apart / dof)
        assert shared_slope_p_value(apart, shared, dof) == pytest.approx(f.sf(statistic, 1, dof), rel=1e-9)
    assert shared_slope_p_value(0.0, 0.1, 10) == 0 and shared_slope_p_value(0.0, 0.0, 10) == 1
    assert shared_slope_p_value(0.1, 0.2, 0) == 0


def test_the_fit_is_exact_without_noise_and_refits_through_zero():
    line = fit_line([1e3, 1e5, 1e7], [2e-5 + 1e3 / 1e9, 2e-5 + 1e5 / 1e9, 2e-5 + 1e7 / 1e9])
    assert (line.intercept, 1 / line.slope) == (pytest.approx(2e-5), pytest.approx(1e9))
    through_zero = fit_line([1e6, 2e6, 4e6], [0.5e-3, 1.6e-3, 3.8e-3])  # a negative intercept
    assert through_zero.intercept == 0 and 0.5e-9 < through_zero.slope < 0.95e-9  # within the points' t / x


def test_holm_rejects_what_holms_sequential_procedure_rejects():
    """Holm's adjusted p-values against the procedure as Holm (1979) states it: sort the m
    p-values, reject the k-th smallest (from 0) while it is at most alpha / (m - k), stop at the
    first that is not; an adjusted value is below alpha exactly for the rejected ones."""
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([]) == [] and holm([0.7]) == [0.7] and holm([0.6, 0.9]) == [1.0, 1.0]
    rng = random.Random(3)
    for _ in range(500):
        ps = [rng.choice((rng.random(), rng.random() ** 4, 0.01, 0.05)) for _ in range(rng.randint(1, 12))]
        alpha = rng.choice((0.01, 0.05, 0.1))
        rejected = set()
        for k, i in enumerate(sorted(range(len(ps)), key=ps.__getitem__)):
            if ps[i] > alpha / (len(ps) - k):
                break
            rejected.add(i)
        assert {i for i, q in enumerate(holm(ps)) if q <= alpha} == rejected, (ps, alpha)


def test_scores():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)
    assert median_relative_error([1.1, 2.0, 2.0], [1.0, 2.0, 4.0]) == pytest.approx(0.1)


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
    path = tmp_path / "bad.json"
    path.write_text(content)
    code = main(["plan", "S0 over mesh[2]", "R over mesh[2]", "--shape", "8", "--costs", str(path)])
    err = capsys.readouterr().err
    assert code == 1 and f"{path}" in err and field in err and "Traceback" not in err


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


def test_the_fit_recovers_the_executor_terms():
    """Slice samples (a plan that sends nothing: the step overhead and the copy of the target
    piece) give the overhead and the copy bandwidth; every collective sample pays the overhead
    too, so its alpha is what its line adds to the overhead."""
    rng = random.Random(2)
    overhead, copy_bandwidth = 1.5e-4, 2.5e9
    truth = {op: tuple((rng.uniform(1e-4, 1e-3), rng.uniform(2e8, 2e9)) for _ in range(2)) for op in planner.PRICED_OPS}
    samples = [
        Sample(s.op, s.axis, s.rounds, s.bytes, s.seconds + overhead * (1 + rng.uniform(-0.02, 0.02)))
        for s in synthetic(truth, rng, noise=0.02)
    ]
    for axis in (0, 1):
        for nbytes in SIZES:
            seconds = (overhead + nbytes / copy_bandwidth) * (1 + rng.uniform(-0.02, 0.02))
            samples.append(Sample("slice", axis, 0, nbytes, seconds))
    model, lines = fit_model(samples)
    assert model.overhead == pytest.approx(overhead, rel=0.1)
    assert model.copy_bandwidth == pytest.approx(copy_bandwidth, rel=0.05)
    assert lines["slice", -1].total == 2 * len(SIZES)
    mesh = Mesh((2, 4))
    for op, per_axis in truth.items():
        alphas, _ = model.for_op(op, mesh)
        for axis, (alpha, _) in enumerate(per_axis):
            assert alphas[axis] == pytest.approx(alpha, rel=0.15), (op, axis)
    # Without slice samples the terms stay free.
    bare, _ = fit_model([s for s in samples if s.op != "slice"])
    assert (bare.overhead, bare.copy_bandwidth) == (0.0, None)


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


class _ReferenceWithOverhead(Reference):
    """The independent brute force of tests/test_planner_optimal.py, every step of any kind
    paying ``overhead`` on the same exact scale."""

    def __init__(self, base: Reference, overhead: float) -> None:
        self.__dict__.update(base.__dict__)
        extra = Fraction(overhead)
        scale = math.lcm(base.scale, extra.denominator)
        self.op_units = {
            op: tuple([u * (scale // base.scale) for u in v] for v in f) for op, f in base.op_units.items()
        }
        self.scale, self.overhead_units = scale, int(extra * scale)
        self.copy_units = base.copy_units * (scale // base.scale)

    def units(self, axis, nbytes, rounds, op="all_gather", copied=0):
        return super().units(axis, nbytes, rounds, op, copied) + self.overhead_units


def assert_brute_force_optimal(ref, got, cost) -> None:
    """``got`` (the planner's plan under ``cost``) costs what the brute force ``ref``'s optimum
    does, in as few steps."""
    want = ref.solve(ref.state_of(got.src), ref.state_of(got.dst), len(got.steps) + 3)
    assert (ref.replay(got), len(got.steps)) == want, f"{got.src} -> {got.dst}, {got.shape}, {got.dtype}, {cost}"


@pytest.mark.parametrize("seed", range(2))
def test_plans_are_optimal_with_a_step_overhead(seed):
    """The planner (its bound, its pruning rules, the fewer-steps tie rule) finds the optimum
    of the brute force when every step also pays an overhead."""
    rng = random.Random(700 + seed)
    for _ in range(250):
        src, dst, shape, dtype, _ = random_case(rng, naxes=rng.choice((1, 2, 2, 3)))
        base = calibrated_looking(rng, src.mesh.ndim)
        cost = attrs.evolve(base, overhead=rng.choice((1e-6, 3e-5, 1e-4, 1e-3)))
        ref = _ReferenceWithOverhead(reference_for(src, dst, shape, dtype, base), cost.overhead)
        assert_brute_force_optimal(ref, planner.plan(src, dst, shape, dtype, cost), cost)


def test_the_choice_margin_is_the_median_miss_of_the_lines():
    """Samples of 1.0, 2.2 and 2.9 ms where their lines give 1, 2 and 3 ms miss by 0, 0.2 and
    0.1 ms: the margin is 0.1 ms. A fit of three all_gather samples, two of 1.0 and 1.1 ms at
    100 kB and one of 3 ms at 1 MB: the line passes through the third and, at 100 kB, through
    the relative least-squares value of the two, (1/1.0 + 1/1.1) / (1/1.0**2 + 1/1.1**2) ms (by
    hand), so the misses are that value less 1.0 ms, 1.1 ms less it, and 0, and the margin is
    the first. Timings on their lines give no margin."""
    line = Line(0.0, 1e-6, 3, 3)
    samples = [Sample("all_gather", 0, 3, b, t) for b, t in ((1000, 1.0e-3), (2000, 2.2e-3), (3000, 2.9e-3))]
    assert choice_margin((line, s) for s in samples) == pytest.approx(1e-4)
    middle = (1 / 1.0 + 1 / 1.1) / (1 / 1.0**2 + 1 / 1.1**2) * 1e-3
    fitted = [Sample("all_gather", 0, 3, 100_000, 1.0e-3), Sample("all_gather", 0, 3, 100_000, 1.1e-3)]
    model, lines = fit_model([*fitted, Sample("all_gather", 0, 3, 1_000_000, 3e-3)])
    assert model.margin == float(f"{middle - 1.0e-3:.2e}") == 4.52e-5
    last = fit_table(model, lines, Mesh((2,))).splitlines()[-1]
    assert last.split() == ["choice", "margin", "(per", "step)", "any", "45.2", "us"]
    exact, _ = fit_model([Sample("all_gather", 0, 3, b, 1e-3 + b / 1e9) for b in SIZES])
    assert exact.margin == 0


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
        chooses = _ReferenceWithOverhead(reference, cost.overhead + cost.margin)
        want = chooses.solve(chooses.state_of(src), chooses.state_of(dst), len(got.steps) + 3)
        assert (chooses.replay(got, check_seconds=False), len(got.steps)) == want, f"{src} -> {dst}, {shape}, {cost}"
        priced = _ReferenceWithOverhead(reference, cost.overhead)  # checks every step's seconds
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
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert main(["plan", "S0 over mesh[2]", "R over mesh[2]", "--shape", "8", "--costs", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}: {field}" in err and "Traceback" not in err


def test_the_calibrate_table_shows_every_kind_and_the_executor_terms():
    """Noise-free timings of known figures on mesh[2] (every step also paying a 100 us overhead;
    the slices copying at 4 GB/s): the table gives those figures back, all_gather's included."""
    truth = {
        "all_gather": (2e-4, 1e9),
        "reduce_scatter": (3e-4, 5e8),
        "all_reduce": (1.5e-4, 2e9),
        "all_to_all": (2.5e-4, 8e8),
        "point_to_point": (4e-4, 1.2e9),
    }
    samples = []
    for k in range(5):
        nbytes = 4096 * 4**k
        for op, (alpha, bandwidth) in truth.items():
            rounds = 1 if op == "point_to_point" else collective_rounds(op, 2)
            samples.append(Sample(op, 0, rounds, nbytes, 1e-4 + rounds * alpha + nbytes / bandwidth))
        samples.append(Sample("slice", 0, 0, nbytes, 1e-4 + nbytes / 4e9))
    model, lines = fit_model(samples)
    assert fit_table(model, lines, Mesh((2,))).splitlines() == [
        "collective                 axis  latency/round  bandwidth  sizes kept",
        "all_gather                 0     200 us         1 GB/s     5/5",
        "reduce_scatter             0     300 us         0.5 GB/s   5/5",
        "all_reduce                 0     150 us         2 GB/s     5/5",
        "all_to_all                 0     250 us         0.8 GB/s   5/5",
        "point_to_point             0     400 us         1.2 GB/s   5/5",
        "executor (per step, copy)  any   100 us         4 GB/s     5/5",
    ]


def test_the_calibrate_table_names_pooled_axes():
    """[dp=2, tp=2] timed alike on both axes, without noise, except all_to_all, whose tp axis
    is twice as fast, and point_to_point, whose tp axis has twice the latency: every other
    kind's line is pooled over dp and tp, all_to_all's are not, point_to_point's share the
    bandwidth."""
    samples = []
    for axis in (0, 1):
        for k in range(5):
            nbytes = 4096 * 4**k
            for op in planner.PRICED_OPS:
                rounds = 1 if op == "point_to_point" else collective_rounds(op, 2)
                bandwidth = 2e9 if op == "all_to_all" and axis == 1 else 1e9
                alpha = 4e-4 if op == "point_to_point" and axis == 1 else 2e-4
                samples.append(Sample(op, axis, rounds, nbytes, rounds * alpha + nbytes / bandwidth))
    model, lines = fit_model(samples)
    assert fit_table(model, lines, Mesh((2, 2), axis_names=("dp", "tp"))).splitlines() == [
        "collective      axis  latency/round  bandwidth  sizes kept",
        "all_gather      dp    200 us         1 GB/s     10/10 (dp+tp pooled)",
        "all_gather      tp    200 us         1 GB/s     10/10 (dp+tp pooled)",
        "reduce_scatter  dp    200 us         1 GB/s     10/10 (dp+tp pooled)",
        "reduce_scatter  tp    200 us         1 GB/s     10/10 (dp+tp pooled)",
        "all_reduce      dp    200 us         1 GB/s     10/10 (dp+tp pooled)",
        "all_reduce      tp    200 us         1 GB/s     10/10 (dp+tp pooled)",
        "all_to_all      dp    200 us         1 GB/s     5/5",
        "all_to_all      tp    200 us         2 GB/s     5/5",
        "point_to_point  dp    200 us         1 GB/s     5/5 (dp+tp bandwidth pooled)",
        "point_to_point  tp    400 us         1 GB/s     5/5 (dp+tp bandwidth pooled)",
    ]


def _two_regimes(small, large, from_bytes, rounds, rng, noise):
    """Times of a kind whose figures are ``small`` (alpha, bandwidth) below ``from_bytes`` and
    ``large`` from it, at the sweep's sizes, with relative noise and one wild outlier."""
    times = []
    for k, nbytes in enumerate(SWEEP_BYTES):
        alpha, bandwidth = small if nbytes < from_bytes else large
        seconds = (rounds * alpha + nbytes / bandwidth) * (1 + rng.uniform(-noise, noise))
        times.append(seconds * (4 if k == 6 else 1))
    return times


@pytest.mark.parametrize("seed", range(3))
def test_the_fit_recovers_two_regimes_and_their_break(seed):
    """A kind whose time per byte changes at a size (a jump: the backend switches algorithm)
    gets two regimes, each one's figures recovered and the break placed between the two sweep
    sizes around it; a straight kind timed alike keeps one line."""
    rng = random.Random(40 + seed)
    cut = rng.randrange(5, len(SWEEP_BYTES) - 3)  # the first size of the large regime
    true_break = round(math.sqrt(SWEEP_BYTES[cut - 1] * SWEEP_BYTES[cut]))
    small, large = (rng.uniform(2e-4, 1e-3), rng.uniform(2e8, 5e8)), (rng.uniform(1e-3, 3e-3), rng.uniform(8e8, 2e9))
    straight = (rng.uniform(2e-4, 1e-3), rng.uniform(2e8, 2e9))
    samples = []
    for op, (below, above) in (("all_reduce", (small, large)), ("all_gather", (straight, straight))):
        rounds = collective_rounds(op, 4)
        times = _two_regimes(below, above, true_break, rounds, rng, 0.03)
        samples += [Sample(op, 0, rounds, b, t) for b, t in zip(SWEEP_BYTES, times, strict=True)]
    model, lines = fit_model(samples)
    mesh = Mesh((4,))
    assert lines["all_gather", 0].large is None and set(model.large_from(mesh)) == {"all_reduce"}
    (start,) = model.large_from(mesh)["all_reduce"]
    assert SWEEP_BYTES[cut - 1] < start <= SWEEP_BYTES[cut]
    for nbytes, (alpha, bandwidth) in ((SWEEP_BYTES[0], small), (SWEEP_BYTES[-1], large)):
        got_alpha, got_bandwidth = model.figures_at("all_reduce", mesh, 0, nbytes)
        assert got_alpha == pytest.approx(alpha, rel=0.2) and got_bandwidth == pytest.approx(bandwidth, rel=0.1)
    # Of both regimes' samples, the outlier and only it dropped.
    fitted = lines["all_reduce", 0]
    kept, total = fitted.kept + fitted.large.kept, fitted.total + fitted.large.total
    assert (kept, total) == (len(SWEEP_BYTES) - 1, len(SWEEP_BYTES))


def test_a_bend_breaks_where_the_lines_cross_and_the_table_shows_both_regimes():
    """Noise-free all_reduce on mesh[2]: 200 us a round and 1 GB/s, then from where the lines
    cross (2,133,334 bytes: 0.4 ms + b / 1 GB/s = 2 ms + b / 4 GB/s) 1 ms a round and 4 GB/s."""
    samples = []
    for nbytes in SWEEP_BYTES:
        for op in planner.PRICED_OPS:
            rounds = 1 if op == "point_to_point" else collective_rounds(op, 2)
            alpha, bandwidth = (1e-3, 4e9) if op == "all_reduce" and nbytes > 2133334 else (2e-4, 1e9)
            samples.append(Sample(op, 0, rounds, nbytes, rounds * alpha + nbytes / bandwidth))
    model, lines = fit_model(samples)
    assert model.large_from(Mesh((2,))) == {"all_reduce": (2133334,)}
    assert fit_table(model, lines, Mesh((2,))).splitlines() == [
        "collective       axis  latency/round  bandwidth  sizes kept",
        "all_gather       0     200 us         1 GB/s     14/14",
        "reduce_scatter   0     200 us         1 GB/s     14/14",
        "all_reduce       0     200 us         1 GB/s     8/8",
        "  from 2.03 MiB  0     1 ms           4 GB/s     6/6",
        "all_to_all       0     200 us         1 GB/s     14/14",
        "point_to_point   0     200 us         1 GB/s     14/14",
    ]


def test_straight_timings_keep_one_line():
    """Of 300 straight kinds timed with 10% noise and an outlier each, none gets two regimes."""
    rng = random.Random(9)
    for _ in range(300):
        figures = (rng.uniform(1e-4, 1e-3), rng.uniform(2e8, 2e9))
        times = _two_regimes(figures, figures, 0, 2, rng, 0.10)
        assert fit_regimes(list(SWEEP_BYTES), times).large is None


GATHER_SWITCH = 3 * 2**18  # a [4] all_gather's table bytes at a result of 1 MiB, gloo's switch (by hand)


def _gather_times(rng, jump, noise, xs):
    """A [4] all_gather's times at table bytes ``xs``: 1.5 ms a round and 800 MB/s from
    :data:`GATHER_SWITCH`, ``jump`` times that below it, with relative noise."""
    return [(4.5e-3 + x / 8e8) * (jump if x < GATHER_SWITCH else 1) * (1 + rng.uniform(-noise, noise)) for x in xs]


@pytest.mark.parametrize(("jump", "sizes", "known_least", "searched_most"), [(1.15, 14, 55, 35), (1.5, 9, 65, 55)])
def test_a_known_break_is_found_where_the_search_is_not(jump, sizes, known_least, searched_most):
    """Of 100 kinds that jump at the backend's known switch (5% noise), the known break alone
    splits clearly more than the searched test (corrected over its candidates) does: a jump of
    15% over the whole sweep, and of 50% over a sweep the budget ended at 2.8 MiB; each split
    starts exactly at the switch and prices both sides within 10%."""
    rng = random.Random(sizes)
    xs = [3 * b // 4 for b in SWEEP_BYTES[:sizes]]  # a [4] all_gather's table bytes at the sweep's results
    known = searched = 0
    for _ in range(100):
        ts = _gather_times(rng, jump, 0.05, xs)
        line = fit_regimes(xs, ts, GATHER_SWITCH)
        searched += fit_regimes(xs, ts).large is not None
        if line.large is not None:
            known += 1
            assert line.from_bytes == GATHER_SWITCH
            for x in (xs[3], xs[-1]):
                assert line.at(x) == pytest.approx((4.5e-3 + x / 8e8) * (jump if x < GATHER_SWITCH else 1), rel=0.1)
    assert known >= known_least and searched <= searched_most


def test_a_known_break_keeps_one_line_when_straight():
    """Of 300 straight kinds (10% noise, an outlier each), a known break splits at most 1%; and
    a fitted model's all_gather regime starts at the break it was given, on its axis only."""
    rng = random.Random(10)
    split = 0
    for _ in range(300):
        figures = (rng.uniform(1e-4, 1e-3), rng.uniform(2e8, 2e9))
        split += (
            fit_regimes(list(SWEEP_BYTES), _two_regimes(figures, figures, 0, 2, rng, 0.10), 10**6).large is not None
        )
    assert split <= 3
    samples = []
    for op in planner.PRICED_OPS:
        rounds = 1 if op == "point_to_point" else collective_rounds(op, 4)
        xs = [3 * b // 4 for b in SWEEP_BYTES]
        ts = _gather_times(rng, 1.4 if op == "all_gather" else 1.0, 0.03, xs)
        samples += [Sample(op, 0, rounds, x, t) for x, t in zip(xs, ts, strict=True)]
    model, _ = fit_model(samples, {("all_gather", 0): GATHER_SWITCH})
    assert model.large_from(Mesh((4,))) == {"all_gather": (GATHER_SWITCH,)}


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
