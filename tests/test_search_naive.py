"""The search against a naive exact one under calibrated models: the same optimum on every pair,
and an A* bound that never passes what an optimal plan still costs.

The naive search is ``bench/bench_search_speed.py``'s :class:`Naive`: a plain uniform-cost
search over the full baseline move set, written from the cost and copy tables alone (its own
states, moves, sizes and exact units; no bound, no pruning), which also replays the planner's
plan step by step (each a legal move with the table's bytes). docs/calibration.md, "Exactness
and the A* bound".
"""

from __future__ import annotations

import random
import sys
from fractions import Fraction

import attrs
import pytest

import planner
from planner import search
from planner.space import roles_of
from shardlang import Mesh
from shardlang.dtypes import itemsize
from tests.conftest import REPO
from tests.test_planner_optimal import calibrated_looking

sys.path.insert(0, str(REPO / "bench"))

import bench_search_speed as bench  # bench/bench_search_speed.py


@pytest.mark.parametrize(("mesh_shape", "count"), [((4, 4, 4), 16), ((2, 2, 2, 8), 8)])
def test_the_plan_is_the_naive_optimum(mesh_shape: tuple[int, ...], count: int) -> None:
    cost = bench.calibrated_model(len(mesh_shape))
    naive = bench.Naive(mesh_shape, cost)
    pairs = bench.random_pairs(random.Random(f"test-{mesh_shape}"), Mesh(mesh_shape), count)
    generated = []
    for src, dst, shape, dtype in pairs:
        _, ours, theirs = bench.check_pair(naive, src, dst, shape, dtype, cost)  # asserts equal (time, steps)
        generated.append((ours, theirs))
    # The bound does its work: the naive search generates more states in all.
    assert sum(o for o, _ in generated) < sum(n for _, n in generated)


def _models(rng: random.Random, naxes: int) -> list[planner.CostModel]:
    """The bench's model and random ones as ``shardlang calibrate`` writes them, with every
    executor term and, on some, a large-message regime cheaper or dearer than the kind's own."""
    models = [bench.calibrated_model(naxes)]
    for _ in range(3):
        base = calibrated_looking(rng, naxes)
        ops = list(base.ops)
        kinds = [i for i, c in enumerate(ops) if c.op != "point_to_point"]  # one regime there
        if kinds and rng.random() < 0.7:
            at = rng.choice(kinds)
            own = ops[at]
            scale = rng.choice((0.3, 3.0))
            large = planner.Regime(rng.choice((256, 4096, 65536)), own.alpha, tuple(b * scale for b in own.bandwidth))
            ops[at] = attrs.evolve(own, large=large)
        models.append(
            attrs.evolve(
                base,
                ops=tuple(ops),
                overhead=rng.choice((0.0, 1.7e-4)),
                margin=rng.choice((0.0, 3.66e-4)),
                copy_bandwidth=rng.choice((None, 3.55e9)),
            )
        )
    return models


def test_the_bound_never_passes_what_is_left_along_an_optimal_plan() -> None:
    """At every state of an optimal plan, the search's bound (per task kind rates, the overhead
    and margin of the steps each axis needs) is at most what the rest of the plan costs, priced
    by the naive search in seconds, exactly."""
    rng = random.Random(5)
    checked = 0
    for mesh_shape in ((4, 4), (2, 2, 4), (4, 4, 4)):
        mesh = Mesh(mesh_shape)
        for cost in _models(rng, len(mesh_shape)):
            naive = bench.Naive(mesh_shape, cost)
            for src, dst, shape, dtype in bench.random_pairs(rng, mesh, 6):
                plan, _, _ = bench.check_pair(naive, src, dst, shape, dtype, cost)
                kept = search._kept_axes(src, dst)
                assert kept == tuple(range(mesh.ndim))
                tables = search._tables(cost, mesh, kept)
                problem = search._Problem(src, dst, shape, itemsize(dtype), kept, tables)
                # The search's units per second, from a latency (all nonzero in these models).
                scale = Fraction(tables.per_round["all_gather"][0]) / Fraction(tables.figures["all_gather"][0][0])
                left = Fraction(naive.replay(plan, itemsize(dtype))[0], naive.scale)
                for index, layout in enumerate(plan.layouts()):
                    roles = roles_of((layout.dims, layout.partial), mesh.ndim, dst.dims)
                    units, steps, reduce_mask, move_mask = problem.bound.state_terms(roles)
                    elements = problem.space.local_elements(layout.dims)
                    estimate = units + problem.bound.bytes_bound(elements, reduce_mask, move_mask)
                    assert steps <= len(plan.steps) - index
                    assert estimate / scale <= left, f"bound too high at {layout} on {src} -> {dst} {shape}"
                    checked += 1
                    if index < len(plan.steps):
                        step = plan.steps[index]
                        move = [
                            m
                            for m in naive.moves(bench._state(layout), shape, itemsize(dtype), dict(dst.partial))
                            if m[:6] == (step.op, step.axis, step.dim, step.to_dim, step.reduce_op,
                                         bench._state(step.layout))
                        ]  # fmt: skip
                        left -= Fraction(naive.price(move[0][0], move[0][1], *move[0][6:]), naive.scale)
                assert left == 0
    assert checked > 150
