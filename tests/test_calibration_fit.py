"""The calibration fit recovers known latencies, bandwidths, executor terms, choice margins and
large-message regimes from synthetic timings, and the calibrate table shows what it fitted.
Plans priced by such figures, and hints files, are in test_calibration_plans.py."""

from __future__ import annotations

import math
import random

import pytest

import planner
from cli.calibrate import fit_table
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
from runtime.measure.calibrate import SWEEP_BYTES
from shardlang import Mesh, parse_layout

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
