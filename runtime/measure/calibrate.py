"""Measuring the machine for the cost model: ``shardlang calibrate`` (docs/calibration.md).

:func:`sweep` times every collective kind on every mesh axis at message sizes from 4 KiB to 16
MiB (finer from 724 KiB, :data:`SWEEP_BYTES`), through the same calls the executor makes
(``runtime.comm.collectives``: on gloo a reduce_scatter is an all_to_all plus a local sum), all groups of an
axis at once as in a plan's step, and a plan of one slice step, which sends nothing (the
executor's fixed cost of a step and its copy of the result: ``planner.fit``'s executor terms).
Each repetition starts after a barrier of the whole mesh; a repetition's time is the slowest
rank's (one all-reduce of every rank's times per size), and a sample is the median over
repetitions. At each size the plans of every kind on every axis are timed together, interleaved
repetition by repetition, so that noise hits them alike: load that comes and goes in time would
otherwise show up as a difference between kinds or between axes (a sweep of one axis after the
other measured physically identical axes here up to 2.7x apart at small sizes, consistently over
several sizes), and ``planner.fit`` pools axes whose lines it cannot tell apart. The sizes are
swept twice (``passes``), a sample's median taken over both passes' repetitions, so that a burst
of load on the machine during one pass moves it less; sizes up to :data:`SMALL_BYTES` get
:data:`SMALL_REPS_FACTOR` times the repetitions (cheap, and their medians set the fixed costs).
A sample's bytes are what the cost table counts for the step (``planner.cost``; a slice's: the
target piece it copies), so that ``planner.fit`` fits the table's own formula. A time budget
bounds the sweep: once a pass has used its share of the budget, its larger sizes are skipped
(every rank agrees, from the all-reduced clocks); a size is sampled if either pass timed it, on
every axis alike. :func:`time_plans` runs whole plans the same way (``--check`` and the
benchmark).

Every rank of the mesh calls both, in the same order; the default process group must be up.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from planner import Plan, point_to_point_plan
from planner import plan as plan_pair
from planner.cost import collective_rounds
from planner.fit import LOCAL, Sample
from runtime.comm.collectives import default_device, gather_messages_from
from runtime.execution.executor import reshard
from runtime.memory.pieces import shard
from shardlang import Layout, Mesh

# The larger buffer of a call: 4 KiB .. 256 KiB by factors of 4, then 724 KiB to 16 MiB by factors
# of sqrt(2), where a backend's time per byte changes (``planner.fit`` fits two regimes where it
# does); 724 KiB and 1 MiB lie either side of gloo's all_gather switch (:func:`known_breaks`).
SWEEP_BYTES = (*(4096 * 4**k for k in range(4)), *(round(2**20 * 2 ** (k / 2)) for k in range(-1, 9)))
DEFAULT_REPS = 7  # per pass
# Sizes up to here are timed SMALL_REPS_FACTOR times as often: their times are mostly the
# fixed cost that decides latency-bound plans, the scheduling of 4 ranks on 2 cores spreads them
# by tens of percent, and a repetition there costs milliseconds.
SMALL_BYTES = 256 * 1024
SMALL_REPS_FACTOR = 3
DEFAULT_PASSES = 2
DEFAULT_BUDGET = 45.0  # seconds for the whole sweep
_COLUMNS = 64


def step_plans(mesh: Mesh, axis: int, size: int) -> dict[str, Plan]:
    """One plan of one step per kind on mesh ``axis``, of an f32 ``[rows, 64]`` tensor whose
    larger local buffer is about ``size`` bytes: ``S(a) -> R`` (all_gather), ``R | P(a) -> S(a)``
    (reduce_scatter), ``R | P(a) -> R`` (all_reduce), ``S(a),R -> R,S(a)`` (all_to_all, and by
    one point-to-point step), and under ``slice`` a ``R -> S(a)`` of a tensor whose target
    piece is about ``size`` bytes."""
    n = mesh.shape[axis]
    shape = (max(size // 4 // _COLUMNS // n, 1) * n, _COLUMNS)
    split = Layout(dims=((axis,), ()), mesh=mesh)
    whole = Layout(dims=((), ()), mesh=mesh)
    reduced = Layout(dims=((), ()), mesh=mesh, partial=((axis, "sum"),))
    moved = Layout(dims=((), (axis,)), mesh=mesh)
    plans = {
        "all_gather": plan_pair(split, whole, shape),
        "reduce_scatter": plan_pair(reduced, split, shape),
        "all_reduce": plan_pair(reduced, whole, shape),
        "all_to_all": plan_pair(split, moved, shape),
        "point_to_point": point_to_point_plan(split, moved, shape),
        LOCAL: plan_pair(whole, split, (shape[0] * n, _COLUMNS)),
    }
    for op, planned in plans.items():
        if [s.op for s in planned.steps] != [op]:  # the default model's choice for these pairs
            raise AssertionError(f"the calibration plan for {op} has steps {[s.op for s in planned.steps]}")
    return plans


def step_rounds(plan: Plan) -> int:
    """The rounds the cost table charges the plan's one step: ``collective_rounds`` of a
    collective (none of a slice); the messages the busiest rank sends or receives of a
    point-to-point step (``planner.p2p``)."""
    (step,) = plan.steps
    if step.axis is not None:
        return collective_rounds(step.op, plan.src.mesh.shape[step.axis])
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    for t in step.transfers:
        if t.src_rank != t.dst_rank:
            sent[t.src_rank] = sent.get(t.src_rank, 0) + 1
            received[t.dst_rank] = received.get(t.dst_rank, 0) + 1
    return max([*sent.values(), *received.values(), 1])


def sample_bytes(op: str, plan: Plan) -> int:
    """A sample's bytes: the step's bytes per rank of the cost table; a slice's, the target
    piece it copies (``planner.fit``)."""
    if op == LOCAL:
        return math.prod(plan.dst.local_shape(plan.shape)) * 4
    return plan.steps[0].bytes


def known_breaks(mesh: Mesh) -> dict[tuple[str, int], int]:
    """Per (kind, axis), the cost table's bytes from which ``runtime.comm.collectives`` runs that kind by
    another algorithm on this backend, for ``planner.fit.fit_model``: on gloo an all_gather whose
    result has ``G`` bytes or more (:func:`runtime.comm.collectives.gather_messages_from`). A result is ``n``
    padded pieces of ``b`` bytes, and the table counts ``(n-1) * b``, so the result reaches ``G``
    exactly when the table's bytes reach ``(n-1) * ceil(G / n)``. None on other backends (NCCL),
    nor on axes of more ranks than gloo's messages serve."""
    breaks = {}
    for axis, n in enumerate(mesh.shape):
        result = gather_messages_from(ranks=n)
        if result is not None:
            breaks[("all_gather", axis)] = (n - 1) * -(-result // n)
    return breaks


def sweep(
    mesh: Mesh,
    *,
    sizes: Sequence[int] = SWEEP_BYTES,
    reps: int = DEFAULT_REPS,
    budget: float = DEFAULT_BUDGET,
    passes: int = DEFAULT_PASSES,
) -> list[Sample]:
    """The samples of every kind on every axis of ``mesh`` (of two or more ranks), the same
    list on every rank (module docstring)."""
    runs: dict[int, list[list[float]]] = {}  # size -> per plan of every axis, every run
    for _ in range(passes):
        started = time.perf_counter()
        for size in sizes:
            plans = [p for axis in range(mesh.ndim) for p in step_plans(mesh, axis, size).values()]
            measured = timed_runs(plans, reps * (SMALL_REPS_FACTOR if size <= SMALL_BYTES else 1), started)
            for timed, new in zip(runs.setdefault(size, [[] for _ in plans]), measured, strict=False):
                timed.extend(new)
            if measured[-1][-1] > budget / passes:
                break
    samples = []
    for size, timed in sorted(runs.items()):
        named = [(axis, op, p) for axis in range(mesh.ndim) for op, p in step_plans(mesh, axis, size).items()]
        for (axis, op, planned), times in zip(named, timed, strict=True):
            seconds = statistics.median(times)
            copied = planned.copied_bytes()[0]  # what the model prices apart (planner.fit)
            samples.append(Sample(op, axis, step_rounds(planned), sample_bytes(op, planned), seconds, copied))
    return sorted(samples, key=lambda s: s.axis)  # by axis, then size, then kind


def time_plans(plans: Sequence[Plan], reps: int = 5) -> list[float]:
    """Per plan (all on one mesh, which every rank is in), the median over ``reps`` runs of
    the slowest rank's time to ``reshard`` by it, the plans interleaved run by run."""
    return [statistics.median(times) for times in timed_runs(plans, reps)]


def timed_runs(plans: Sequence[Plan], reps: int, clock: float | None = None) -> list[list[float]]:
    """Per plan, the slowest rank's time of each of ``reps`` runs, the plans interleaved run by
    run (so run ``k`` of every plan met the same load: a paired sample). With
    ``clock`` (a ``perf_counter`` reading), one more entry: the most seconds since then on any
    rank, after each run."""
    rank = dist.get_rank()
    pieces = []
    for plan in plans:
        full = torch.randn(plan.shape, generator=torch.Generator().manual_seed(0))
        pieces.append(shard(full, plan.src, rank).to(default_device()))
        reshard(pieces[-1], plan.src, plan.dst, global_shape=plan.shape, plan=plan)  # warm-up, agreement
    times = torch.zeros(len(plans) + 1, reps)
    for rep in range(reps):
        for k, (plan, piece) in enumerate(zip(plans, pieces, strict=True)):
            dist.barrier()
            begun = time.perf_counter()
            reshard(piece, plan.src, plan.dst, global_shape=plan.shape, plan=plan)
            times[k, rep] = time.perf_counter() - begun
        if clock is not None:
            times[len(plans), rep] = time.perf_counter() - clock
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    rows = times.tolist()
    return rows if clock is not None else rows[:-1]


def sample_pairs(
    mesh: Mesh, count: int, rng: random.Random, low: int, high: int
) -> list[tuple[Layout, Layout, tuple[int, ...]]]:
    """``count`` random (source, target, shape) on ``mesh``: f32 [rows, cols] tensors of ``low``
    to ``high`` bytes (log-uniform), sources partial (sum) over some axes, targets not, no two
    alike and none a no-op."""
    out: list[tuple[Layout, Layout, tuple[int, ...]]] = []
    for _ in range(1000 * count):
        if len(out) == count:
            break
        cols = rng.choice((256, 1024))
        rows = max(mesh.size, round(math.exp(rng.uniform(math.log(low), math.log(high))) / 4 / cols))
        src, dst = _random_layout(rng, mesh, partial=True), _random_layout(rng, mesh, partial=False)
        if (src, dst, (rows, cols)) not in out and (src.dims, src.partial) != (dst.dims, dst.partial):
            out.append((src, dst, (rows, cols)))
    return out


def _random_layout(rng: random.Random, mesh: Mesh, partial: bool) -> Layout:
    dims: list[list[int]] = [[], []]
    reduced = []
    for axis in rng.sample(range(mesh.ndim), mesh.ndim):
        role = rng.random()
        if partial and role < 0.3:
            reduced.append((axis, "sum"))
        elif role < 0.55:
            continue
        else:
            dims[rng.randrange(2)].append(axis)
    return Layout(dims=dims, mesh=mesh, partial=sorted(reduced))
