"""The memos that searches share (``planner.space``'s moves memo, ``planner.bound``'s bytes
bounds) change no plan, no count and no bound: a search run after many others on the same mesh
and tensor (the memos warm, from pairs with other sources and targets) gives the very plan, the
very count of states and the very bound at its source that the same search gives cold (every
memo cleared by ``bench/bench_search_speed.py``'s ``cold``), and that plan's (time, steps) is
the naive optimum of that bench's :class:`Naive`.
"""

from __future__ import annotations

import random
import sys

import planner
from planner import search
from shardlang import Layout, Mesh
from shardlang.dtypes import itemsize
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import bench_search_speed as bench  # bench/bench_search_speed.py


def _outcome(src, dst, shape, dtype, cost):
    """The search's outcome (plan, states) and its bound's bytes parts at the source."""
    outcome = search.collective_outcome(search.checked(src, dst, shape, dtype, cost, None))
    kept = search._kept_axes(src, dst)
    problem = search._Problem(src, dst, shape, itemsize(dtype), kept, search._tables(cost, src.mesh, kept))
    _, _, reduce_mask, move_mask = problem.start_terms
    elements = problem.space.local_elements(problem.src_dims)
    bound = problem.bound
    return outcome, bound.quick_bytes_bound(elements, reduce_mask), bound.bytes_bound(elements, reduce_mask, move_mask)


def test_a_warm_search_is_the_fresh_search() -> None:
    """Pairs as the suggest command asks them: a few sources, each to many targets, on one
    mesh with several tensors of one rank (so that searches share states, and the memo is keyed
    by the shape, the last move and what the moves read of the target), under a model with
    interchangeable axes (rule 2) and under a calibrated one (copies priced, other rules)."""
    rng = random.Random(7)
    checked = 0
    for mesh_shape in ((2, 2, 4), (2, 4, 2, 2)):
        mesh = Mesh(mesh_shape)
        for cost in (planner.CostModel(alpha=2e-5, bandwidth=25e9), bench.calibrated_model(len(mesh_shape))):
            naive = bench.Naive(mesh_shape, cost)
            pairs = []
            for partial in (0.6, 0.3, 0.0):
                src = bench.random_layout(rng, mesh, 2, partial=partial, split=(partial, partial + 0.4))
                for _ in range(8):
                    dst = bench.random_layout(rng, mesh, 2, partial=0.3, split=(0.3, 0.8))
                    # The same target with its last idle axis pending a sum, if it has two: an
                    # idle twin of a lower axis in one target and not in the other (rule 2).
                    idle = [a for a in range(mesh.ndim) if dst.dim_of_axis(a) is None and a not in dict(dst.partial)]
                    targets = [dst]
                    if len(idle) > 1:
                        targets.append(Layout(dims=dst.dims, mesh=mesh, partial=(*dst.partial, (idle[-1], "sum"))))
                    for target in targets:
                        if src != target:
                            pairs += [(src, target, shape) for shape in ((64, 48), (48, 64), (63, 48), (37, 100))]
            bench.cold()
            warm = [_outcome(src, dst, shape, "bf16", cost) for src, dst, shape in pairs]
            for (src, dst, shape), found in zip(pairs, warm, strict=True):
                bench.cold()
                assert _outcome(src, dst, shape, "bf16", cost) == found, f"{src} -> {dst} {shape}"
                plan = found[0][0]
                units, steps, _ = naive.solve(src, dst, shape, 2)
                assert naive.replay(plan, 2) == (units, steps), f"{src} -> {dst} {shape}"
                checked += 1
    assert checked > 250
