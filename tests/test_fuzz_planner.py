"""Fuzzing the planner and ``shardlang check``: random meshes of up to 20 axes and a million
ranks, random layouts. Every call ends within the search budget's time, with a plan or a
ShardlangError (README: the planner)."""

from __future__ import annotations

import random
import time

import planner
from cli.check import check_file
from planner import choice, search
from shardlang import Layout, Mesh, ShardlangError

MAX_RANKS = 1 << 20
OPS = ("sum", "avg", "max", "min")
SECONDS = 2.0  # the planner's goal per input
SLACK = 1.0  # a loaded 2-core machine


def random_mesh(rng: random.Random) -> Mesh:
    kind = rng.random()
    if kind < 0.1:
        return Mesh(shape=(MAX_RANKS,))
    if kind < 0.2:
        return Mesh(shape=(1024, 1024))
    shape, size = [], 1
    for _ in range(rng.randint(1, 20)):
        n = rng.choice((1, 1, 2, 2, 2, 3, 4, 8))
        n = n if size * n <= MAX_RANKS else 1
        shape.append(n)
        size *= n
    return Mesh(shape=tuple(shape))


def random_layout(rng: random.Random, mesh: Mesh, ndim: int, partial: bool) -> Layout:
    dims: list[list[int]] = [[] for _ in range(ndim)]
    pending = []
    for axis in rng.sample(range(mesh.ndim), mesh.ndim):
        r = rng.random()
        if partial and r < 0.3:
            pending.append((axis, rng.choice(OPS)))
        elif r < 0.6:
            dims[rng.randrange(ndim)].append(axis)
    return Layout(dims=dims, mesh=mesh, partial=pending)


def random_request(rng: random.Random) -> tuple[Layout, Layout, tuple[int, ...], bool]:
    mesh = random_mesh(rng)
    ndim = rng.randint(1, 3)
    shape = tuple(rng.choice((1, 7, 64, 1000, 4096, 1 << 20)) for _ in range(ndim))
    src = random_layout(rng, mesh, ndim, partial=True)
    other = random_mesh(rng) if rng.random() < 0.2 else mesh
    dst = random_layout(rng, other, ndim, partial=rng.random() < 0.3)
    return src, dst, shape, rng.random() < 0.3


def ends_in_time(call) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        call()
        what = "plan"
    except ShardlangError as e:  # PlanError, PlanBudgetError, LayoutError: all ours
        what = type(e).__name__
    return what, time.perf_counter() - start


def test_random_requests_end_within_the_budget_with_a_plan_or_our_error():
    rng = random.Random(15)
    outcomes: dict[str, int] = {}
    for _ in range(40):
        src, dst, shape, p2p = random_request(rng)
        search._plan_cached.cache_clear()
        choice._cheapest.cache_clear()
        what, seconds = ends_in_time(lambda: planner.plan(src, dst, shape, point_to_point=p2p))  # noqa: B023
        assert seconds < SECONDS + SLACK, f"{src} -> {dst} {shape} p2p={p2p}: {seconds:.2f} s"
        outcomes[what] = outcomes.get(what, 0) + 1
    assert outcomes.get("plan", 0) >= 5 and outcomes.get("PlanBudgetError", 0) >= 1, outcomes


def test_random_specs_check_within_the_budget(tmp_path):
    rng = random.Random(16)
    for i in range(6):
        mesh = random_mesh(rng)
        ndim = rng.randint(1, 2)
        shape = ",".join(str(rng.choice((64, 4096, 1 << 20))) for _ in range(ndim))
        param, state = (random_layout(rng, mesh, ndim, partial=False) for _ in range(2))
        grad = random_layout(rng, mesh, ndim, partial=True)
        path = tmp_path / f"fuzz{i}.shard"
        path.write_text(f"tensor w : f32[{shape}] {{\n  param = {param}\n  grad = {grad}\n  state = {state}\n}}\n")
        search._plan_cached.cache_clear()
        start = time.perf_counter()
        checked = check_file(str(path), open("/dev/null", "w"))  # noqa: SIM115
        seconds = time.perf_counter() - start
        assert seconds < SECONDS + SLACK, f"{path.read_text()}: {seconds:.2f} s"
        assert checked.error is None or isinstance(checked.error, ShardlangError)
