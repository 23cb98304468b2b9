"""``suggest_best`` leaves unsolved a problem whose linear relaxation cannot come within a tie
of the fastest choice found: the relaxation bounds every choice of it from below, so the
answer is the one of solving every problem. And it solves for a problem's least memory only
where no fixed choice fits (one that fits bounds it)."""

from __future__ import annotations

import pytest

from planner import knapsack
from planner.knapsack import _time_bound, better, suggest, suggest_best
from planner.suggest import SuggestError, build_problems
from shardlang import parse_spec

GIB = 2**30
# Two data-parallel axes, dp slow per byte and per round: flat sharding over fsdp (its states
# whole over dp) is slower than the plain ZeRO-2 step however its tensors are laid out.
SPEC = """
mesh world = [dp=2, fsdp=4, tp=2]  bandwidth [1e9, 1e11, 3e11]  latency [200us, 2us, 3us]
tensor w.{0..3} : bf16[4096, 4096] {
  param = S(tp),R over world  grad = S(tp),R | P(dp,fsdp):avg over world  state = S(tp,dp,fsdp),R over world
}
tensor n.{0..3} : bf16[4096] {
  param = R over world  grad = R | P(dp,fsdp):avg over world  state = S(dp,fsdp) over world
}
"""


@pytest.mark.parametrize("budget", [GIB // 4, 4 * GIB])
def test_the_bound_holds_and_the_answer_is_that_of_every_problem_solved(
    budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    problems = build_problems(parse_spec(SPEC))
    assert [p.flat_axis for p in problems] == [None, "dp", "fsdp"]
    every = []
    for p in problems:
        try:
            every.append(suggest(p, budget))
        except SuggestError:  # none of its choices fits: suggest_best leaves it out too
            continue
    for result in every:
        bound = _time_bound(result.problem, budget)
        assert 0 < bound <= result.best.seconds * (1 + 1e-9)
        for _, choice in result.fixed[0][1]:
            if choice is not None and choice.memory <= budget:
                assert bound <= choice.seconds * (1 + 1e-9)
    best = every[0]
    for other in every[1:]:
        if better(other.best, best.best, None):
            best = other
    # the flat-over-fsdp problem cannot tie the plain one's best: it is left unsolved
    assert _time_bound(problems[2], budget) > every[0].best.seconds * 1.01
    solved = []
    monkeypatch.setattr(knapsack, "suggest", lambda p, *a, **k: solved.append(p.flat_axis) or suggest(p, *a, **k))
    got = suggest_best(problems, budget).best
    assert "fsdp" not in solved and None in solved
    assert (got.seconds, got.memory) == pytest.approx((best.best.seconds, best.best.memory), rel=1e-9)


def test_the_least_memory_is_solved_for_only_where_no_fixed_choice_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fixed choice that fits bounds the least memory: the least-memory solve is left out, and
    the answer is the one given the least memory found beforehand."""
    flat = build_problems(parse_spec(SPEC))[1]  # over dp: its least memory mixes the layouts
    fixed = knapsack.fixed_choices(flat)
    least = knapsack.smallest_memory(flat, fixed=fixed)
    smallest = min(c.memory for _, c in fixed if c is not None)
    assert least.memory < smallest  # a budget between them fits the least only
    real = knapsack.smallest_memory
    calls: list[int] = []
    monkeypatch.setattr(knapsack, "smallest_memory", lambda p, *a, **k: calls.append(1) or real(p, *a, **k))
    for budget, solved in ((smallest, False), ((least.memory + smallest) // 2, True), (least.memory - 1, True)):
        calls.clear()
        try:
            got = suggest(flat, budget, fixed=fixed).best
        except SuggestError as e:  # below the least: the error names it, as with the least given
            assert budget < least.memory and f"is {least.memory} bytes" in e.message
            assert calls == [1]
            continue
        assert bool(calls) == solved
        given = suggest(flat, budget, least=least, fixed=fixed).best
        assert (got.picks, got.seconds, got.memory) == (given.picks, given.seconds, given.memory)
