"""Fitting the cost model to measured collective times (``shardlang calibrate``; docs/calibration.md).

A sample is one collective kind on one mesh axis of size ``n`` at one message size: the bytes
per rank the cost table (``planner.cost``) counts for it, and the measured seconds (the
runtime takes the median over repetitions of the slowest rank). For one kind on one axis the
table's rounds ``r`` are a constant, so its time ``r * alpha + bytes / bandwidth`` is a line
in the bytes: the fit is that line, and ``alpha = intercept / r``, ``bandwidth = 1 / slope``.

What is fitted, and why. The intercept is the measured fixed cost of one step (the executor's
work around the call, launch, the backend's own rounds, synchronisation), whatever algorithm
the backend runs: gloo's
all_reduce is not the ring of ``2(n-1)`` rounds that the table counts, and a point-to-point
exchange is one message each way. Dividing by the table's rounds gives the per-round latency
that makes the table true on an axis of that size, so figures are exact for the calibrated
mesh and carry over to other axis sizes only as far as the backend's algorithm scales as the
table does. The line is fitted by least squares on relative residuals (weights ``1 / t``), so
the 4 KiB and the 16 MiB ends count alike (the planner compares small and large steps, and
relative error is what the benchmark scores), robustly: samples whose relative residual is
more than three times the median one (and over 10%) are dropped and the line fitted again,
twice at most, which discards a repetition series that the machine's noise hit. A negative
intercept refits through zero; a slope of zero or less (time flat in bytes) gives
:data:`MAX_BANDWIDTH`. Figures are rounded to three significant digits, which keeps the
planner's exact integer scale small (``planner.units.integer_rates``).

Axes that cannot be told apart share one line. Two axes of one size (the same rounds) whose
lines for a kind differ by no more than their samples' own scatter explains (a symmetric machine:
[2,2] on one host, or the axes of one node) get one line, fitted over both axes' kept samples,
and so identical figures: then the planner's deterministic tie-break picks between them as under
the default model, instead of a coin flip on the noise. Axes that differ clearly (a node's own
links against the network) keep their own. The criterion is the F test of one line against one
per group (Chow's test) on the relative residuals the fit minimises: with ``N`` kept samples,
``RSS`` the squared residuals off the shared line and ``RSS_apart`` off each group's own, its
p-value is ``(RSS_apart / RSS) ** ((N - 4) / 2)`` (:func:`pooling_p_value`), and axes stay
apart where it is below :data:`POOL_LEVEL` (1%: pooling is the default unless the difference
is clear; with 7 sizes on each of two axes, ``N = 14``, they stay apart when ``RSS`` is over
2.5 times ``RSS_apart``). It weighs the lines' difference against the scatter about them, the
backend's departure from a line included, which axes alike share; so axes set apart are ones
whose timings differ by clearly more than either's from its line. The test takes the noise as
independent from sample to sample, which is why the sweep (``runtime.measure.calibrate``) times every
axis at one size together: load that comes and goes, met by one axis's sizes and not the
other's, would otherwise read as a difference between them. Sets of axes are merged a pair at
a time, the pair with the largest p-value first, while one is at least the level.

Axes told apart may still share a slope. An intercept and a slope fitted together trade off
against each other, so axes that differ only in their fixed cost (as [2,2]'s did here, axis 1's
0.4-1.1 ms dearer) got slopes apart by the noise too, and at large sizes those decided between
mirror-image plans. So sets told apart (of the same rounds, one regime) share one slope, each its
own intercept (:func:`_weighted_lines`), unless the nested F test of one slope against one per
set, the intercepts free in both, tells them apart at the same level (:func:`shared_slope_p_value`:
one parameter fewer, ``F(1, N - sets - 2)`` for ``N`` kept points); merged a pair at a time as
the sets are. So the bandwidths are equal and the latencies say the difference; axes 3x apart in
bandwidth keep their own slopes.

Two regimes where the line is not one. A backend's time per byte may change with the
message (gloo's algorithms by size, caches, the transport's buffers), so a kind's samples on a
set of axes get two lines, one below a break in the bytes and one from it (``planner.cost``'s
large-message :class:`~planner.cost.Regime`), where that fits clearly better than one
(:func:`fit_regimes`): the F test of one line against two is the pooling test's, on the samples
kept by the one line or by their side's; it must pass at :data:`SPLIT_LEVEL` (1%) times the
breaks tried (a break leaves :data:`MIN_REGIME` sizes or more each side) and with the samples of
any one size left out, so that a burst of load met at one size (on every axis alike, the sweep
interleaves them) is not taken for a regime. On synthetic straight timings with 10% noise and an
outlier it splits about 1 kind in 1000. The break lies between two swept sizes; it is put where
the two lines cross if they cross there (a bend), else at the sizes' geometric mean (a jump,
whose place between them is not measured). Where the runtime says it switches algorithm at a
size (``fit_model``'s ``breaks``: gloo's all_gather from a result of 1 MiB, ``runtime.comm.collectives``),
that break is the kind's one candidate: tested alone, so uncorrected, at the same level and with
the same leave-one-size-out condition, and the large regime starts exactly there. Point-to-point
steps keep one line (:data:`ONE_REGIME`: ``planner.p2p`` prices them message by message).

The executor terms (``planner.cost``; docs/calibration.md). Samples of kind ``slice`` time a
plan of one slice step, which sends nothing: the executor's fixed cost of a step and its copy of
the target piece (their ``bytes`` are that piece's). One line over them on every axis gives
``overhead`` (its intercept) and ``copy_bandwidth`` (1 / its slope). Every collective step pays
the overhead too, so a collective's ``alpha`` is what its intercept adds to it:
``(intercept - overhead) / rounds`` (zero if less), and a one-step plan's predicted time is still
its fitted line. Without slice samples the terms stay free (0 and ``None``).

A collective's local copies (``planner.cost``'s copy table: packing blocks that are not runs of
the piece's memory, unpacking a result whose blocks are not) are priced at the copy bandwidth
apart from its line, so a sample whose step copies (``Sample.copied``: the calibration's
all_to_all, which packs dim 1 of its pieces) is fitted less their time at the fitted copy
bandwidth (never below half the sample, should that line overstate a copy), and the step's
predicted time, its line plus its copy, is still what the sample measured.

The choice margin (``planner.cost``; docs/calibration.md). The fitted lines miss each sample by
some amount, the machine's noise and the lines' own departure from the measurement together; the
median of those misses, in seconds, over every collective sample (:func:`choice_margin`), is how
far a one-step prediction is typically off, so a plan predicted faster than another by less
than that per step it adds is not known to be faster. The model's ``margin`` is that median:
the search charges it on every step when choosing, never in a predicted time, so between plans
that close the one of fewer steps wins. Timings that the lines fit to rounding give 0.

Pure: no torch, no communication, so the fit is tested on synthetic timings.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

from planner.cost import PRICED_OPS, CostModel, OpCost, Regime

MAX_BANDWIDTH = 1e13  # bytes/s: what a kind whose time does not grow with bytes is given
LOCAL = "slice"  # the kind of the samples that price the executor terms (module docstring)
_OUTLIER_FACTOR = 3.0
_OUTLIER_FLOOR = 0.10
_EXACT = 1e-20  # squared relative residual per point of a line that passes through every point
POOL_LEVEL = 0.01  # axes' lines are told apart below this p-value of the pooling test (module docstring)
SPLIT_LEVEL = 0.01  # a kind gets two regimes below this p-value of the break test, corrected (module docstring)
MIN_REGIME = 3  # distinct sizes in each regime, at least
ONE_REGIME = frozenset({"point_to_point"})  # kinds the model prices by one line (planner.cost)


@attrs.frozen
class Sample:
    """One measured point: ``op`` on mesh ``axis``, the ``rounds`` and ``bytes`` per rank the
    cost table counts for it (``planner.cost``; a point-to-point step's rounds are its busiest
    rank's messages, ``planner.p2p``), ``seconds``."""

    op: str
    axis: int
    rounds: int
    bytes: int
    seconds: float
    # Bytes the sampled step copies locally by the copy table (``planner.cost``), which the
    # model prices apart at the copy bandwidth (module docstring).
    copied: int = 0


@attrs.frozen
class Line:
    """``seconds = intercept + slope * bytes``, and how many samples it kept of how many; a
    line pooled over several axes (module docstring) names them in ``axes``. With ``large``,
    that line holds from ``from_bytes`` on, this one below (a kind with two regimes, module
    docstring), and ``kept`` and ``total`` count this regime's samples."""

    intercept: float
    slope: float
    kept: int
    total: int
    axes: tuple[int, ...] = ()
    large: Line | None = None
    from_bytes: int = 0
    # The axes whose lines share this one's slope, each set of them its own intercept (module
    # docstring); empty where the slope is this line's own.
    shared_slope: tuple[int, ...] = ()

    def at(self, nbytes: float) -> float:
        if self.large is not None and nbytes >= self.from_bytes:
            return self.large.at(nbytes)
        return self.intercept + self.slope * nbytes


def fit_line(xs: Sequence[float], ts: Sequence[float]) -> Line:
    """The robust relative least-squares line through ``(xs, ts)`` (module docstring); at
    least two samples, times positive."""
    line, keep = _robust_line(xs, ts)
    return Line(line[0], line[1], len(keep), len(xs))


def _robust_line(xs: Sequence[float], ts: Sequence[float]) -> tuple[tuple[float, float], list[int]]:
    """:func:`fit_line`'s coefficients and the indices of the samples it kept."""
    if len(xs) != len(ts) or len(xs) < 2 or min(ts) <= 0:
        raise ValueError("fit_line needs two or more samples of positive time")
    keep = list(range(len(xs)))
    line = _weighted_line([xs[i] for i in keep], [ts[i] for i in keep])
    for _ in range(2):
        residuals = [abs(line[0] + line[1] * x - t) / t for x, t in zip(xs, ts, strict=True)]
        cut = max(_OUTLIER_FACTOR * statistics.median(residuals), _OUTLIER_FLOOR)
        kept = [i for i in range(len(xs)) if residuals[i] <= cut]
        if kept == keep or len(kept) < 2:
            break
        keep = kept
        line = _weighted_line([xs[i] for i in keep], [ts[i] for i in keep])
    return line, keep


def fit_regimes(xs: Sequence[float], ts: Sequence[float], known: int | None = None) -> Line:
    """:func:`fit_line`, or two such lines, :func:`fit_line`'s of the samples below a break in
    the bytes and of those from it, where they fit clearly better (module docstring): of every
    break leaving :data:`MIN_REGIME` sizes or more on each side, the one whose F test of one
    line against two (:func:`_break_p_value`) has the least p-value, if that p-value times the
    number of breaks tried is below :data:`SPLIT_LEVEL`, and stays so with the samples of any
    one size left out (a burst of load met at one size, on every axis alike, is no regime).
    With ``known`` (the bytes from which the backend runs another algorithm), that break is the
    one candidate, tried alone (so uncorrected) if it leaves :data:`MIN_REGIME` sizes each side,
    and the large regime starts there exactly."""
    sizes = sorted(set(xs))
    if known is not None:
        starts = [known] if sum(x < known for x in sizes) >= MIN_REGIME <= sum(x >= known for x in sizes) else []
    else:
        starts = sizes[MIN_REGIME : len(sizes) - MIN_REGIME + 1]  # a large regime's first size
    tried = [(_break_p_value(xs, ts, start), start) for start in starts]
    if tried and min(tried)[0] * len(starts) < SPLIT_LEVEL:
        start = min(tried)[1]
        without = ([k for k, x in enumerate(xs) if x != size] for size in sizes)
        if all(
            _break_p_value([xs[k] for k in w], [ts[k] for k in w], start) * len(starts) < SPLIT_LEVEL for w in without
        ):
            small, large = (
                fit_line(
                    [x for x in xs if (x < start) == below],
                    [t for x, t in zip(xs, ts, strict=True) if (x < start) == below],
                )
                for below in (True, False)
            )
            below = max(x for x in xs if x < start)
            at = known if known is not None else _break(small, large, below, start)
            return attrs.evolve(small, large=large, from_bytes=at)
    return fit_line(xs, ts)


def _break_p_value(xs: Sequence[float], ts: Sequence[float], start: float) -> float:
    """The p-value of the F test of one line against one below ``start`` and one from it
    (:func:`pooling_p_value`), all fitted to the same samples: those :func:`fit_line` keeps of
    all, or of their side (a wild sample that both drop decides nothing). 1 where it cannot
    be told (too few samples, or one line through every one to rounding)."""
    kept = set(_robust_line(xs, ts)[1])
    for below in (True, False):
        side = [i for i, x in enumerate(xs) if (x < start) == below]
        if len(side) < 2:
            return 1.0
        kept |= {side[k] for k in _robust_line([xs[i] for i in side], [ts[i] for i in side])[1]}
    points = [(xs[i], ts[i]) for i in sorted(kept)]
    pooled = _squared_residuals(_weighted_line([x for x, _ in points], [t for _, t in points]), points)
    if len(points) < 6 or pooled <= _EXACT * len(points):
        return 1.0
    sides = ([(x, t) for x, t in points if (x < start) == below] for below in (True, False))
    apart = math.fsum(
        _squared_residuals(_weighted_line([x for x, _ in side], [t for _, t in side]), side) for side in sides
    )
    return pooling_p_value(apart, pooled, len(points))


def _break(small: Line, large: Line, below: float, start: float) -> int:
    """Where the large regime starts, between the sizes ``below`` and ``start``: where the two
    lines cross, if they cross there (a bend), else their geometric mean (a jump, whose place
    between two measured sizes is not measured)."""
    if small.slope != large.slope:
        cross = (large.intercept - small.intercept) / (small.slope - large.slope)
        if below < cross < start:
            return math.ceil(cross)
    return math.ceil(math.sqrt(below * start))


def _squared_residuals(line: tuple[float, float], points: Sequence[tuple[float, float]]) -> float:
    """The sum of the squared relative residuals of ``(bytes, seconds)`` points off ``line``."""
    return math.fsum(((line[0] + line[1] * x - t) / t) ** 2 for x, t in points)


def pooling_p_value(rss_apart: float, rss_pooled: float, count: int) -> float:
    """The p-value of the F test (Chow's) that two groups of ``count`` points in all share one
    line: ``rss_apart`` is the sum of squared residuals off each group's own line, ``rss_pooled``
    off the line of both. With 2 parameters fewer under the shared line the statistic is
    ``F = ((rss_pooled - rss_apart) / 2) / (rss_apart / (count - 4))``, whose survival function
    on ``F(2, count - 4)`` has the closed form ``(1 + 2F / (count - 4)) ** (-(count - 4) / 2)``,
    that is ``(rss_apart / rss_pooled) ** ((count - 4) / 2)``. 0 where it cannot be told
    (fewer than 5 points, or lines through every point that the shared one misses)."""
    if count < 5:
        return 0.0
    if rss_pooled <= 0:
        return 1.0
    return min(rss_apart / rss_pooled, 1.0) ** ((count - 4) / 2)


def shared_slope_p_value(rss_apart: float, rss_shared: float, dof: int) -> float:
    """The p-value of the F test that groups of points share one slope, each its own intercept:
    ``rss_apart`` is the sum of squared residuals with a slope per group (``dof`` points more than
    parameters), ``rss_shared`` with one. With 1 parameter fewer, ``F = (rss_shared - rss_apart) /
    (rss_apart / dof)`` on ``F(1, dof)``, so ``sqrt(F)`` is Student's t of ``dof`` degrees, two-sided;
    its closed form for whole ``dof`` (Abramowitz and Stegun 26.7.3-4) is a series in
    ``cos(theta) ** 2 = rss_apart / rss_shared``. 0 where it cannot be told (``dof`` below 1)."""
    if dof < 1:
        return 0.0
    if rss_shared <= 0:
        return 1.0
    x = min(rss_apart / rss_shared, 1.0)  # cos(theta) ** 2
    term = total = 1.0
    if dof % 2 == 0:  # A = sin(theta) (1 + 1/2 cos^2 + 1.3/(2.4) cos^4 + ... up to cos^(dof-2))
        for k in range(1, dof // 2):
            term *= x * (2 * k - 1) / (2 * k)
            total += term
        inside = math.sqrt(1 - x) * total
    else:  # A = 2/pi (theta + sin cos (1 + 2/3 cos^2 + ... up to cos^(dof-3)))
        for k in range(1, (dof - 1) // 2):
            term *= x * (2 * k) / (2 * k + 1)
            total += term
        inside = 2 / math.pi * (math.acos(math.sqrt(x)) + (math.sqrt(x * (1 - x)) * total if dof > 1 else 0.0))
    return min(max(1 - inside, 0.0), 1.0)


Group = tuple[tuple[int, ...], list[tuple[float, float]], int]  # axes, kept (bytes, seconds) points, samples


def _pooled_lines(
    groups: dict[int, list[Sample]], level: float, regimes: bool, known: Mapping[int, int]
) -> dict[int, Line]:
    """Per axis, the line of one kind's samples on it (:func:`fit_line`), axes merged while two
    of them (or of the merged sets), of the same rounds, cannot be told apart at ``level``
    (:func:`pooling_p_value`; the pair with the largest p-value first); a merged set's line is
    the least-squares one over its axes' kept samples (module docstring). With ``regimes``, a
    set's samples get two lines instead where :func:`fit_regimes` finds a break (at ``known[axis]``,
    the axes' known break, where it has one). Sets told apart
    (of one regime, the same rounds) then share one slope, each its own intercept, while their
    slopes cannot be told apart at ``level`` (:func:`shared_slope_p_value`, merged likewise)."""
    sets: list[list[Group]] = []
    for axis, group in sorted(groups.items()):
        xs, ts = [s.bytes for s in group], [s.seconds for s in group]
        keep = _robust_line(xs, ts)[1]
        sets.append([((axis,), [(xs[i], ts[i]) for i in keep], len(group))])
    rounds = {axis: group[0].rounds for axis, group in groups.items()}

    def alike(a: list[Group], b: list[Group]) -> bool:
        return rounds[a[0][0][0]] == rounds[b[0][0][0]]

    def one_line(a: list[Group], b: list[Group]) -> float:
        points_a, points_b = ([p for g in c for p in g[1]] for c in (a, b))
        pooled = _rss([points_a + points_b])
        if pooled <= _EXACT * (len(points_a) + len(points_b)):  # one line through every point, to rounding
            return 1.0
        return pooling_p_value(_rss([points_a]) + _rss([points_b]), pooled, len(points_a) + len(points_b))

    def one_slope(a: list[Group], b: list[Group]) -> float:
        both = [g[1] for g in a + b]
        count = sum(map(len, both))
        shared = _rss(both)
        if shared <= _EXACT * count:
            return 1.0
        apart = _rss(both[: len(a)]) + _rss(both[len(a) :])
        return shared_slope_p_value(apart, shared, count - len(both) - 2)  # an intercept a set, a slope a family

    merged = [
        (tuple(sorted(a for g in c for a in g[0])), [p for g in c for p in g[1]], sum(g[2] for g in c))
        for c in _merge_while_alike(sets, alike, one_line, level)
    ]
    out, straight = {}, []
    for axes, points, total in merged:
        samples = [s for a in axes for s in groups[a]]
        breaks = {known.get(a) for a in axes}  # one: pooled axes are of one size
        at = breaks.pop() if len(breaks) == 1 else None
        split = fit_regimes([s.bytes for s in samples], [s.seconds for s in samples], at) if regimes else None
        if split is not None and split.large is not None:
            out.update({axis: attrs.evolve(split, axes=axes if len(axes) > 1 else ()) for axis in axes})
        else:
            straight.append([(axes, points, total)])
    for family in _merge_while_alike(straight, alike, one_slope, level):
        intercepts, slope = _weighted_lines([points for _, points, _ in family])
        shared = tuple(sorted(a for g in family for a in g[0])) if len(family) > 1 else ()
        for (axes, points, total), intercept in zip(family, intercepts, strict=True):
            line = Line(intercept, slope, len(points), total, axes if len(axes) > 1 else (), shared_slope=shared)
            out.update(dict.fromkeys(axes, line))
    return out


def _merge_while_alike(
    clusters: list[list[Group]],
    alike: Callable[[list[Group], list[Group]], bool],
    p_value: Callable[[list[Group], list[Group]], float],
    level: float,
) -> list[list[Group]]:
    """``clusters`` merged a pair at a time, of the ``alike`` pairs the one with the largest
    ``p_value`` first, while that is at least ``level``."""
    while True:
        best: tuple[float, int, int] | None = None
        for i, j in itertools.combinations(range(len(clusters)), 2):
            if alike(clusters[i], clusters[j]):
                p = p_value(clusters[i], clusters[j])
                if p >= level and (best is None or p > best[0]):
                    best = (p, i, j)
        if best is None:
            return clusters
        _, i, j = best
        clusters = [c for k, c in enumerate(clusters) if k not in (i, j)] + [clusters[i] + clusters[j]]


def _rss(sets: Sequence[Sequence[tuple[float, float]]]) -> float:
    """The squared relative residuals of the sets' points off their :func:`_weighted_lines`."""
    intercepts, slope = _weighted_lines(sets)
    return math.fsum(_squared_residuals((c, slope), points) for c, points in zip(intercepts, sets, strict=True))


def _weighted_line(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Least squares of ``(c0 + c1 x - t) / t``; through zero if ``c0`` would be negative."""
    (c0,), c1 = _weighted_lines([list(zip(xs, ts, strict=True))])
    return c0, c1


def _weighted_lines(sets: Sequence[Sequence[tuple[float, float]]]) -> tuple[list[float], float]:
    """Least squares of ``(c_k + s x - t) / t`` over the ``(x, t)`` points of every set ``k``:
    an intercept per set, one slope. The slope is the weighted covariance of bytes and time about
    each set's own weighted means over the variance likewise; a set whose intercept would be
    negative passes through zero instead (its terms about zero), and the rest are fitted again."""
    through_zero: set[int] = set()
    while True:
        num = den = 0.0
        means = []
        for k, points in enumerate(sets):
            w = [1 / t**2 for _, t in points]
            if k in through_zero:
                mx = mt = 0.0
            else:
                mx = math.fsum(wi * x for wi, (x, _) in zip(w, points, strict=True)) / math.fsum(w)
                mt = math.fsum(wi * t for wi, (_, t) in zip(w, points, strict=True)) / math.fsum(w)
            means.append((mx, mt))
            num += math.fsum(wi * (x - mx) * (t - mt) for wi, (x, t) in zip(w, points, strict=True))
            den += math.fsum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points, strict=True))
        if den <= 0 and len(through_zero) < len(sets):  # one size only: no slope but through zero
            through_zero = set(range(len(sets)))
            continue
        slope = num / den if den > 0 else 0.0
        intercepts = [mt - slope * mx for mx, mt in means]
        negative = {k for k, c in enumerate(intercepts) if c < 0 and k not in through_zero}
        if not negative:
            return intercepts, slope
        through_zero |= negative


def three_digits(value: float) -> float:
    """``value`` rounded to three significant digits."""
    return float(f"{value:.2e}")


def figures_of(line: Line, rounds: int, overhead: float = 0.0) -> tuple[float, float]:
    """(alpha, bandwidth) of a line fitted to samples of ``rounds`` rounds of steps that each
    also pay ``overhead``, rounded."""
    alpha = three_digits(max(line.intercept - overhead, 0.0) / rounds)
    return alpha, _bandwidth_of(line)


def _bandwidth_of(line: Line) -> float:
    return MAX_BANDWIDTH if line.slope <= 1 / MAX_BANDWIDTH else three_digits(1 / line.slope)


def fit_model(
    samples: Iterable[Sample], breaks: Mapping[tuple[str, int], int] | None = None
) -> tuple[CostModel, dict[tuple[str, int], Line]]:
    """The cost model of ``samples``: per kind, per axis figures (every kind and axis of the
    samples must have two or more). The first kind's figures (all_gather's, in
    :data:`PRICED_OPS` order) are the model's own, which every kind it does not name takes,
    and the others are its ``ops``; :data:`LOCAL` samples (two or more, any axes) give the
    executor terms (module docstring). Also the fitted lines, by (kind, axis), the executor
    terms' under (:data:`LOCAL`, -1). ``breaks``: per (kind, axis), the table bytes from which
    the backend runs that kind by another algorithm there (the runtime knows them:
    ``runtime.measure.calibrate.known_breaks``), each tested as the kind's one candidate break."""
    by_key: dict[tuple[str, int], list[Sample]] = {}
    local: list[Sample] = []
    for s in samples:
        if s.op == LOCAL:
            local.append(s)
        else:
            by_key.setdefault((s.op, s.axis), []).append(s)
    axes = sorted({axis for _, axis in by_key})
    ops = [op for op in PRICED_OPS if any(op == o for o, _ in by_key)]
    if not axes or axes != list(range(len(axes))) or any((op, a) not in by_key for op in ops for a in axes):
        raise ValueError("fit_model needs samples of every kind on every axis 0..k-1")
    if any(len({s.rounds for s in group}) > 1 for group in by_key.values()):
        raise ValueError("fit_model needs the samples of one kind on one axis to have the same rounds")
    overhead, copy_bandwidth, executor = 0.0, None, None
    if local:
        executor = fit_line([s.bytes for s in local], [s.seconds for s in local])
        overhead, copy_bandwidth = three_digits(executor.intercept), _bandwidth_of(executor)
        by_key = {key: [_less_copy(s, copy_bandwidth) for s in group] for key, group in by_key.items()}
    lines = {
        (op, axis): line
        for op in ops
        for axis, line in _pooled_lines(
            {a: by_key[op, a] for a in axes},
            POOL_LEVEL,
            op not in ONE_REGIME,
            {a: b for (o, a), b in (breaks or {}).items() if o == op},
        ).items()
    }
    if executor is not None:
        lines[LOCAL, -1] = executor
    costs = [_op_cost(op, [(lines[op, a], by_key[op, a][0].rounds) for a in axes], overhead) for op in ops]
    # The first kind's figures are the model's own; it is one of its ops too if it has two regimes.
    base = costs[0]
    model = CostModel(
        alpha=base.alpha,
        bandwidth=base.bandwidth,
        ops=costs if base.large is not None else costs[1:],
        overhead=overhead,
        copy_bandwidth=copy_bandwidth,
        margin=choice_margin([(lines[key], s) for key, group in by_key.items() for s in group]),
    )
    return model, lines


def choice_margin(fitted: Iterable[tuple[Line, Sample]]) -> float:
    """The choice margin (module docstring) of collective samples, each with the line fitted to
    it (its kind's on its axis; the sample less its priced copies, as the line was fitted): the
    median of ``|line.at(bytes) - seconds|``, rounded to three digits, or 0 where that is under
    a billionth of the median sample (lines through every sample, to rounding). E.g. samples of
    1.0, 2.2 and 2.9 ms on lines that give 1, 2 and 3 ms there: misses of 0, 0.2 and 0.1 ms,
    so 0.1 ms."""
    misses, times = [], []
    for line, sample in fitted:
        misses.append(abs(line.at(sample.bytes) - sample.seconds))
        times.append(sample.seconds)
    if not misses:
        return 0.0
    margin = statistics.median(misses)
    return 0.0 if margin <= 1e-9 * statistics.median(times) else three_digits(margin)


def _op_cost(op: str, lines: Sequence[tuple[Line, int]], overhead: float) -> OpCost:
    """The figures of a kind's lines, one per axis, with the rounds of its samples there; its
    large-message regime where one axis or more has two lines (an axis with one gives it its
    own figures, from the largest break of the others)."""
    small = [figures_of(line, rounds, overhead) for line, rounds in lines]
    alpha, bandwidth = tuple(f[0] for f in small), tuple(f[1] for f in small)
    breaks = [line.from_bytes for line, _ in lines if line.large is not None]
    if not breaks:
        return OpCost(op, alpha, bandwidth)
    large = [(line.from_bytes, *figures_of(line.large, rounds, overhead)) if line.large is not None
             else (max(breaks), *f) for (line, rounds), f in zip(lines, small, strict=True)]  # fmt: skip
    return OpCost(op, alpha, bandwidth, Regime(*(tuple(column) for column in zip(*large, strict=True))))


def _less_copy(sample: Sample, copy_bandwidth: float) -> Sample:
    """The sample less its step's local copies at ``copy_bandwidth`` (module docstring)."""
    if not sample.copied:
        return sample
    return attrs.evolve(sample, seconds=max(sample.seconds - sample.copied / copy_bandwidth, sample.seconds / 2))


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = math.fsum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = math.sqrt(math.fsum((a - mx) ** 2 for a in rx) * math.fsum((b - my) ** 2 for b in ry))
    return cov / var if var else 0.0


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def median_relative_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """The median of ``|predicted - measured| / measured``."""
    return statistics.median(abs(p - m) / m for p, m in zip(predicted, measured, strict=True))


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the ``k``-th smallest of ``m`` is
    multiplied by ``m - k`` (``k`` from 0), kept at least the adjusted one before it, and capped at
    1. A verdict at level 0.05 on the adjusted values errs on any of the family at most 5% of the
    time. E.g. ``[0.01, 0.04, 0.03]`` -> ``[0.03, 0.06, 0.06]``."""
    order = sorted(range(len(ps)), key=ps.__getitem__)
    adjusted = [1.0] * len(ps)
    running = 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - k) * ps[i]))
        adjusted[i] = running
    return adjusted
