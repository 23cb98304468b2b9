"""The search budget, size-1 axes, and meshes of a million ranks (README: the planner)."""

from __future__ import annotations

import contextlib
import tracemalloc

import pytest

import planner
from cli.main import main
from planner import cheapest, search
from shardlang import Mesh, parse_layout
from shardlang.mesh import RowMajorRanks

MESH11 = "mesh[3,3,4,3,2,3,1,2,1,3,1]"
MESH20 = "mesh[" + ",".join(["2"] * 20) + "]"
AXES = ",".join(str(a) for a in range(20))


def L(text: str):
    return parse_layout(text)


class Searches:
    """The states each collective search generates (one entry per search), counted by a
    wrapper put over the searches' memo. States, not seconds, are what bound a request's time
    on any machine (planner.search); the seconds are in bench/bench_planner_budget.py."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.memo = search._plan_cached
        self.states: list[int] = []
        monkeypatch.setattr(search, "_plan_cached", self)
        self.cold()

    def __call__(self, *args: object) -> search.Outcome:
        misses = self.memo.cache_info().misses
        found = self.memo(*args)
        if self.memo.cache_info().misses > misses:  # searched, not remembered
            self.states.append(found[1])
        return found

    def cold(self) -> None:
        """Forget every plan (the memos cleared) and every count."""
        self.memo.cache_clear()
        cheapest._cheapest.cache_clear()
        self.states.clear()

    def within(self, max_states: int = planner.DEFAULT_MAX_STATES) -> bool:
        """Whether one request's searches kept to its budget: none generated more than one
        state past ``max_states``, and all together at most one search's worth more than it
        (planner.cheapest: each leg charges what it generated, and the request ends once the
        charges pass the budget)."""
        return all(n <= max_states + 1 for n in self.states) and sum(self.states) <= 2 * max_states + 1


@pytest.fixture
def searches(monkeypatch: pytest.MonkeyPatch) -> Searches:
    return Searches(monkeypatch)


def refused_within_budget(
    searches: Searches, src: str, dst: str, shape: tuple[int, ...], **kwargs: object
) -> planner.PlanBudgetError:
    """The PlanBudgetError of a request planned cold, whose searches kept to its budget."""
    searches.cold()
    with pytest.raises(planner.PlanBudgetError) as info:
        planner.plan(L(src), L(dst), shape, **kwargs)
    assert searches.within(kwargs.get("max_states", planner.DEFAULT_MAX_STATES)), searches.states
    return info.value


def test_the_eleven_axis_case_is_refused_naming_pair_budget_and_a_way_out(searches):
    src = f"S3 | P(8,2,1,7,0,10,9,5,6),P4 over {MESH11}"
    error = refused_within_budget(searches, src, f"S(0,1,2) over {MESH11}", (4096,))
    assert "the collective search would take more" in error.message
    assert str(L(src)) in error.message and f"max_states={planner.DEFAULT_MAX_STATES}" in error.message
    assert "fewer mesh axes" in error.message and "--p2p off" in error.message


def test_twenty_axes_with_partials_are_refused_within_the_budget(searches):
    src = f"S(0,1,2,3,4,5,6,7,8,9) | P(10,11,12,13,14,15,16,17,18,19) over {MESH20}"
    dst = f"S(19,18,17,16,15,14,13,12,11,10) over {MESH20}"
    error = refused_within_budget(searches, src, dst, (1 << 20,))
    assert "the collective search would take more" in error.message
    error = refused_within_budget(searches, src, dst, (1 << 20,), point_to_point=True)
    assert f"the collective leg {L(src)} -> " in error.message


def test_twenty_axis_permutations_end_within_the_budget(searches):
    src = f"S(0,1,2,3,4,5,6,7,8,9),S(10,11,12,13,14,15,16,17,18,19) over {MESH20}"
    dst = f"S(19,18,17,16,15,14,13,12,11,10),S(0,1,2,3,4,5,6,7,8,9) over {MESH20}"
    with contextlib.suppress(planner.PlanBudgetError):
        found = planner.plan(L(src), L(dst), (4096, 4096))
        assert found.steps[-1].layout == L(dst)
    assert len(searches.states) == 1 and searches.within(), searches.states


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ("S0 over mesh[1048576]", "R over mesh[1048576]"),
        ("S0 over mesh[1024,1024]", "S1 over mesh[1024,1024]"),
        ("S0 over mesh[1048576]", "S0 over mesh[1024]"),  # across meshes
    ],
)
def test_million_rank_point_to_point_pairs_are_refused_within_the_budget(searches, src, dst):
    # Refused when pricing the step, before anything is listed per rank.
    error = refused_within_budget(searches, src, dst, (1 << 20,), point_to_point=True)
    assert "pricing the point-to-point step" in error.message
    across = L(src).mesh.size != L(dst).mesh.size
    assert ("--p2p off" in error.message) != across and "--max-states" in error.message
    with pytest.raises(planner.PlanBudgetError, match=r"listing the blocks of both meshes' ranks .* max_states=50000"):
        planner.point_to_point_plan(L(src), L(dst), (1 << 20,))


def test_the_budget_is_exact_where_the_search_completes():
    """A budget decides only whether a plan comes back, never which: the plan found under a
    budget it fits is the plan found under any larger one, and the refusal repeats cold."""
    src, dst = L("S01,R | P2 over mesh[2,4,2]"), L("R,S20 over mesh[2,4,2]")
    _, needed = search.collective_outcome(search.checked(src, dst, (64, 48), "f32", None, None))
    assert needed > 1
    full = planner.plan(src, dst, (64, 48))
    assert planner.plan(src, dst, (64, 48), max_states=needed) == full
    for _ in range(2):
        with pytest.raises(planner.PlanBudgetError, match=f"max_states={needed - 1} "):
            planner.plan(src, dst, (64, 48), max_states=needed - 1)
        search._plan_cached.cache_clear()
    with pytest.raises(planner.PlanError, match="max_states must be a positive count"):
        planner.plan(src, dst, (64, 48), max_states=0)


def test_the_mixed_plans_share_one_budget():
    src, dst = L("S0 | P1 over mesh[4,2]"), L("S1 over mesh[4,2]")
    found = planner.plan(src, dst, (64,), point_to_point=True)
    with pytest.raises(planner.PlanBudgetError):
        planner.plan(src, dst, (64,), point_to_point=True, max_states=20)
    assert planner.plan(src, dst, (64,), point_to_point=True, max_states=10_000) == found


def test_size_one_axes_replicated_in_both_plan_as_without_them():
    wide, narrow = "mesh[3,1,2]", "mesh[3,2]"
    for src, dst, src_n, dst_n in [
        ("S0,S2 | P(1)", "S2,S0", "S0,S1", "S1,S0"),
        ("S02 | P(1)", "R", "S01", "R"),
        ("R | P2", "S20", "R | P1", "S10"),
    ]:
        if "P(1)" in src:  # a partial size-1 axis is kept by the search; plan the same without it
            src = src.replace(" | P(1)", "")
        got = planner.plan(L(f"{src} over {wide}"), L(f"{dst} over {wide}"), (12, 10)[: len(src.split(","))])
        want = planner.plan(L(f"{src_n} over {narrow}"), L(f"{dst_n} over {narrow}"), (12, 10)[: len(src.split(","))])
        assert [s.op for s in got.steps] == [s.op for s in want.steps]
        assert [s.axis for s in got.steps] == [(0, 2)[s.axis] for s in want.steps]
        assert [s.bytes for s in got.steps] == [s.bytes for s in want.steps]
        assert got.total_seconds == want.total_seconds
        assert got.steps[-1].layout == got.dst


def test_thirty_idle_size_one_axes_add_no_step():
    mesh = "mesh[" + ",".join(["1"] * 30) + ",4]"
    got = planner.plan(L(f"S(30) over {mesh}"), L(f"R over {mesh}"), (8,))
    assert [s.describe() for s in got.steps] == ["all_gather(axis=30, dim=0)"]


def test_a_million_rank_mesh_holds_no_per_rank_table():
    parse_layout("S0 over mesh[1048575]")  # warm the parser
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        layouts = [parse_layout(f"S0 over mesh[{1048576 - i}]") for i in range(20)]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 20 * 4096, held  # a list of 1M ints alone is 8 MB
    mesh = layouts[0].mesh
    assert isinstance(mesh.ranks, RowMajorRanks)
    assert mesh.coordinate(1048575) == (1048575,) and mesh.rank_at((7,)) == 7
    assert 1048575 in mesh.ranks and 1048576 not in mesh.ranks and -1 not in mesh.ranks
    assert mesh.ranks[-1] == 1048575 and mesh.ranks[2:4] == (2, 3)


def test_row_major_ranks_compare_and_hash_as_meshes_did():
    lazy = Mesh(shape=(2, 3))
    explicit = Mesh(shape=(2, 3), ranks=tuple(range(6)))
    assert lazy == explicit and hash(lazy) == hash(explicit)
    assert lazy.ranks == tuple(range(6)) and tuple(range(6)) == lazy.ranks and list(lazy.ranks) == list(range(6))
    assert lazy.ranks != (0, 1, 2, 3, 5, 4) and lazy != Mesh(shape=(2, 3), ranks=(0, 1, 2, 3, 5, 4))
    assert Mesh(shape=(2,), ranks=(4, 5)).describe() == "mesh[2] ranks 4..5"
    assert str(parse_layout("S0 over mesh[4] ranks [0,1,2,3]")) == "S0 over mesh[4]"
    assert lazy.ranks.index(4) == 4 and set(lazy.ranks) == set(range(6))


def test_check_refuses_the_eleven_axis_spec_within_the_budget(tmp_path, searches, capsys):
    spec = tmp_path / "big.shard"
    spec.write_text(
        "tensor w : f32[4096] {\n"
        f"  param = S3 over {MESH11}\n"
        f"  grad  = S3 | P(8,2,1,7,0,10,9,5,6),P4 over {MESH11}\n"
        f"  state = S(0,1,2) over {MESH11}\n"
        "}\n"
    )
    assert main(["check", str(spec)]) == 1
    err = capsys.readouterr().err
    assert "search budget of max_states=50000" in err and "Traceback" not in err
    assert searches.states and searches.within(), searches.states


def test_a_step_plan_keeps_the_budget_error_and_takes_the_budget(searches: Searches) -> None:
    from planner.spec_plan import plan_spec
    from shardlang import parse_spec

    spec = parse_spec(
        "mesh world = [dp=512, tp=8]\n"
        "tensor w : bf16[4096, 64] {\n"
        "  param = S(tp),R over world\n"
        "  grad  = S(tp),R | P(dp):avg over world\n"
        "  state = S(tp,dp),R over world\n"
        "}\n",
        "big.shard",
    )
    with pytest.raises(planner.PlanBudgetError) as refused:
        plan_spec(spec, max_states=1)
    assert refused.value.message.startswith("tensor 'w': ") and "max_states=1 " in refused.value.message
    assert refused.value.position is not None and refused.value.position.line == 2
    assert searches.within(1)
    searches.cold()
    planned = plan_spec(spec, max_states=10_000)
    assert searches.within(10_000) and planned.step == plan_spec(spec).step
