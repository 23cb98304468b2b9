"""Fuzzing the planner and ``shardlang check``: random meshes of up to 20 axes and a million
ranks, random layouts. Every call ends with a plan or a ShardlangError, its searches within
the search budget (README: the planner; the seconds that budget takes are in
bench/bench_planner_budget.py)."""

from __future__ import annotations

import random

import planner
from cli.check import check_file
from shardlang import Layout, Mesh, ShardlangError
from tests.test_planner_budget import Searches

MAX_RANKS = 1 << 20
OPS = ("sum", "avg", "max", "min")


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


def outcome(call) -> str:
    try:
        call()
    except ShardlangError as e:  # PlanError, PlanBudgetError, LayoutError: all ours
        return type(e).__name__
    return "plan"


def test_random_requests_end_within_the_budget_with_a_plan_or_our_error(monkeypatch):
    rng = random.Random(15)
    searches = Searches(monkeypatch)
    outcomes: dict[str, int] = {}
    for _ in range(40):
        src, dst, shape, p2p = random_request(rng)
        searches.cold()
        what = outcome(lambda: planner.plan(src, dst, shape, point_to_point=p2p))  # noqa: B023
        assert searches.within(), f"{src} -> {dst} {shape} p2p={p2p}: {searches.states}"
        outcomes[what] = outcomes.get(what, 0) + 1
    assert outcomes.get("plan", 0) >= 5 and outcomes.get("PlanBudgetError", 0) >= 1, outcomes


def test_random_specs_check_within_the_budget(tmp_path, monkeypatch):
    rng = random.Random(16)
    searches = Searches(monkeypatch)
    for i in range(6):
        mesh = random_mesh(rng)
        ndim = rng.randint(1, 2)
        shape = ",".join(str(rng.choice((64, 4096, 1 << 20))) for _ in range(ndim))
        param, state = (random_layout(rng, mesh, ndim, partial=False) for _ in range(2))
        grad = random_layout(rng, mesh, ndim, partial=True)
        path = tmp_path / f"fuzz{i}.shard"
        path.write_text(f"tensor w : f32[{shape}] {{\n  param = {param}\n  grad = {grad}\n  state = {state}\n}}\n")
        searches.cold()
        checked = check_file(str(path), open("/dev/null", "w"))  # noqa: SIM115
        # Each of the check's requests is bounded as above; per search, the same bound.
        assert all(n <= planner.DEFAULT_MAX_STATES + 1 for n in searches.states), path.read_text()
        assert checked.error is None or isinstance(checked.error, ShardlangError)
