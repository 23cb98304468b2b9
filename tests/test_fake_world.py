"""One rank of a large world in one process (torch's fake process group): the optimizer's own
per-step work does not grow with the rank count, and what a rank of a 4,096-rank world holds
for a 7B-shaped model is what ``memory_report()`` says: its tensors' storages exactly, and the
resident set the OS measures within 10% of them plus the optimizer's Python objects
(docs/memory.md, "At scale"; the 7B case runs in fresh processes as the bench does), and those
objects are the same at 4,096 and 65,536 ranks.

Each case runs rank 0 of fake worlds of 256 and 4,096 ranks (``bench/bench_fake_world.py``'s
``run_world``, in a process forked by ``runtime.testing.run_ranks``) and compares one steady
step's Python calls per function, its peak Python allocation and its CPU time. A step that walks
the ranks, or posts a message per peer, does 16 times the work at 4,096 ranks: the control
cases add such work on purpose and must be caught by the same comparison.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.testing import run_ranks

BENCH = Path(__file__).resolve().parent.parent / "bench"
SMALL, LARGE = 256, 4096
HUGE = 65536  # where the 7B run's Python objects are compared with LARGE's
# Two blocks with every piece of rank 0 non-empty at both world sizes.
MODEL = {"vocab": 4096, "hidden": 1024, "ffn": 4096, "layers": 2}
STEPS = 9  # two that plan, five timed, one traced, one counted


def _bench() -> Any:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import bench_fake_world

    return bench_fake_world


def _walk_dp_group(world: int) -> Callable[[], object]:
    """What a step that computed its dp group anew would do: the group's ranks, then the world's."""
    from runtime.comm.groups import axis_ranks
    from shardlang.mesh import Mesh

    mesh = Mesh((world // 8, 8))
    return lambda: (axis_ranks(mesh, (0,), 0), tuple(mesh.ranks))


def _fake_worlds(rank: int, world_size: int, cases: tuple[str, ...]) -> dict[str, dict[int, dict[str, Any]]]:
    """Per case, rank 0 of fake worlds of SMALL and LARGE ranks, the step altered as the case
    says: ``walk`` computes the dp group's ranks on every step; ``gloo`` takes gloo's code paths
    with every all_gather large enough for messages, ``gloo-uncapped`` in groups of any size."""
    from runtime.comm import collectives

    fw = _bench()
    kept = (collectives._is_gloo, collectives.GATHER_MESSAGES_BYTES, collectives.GATHER_MESSAGES_MAX_RANKS)
    got: dict[str, dict[int, dict[str, Any]]] = {}
    for case in cases:
        if case.startswith("gloo"):
            collectives._is_gloo = lambda group: True  # type: ignore[assignment]
            collectives.GATHER_MESSAGES_BYTES = 0
        if case == "gloo-uncapped":
            collectives.GATHER_MESSAGES_MAX_RANKS = 2**31
        got[case] = {}
        for world in (SMALL, LARGE):
            fw.join_fake_world(world)
            around = _walk_dp_group(world) if case == "walk" else None
            # No plan check on gloo's paths: its messages land nowhere here, so fingerprints differ.
            result = fw.run_world(
                world, steps=STEPS, model=MODEL, around_step=around, warm_up=False, verify=not case.startswith("gloo")
            )
            got[case][world] = {k: result[k] for k in ("calls", "alloc_per_step", "step_min_s", "counted", "predicted")}
        collectives._is_gloo, collectives.GATHER_MESSAGES_BYTES, collectives.GATHER_MESSAGES_MAX_RANKS = kept
    return got


def growth(small: dict[str, Any], large: dict[str, Any]) -> list[str]:
    """What one steady step did more of at LARGE ranks than at SMALL, beyond what noise and
    layout details give (empty: nothing grew with the ranks)."""
    grew = []
    for name, n in large["calls"].items():
        if n > 1.25 * small["calls"].get(name, 0) + 2:
            grew.append(f"{name} called {small['calls'].get(name, 0)} -> {n} times")
    if large["alloc_per_step"] > 1.5 * small["alloc_per_step"] + 4096:
        grew.append(f"Python allocations {small['alloc_per_step']} -> {large['alloc_per_step']} B")
    if large["step_min_s"] > 3 * small["step_min_s"] + 0.002:
        grew.append(f"CPU time {small['step_min_s'] * 1e3:.2f} -> {large['step_min_s'] * 1e3:.2f} ms")
    return grew


@pytest.fixture(scope="module")
def worlds() -> dict[str, dict[int, dict[str, Any]]]:
    return run_ranks(_fake_worlds, 1, args=(("plain", "walk", "gloo", "gloo-uncapped"),), timeout=120)[0]


def test_a_steady_step_does_the_same_work_at_256_and_4096_ranks(worlds: dict) -> None:
    got = worlds["plain"]
    assert growth(got[SMALL], got[LARGE]) == []
    assert sum(got[LARGE]["calls"].values()) > 100  # the step was counted at all


def test_work_that_walks_the_ranks_is_caught(worlds: dict) -> None:
    # The same step plus the dp group's ranks computed anew: 32 ranks against 512.
    grew = growth(worlds["walk"][SMALL], worlds["walk"][LARGE])
    assert any("Python allocations" in g for g in grew), grew


def test_gloo_gathers_post_no_message_per_peer_in_large_groups(worlds: dict) -> None:
    # On gloo an all_gather as messages posts two per peer (runtime.comm.collectives); over 32 and 512 dp
    # ranks it is gloo's ring, and lifting the cap shows the growth it avoids.
    assert growth(worlds["gloo"][SMALL], worlds["gloo"][LARGE]) == []
    assert growth(worlds["gloo-uncapped"][SMALL], worlds["gloo-uncapped"][LARGE]) != []


def test_what_the_optimizer_holds_is_its_memory_report_in_every_world(worlds: dict) -> None:
    for world, got in worlds["plain"].items():
        # The storages the parameters, gradients and the optimizer's tensors hold, against the
        # report: equal but for the commit flags (three int64, and one after the commit point,
        # which the report leaves out).
        assert 0 <= got["counted"] - got["predicted"] <= 32, (world, got["counted"], got["predicted"])


@pytest.fixture(scope="module")
def seven_b() -> dict[str, Any]:
    """As the bench runs it: a fresh process per measurement (glibc's mmap threshold at 64 KiB,
    one thread), a one-block warm-up, then three steps; further processes trace Python's
    objects, at LARGE ranks and at 65,536."""
    fw = _bench()
    args = argparse.Namespace(steps=3, profile=0, bucket_bytes=None, timeout=120.0)
    return {
        "run": fw._in_fresh_process(LARGE, args),
        "objects": {world: fw._in_fresh_process(world, args, trace_objects=True)["objects"] for world in (LARGE, HUGE)},
    }


def test_one_rank_of_4096_holds_its_7b_shards_as_reported(seven_b: dict[str, Any]) -> None:
    got, objects = seven_b["run"], seven_b["objects"][LARGE]
    # Rank 0's pieces of 6.7B parameters: about a 4,096th of them, norms replicated.
    assert 1.6e6 < got["elements"] < 2.1e6, got["elements"]
    assert abs(got["counted"] - got["predicted"]) <= 0.1 * got["counted"], got["report"]
    assert got["buckets"] >= 2  # the norms' reduce-scatter and all-gather ran as buckets
    # What the OS says the rank holds (VmRSS after less before the model) against the report's
    # tensors plus the optimizer's Python objects, which the report leaves out (about 3 MiB, the
    # bench's docstring): within 10%.
    assert 0 < objects < 0.25 * got["predicted"], (objects, got["report"])
    # The report's host kind (planner.memory.HOST_BYTES_PER_TENSOR per tensor) is those objects.
    assert abs(got["host"] - objects) <= 0.25 * objects, (got["host"], objects)
    assert abs(got["held_rss"] - (got["predicted"] + objects)) <= 0.1 * got["held_rss"], (
        got["held_rss"],
        got["predicted"],
        objects,
    )


def test_the_optimizers_objects_do_not_grow_with_the_ranks(seven_b: dict[str, Any]) -> None:
    # The same 291 tensors, plans and buckets at 4,096 and 65,536 ranks: what the optimizer keeps
    # alive may not follow the world. A group's or the commit's ranks kept one by one would add
    # 36 bytes a rank (an int and its slot): 2.3 MiB for the commit's 65,536 alone.
    small, huge = seven_b["objects"][LARGE], seven_b["objects"][HUGE]
    assert abs(huge - small) <= 0.02 * small + 64 * 1024, (small, huge)
