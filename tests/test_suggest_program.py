"""The integer program of ``planner.knapsack`` solved to its optimum: against brute force over
every split of each group's tensors among its candidates, priced here from the candidates
alone (each tensor's own seconds, per collective kind its latency times its buckets,
``max(1 if used, ceil(fill / cap))``), never from the program's rows, and the memory the
split holds as ``planner.memory`` predicts it (what ``shardlang suggest`` prints and bounds).
And the node limit: deterministic, its gap stated when it stops a solve."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import attrs
import pytest

from planner import knapsack
from planner.knapsack import _choice, _fastest, _program, _run, _solve
from planner.suggest import SuggestError, build_problems
from shardlang import load_spec, parse_spec
from shardlang.spec import expand_braces

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_scale  # bench/bench_scale.py: its Llama-shaped specs

MIB = 2**20
REPO = Path(__file__).resolve().parent.parent
# Latency-bound (1 ms a round): buckets decide. Three tensors of one group, 8 MiB buckets.
THREE = """
mesh world = [dp=4]  bandwidth 25e9  latency 1ms
tensor {a,b,c} : f32[1048576] { param = R over world  grad = R | P(dp):avg over world  state = S(dp) over world }
"""
# Two groups on two data-parallel axes, a slow one: the counts of two kinds trade off (two and
# one tensors: 3,861 splits, each priced by the memory prediction).
TWO = """
mesh world = [dp=8, fsdp=2]  bandwidth [1e9, 1e11]  latency [500us, 5us]
tensor w.{0..1} : bf16[1024, 2048] {
  param = R,R over world  grad = R,R | P(dp,fsdp):avg over world  state = S(dp,fsdp),R over world
}
tensor n : f32[4096] { param = R over world  grad = R | P(dp,fsdp):avg over world }
"""


def _splits(count: int, cells: int):
    """Every way to give ``count`` tensors to ``cells`` candidates: counts per candidate."""
    for bars in itertools.combinations(range(count + cells - 1), cells - 1):
        edges = (-1, *bars, count + cells - 1)
        yield tuple(edges[i + 1] - edges[i] - 1 for i in range(cells))


def _brute(problem, budget: int) -> tuple[float, list]:
    """The least program time (microseconds, as the program counts it) within ``budget`` bytes
    held, over every split; and every split's (time, memory held)."""
    cap = problem.solver_cap
    every = []
    groups = problem.groups
    for counts in itertools.product(*[list(_splits(len(g.tensors), len(g.candidates))) for g in groups]):
        seconds = 0.0
        fill: dict[int, int] = {}
        latency: dict[int, float] = {}
        for g, split in zip(groups, counts, strict=True):
            for cand, n in zip(g.candidates, split, strict=True):
                if not n:
                    continue
                seconds += n * cand.seconds
                for k, lat, f in cand.kinds:
                    fill[k] = fill.get(k, 0) + n * f
                    latency[k] = lat
        seconds += sum(lat * max(1, math.ceil(fill[k] / cap)) for k, lat in latency.items())
        picks = [[c for c, n in enumerate(split) for _ in range(n)] for split in counts]  # as the program's
        every.append((seconds, problem.prediction(picks).total_bytes))
    fitting = [s for s, m in every if m <= budget]
    return (min(fitting) if fitting else math.inf), every


# At a 2 MiB cap a kind of the three-tensor group needs 3 buckets: its bound once counted the
# tensors of the last group (2), which made the least memory and most budgets infeasible.
@pytest.mark.parametrize(("text", "cap"), [(THREE, 8 * MIB), (TWO, None), (TWO, 2 * MIB)])
def test_the_program_optimum_equals_brute_force(text: str, cap: int | None) -> None:
    problem = build_problems(parse_spec(text), bucket_bytes=cap, loop="any")[0]
    _, every = _brute(problem, 2**62)
    memories = sorted({m for _, m in every})
    assert len(memories) > 4
    program = _program(problem)
    least = memories[0]  # (+ 2,174,976 and + 6,350,848 bytes: once found infeasible at 2 MiB)
    sample = memories[:: max(1, len(memories) // 12)]
    for budget in [least, least + 2_174_976, least + 6_350_848, *sample, memories[-1]]:
        expected = min(s for s, m in every if m <= budget)
        x, optimal, gap = _fastest(program, budget, 10**6)
        assert optimal and gap <= 1e-9  # (HiGHS may state a gap of 1e-16)
        got = float(program.time @ x) / 1e6
        assert math.isclose(got, expected, rel_tol=1e-9), (budget, got, expected)
        assert _choice(problem, program, x).memory <= budget


def test_the_node_limit_stops_a_solve_the_same_way_and_says_its_gap() -> None:
    problem = build_problems(parse_spec(TWO), loop="any")[0]
    budget = sorted({m for _, m in _brute(problem, 2**62)[1]})[-1]
    exact = knapsack.suggest(problem, budget, 10**6)
    assert exact.optimal and exact.gap == 0
    stopped = [knapsack.suggest(problem, budget, 1) for _ in range(2)]
    assert stopped[0].optimal or stopped[0].gap > 0  # stopped short: the gap is stated, the same each time
    assert (stopped[0].best, stopped[0].gap) == (stopped[1].best, stopped[1].gap)
    assert stopped[0].best.seconds >= exact.best.seconds * (1 - 1e-9)


def test_a_solve_that_finds_nothing_falls_back_and_says_so() -> None:
    # A node limit of 0 stops HiGHS before any solution (the command asks for at least 1): the
    # answer is then the least-memory choice or a fixed strategy, and the text and JSON say so.
    from cli.suggest import format_suggestion, suggestion_json

    problems = build_problems(parse_spec(TWO), bucket_bytes=2 * MIB, loop="any")
    problem = problems[0]
    _, every = _brute(problem, 2**62)
    budget = min(m for _, m in every) + 2_174_976
    fastest = min(s for s, m in every if m <= budget)
    result = knapsack.suggest_best(problems, budget, 0)
    assert not result.solved and not result.optimal
    assert result.best.memory <= budget
    assert result.best.seconds > fastest * (1 + 1e-6)  # slower than brute force finds: not to pass silently
    assert result.fallback and all("HiGHS stopped before it found a solution" in n for n in result.fallback)
    text = format_suggestion(result, problems)
    assert "no solution taken from the solver" in text
    assert f"fallback: {result.fallback[0]}" in text
    data = suggestion_json(result, problems)
    assert data["solved"] is False and data["fallback"] == list(result.fallback)
    solved = knapsack.suggest_best(problems, budget)
    assert solved.solved and not solved.fallback
    assert "fallback" not in format_suggestion(solved, problems)
    assert suggestion_json(solved, problems)["fallback"] == []


def test_a_tie_break_never_times_slower_than_the_fastest_solution() -> None:
    # Where the cap cuts a kind the program counts its buckets as a lower bound, so choices of
    # one program time can differ in the step plan's (planner.suggest's module doc). On 7B
    # [dp=4, fsdp=4, cp=2, tp=8] the least-memory tie of the fastest solution found takes
    # 0.06 ms more in the step plan (0.137812 s against 0.137752 s): the tie gives way.
    text, _ = bench_scale.model_spec("7b", bench_scale.mesh_axes(256, 4))
    problem = build_problems(parse_spec(text), loop="auto")[0]
    program, budget = _program(problem), 24 * 2**30
    fastest = _choice(problem, program, _fastest(program, budget, knapsack.NODE_LIMIT)[0])
    tied, _, _, _ = _solve(problem, budget, knapsack.NODE_LIMIT, True)
    assert tied.seconds <= fastest.seconds * (1 + 1e-6), (tied.seconds, fastest.seconds)


def test_a_tie_break_starts_from_the_solution_it_breaks_a_tie_of() -> None:
    # Given no node to search, a tie-break solve keeps the solution it starts from (or one no
    # worse within the tie's time): started from nothing it finds none.
    problem = build_problems(parse_spec(TWO), bucket_bytes=2 * MIB, loop="any")[0]
    program = _program(problem)
    x, _, _ = _fastest(program, None, knapsack.NODE_LIMIT)
    tie = [(program.time, float(program.time @ x) * (1 + 1e-6) + 1e-6)]
    with pytest.raises(SuggestError, match="HiGHS stopped before it found a solution"):
        _run(program, program.memory, tie, 0)
    kept, _, _ = _run(program, program.memory, tie, 0, start=x)
    assert program.time @ kept <= tie[0][1] and program.memory @ kept <= program.memory @ x
    assert _choice(problem, program, kept).memory <= _choice(problem, program, x).memory


def _llama_example() -> list:
    """The problems of bench/bench_suggest.py: the Llama example with its RMSNorm weights."""
    spec = load_spec(REPO / "examples" / "llama7b_dp4_tp8.shard")
    norms = [("model.layers.{0..31}.{input,post_attention}_layernorm.weight", 4096), ("model.norm.weight", 4096)]
    tensors = [
        *spec.tensors,
        *(spec.resolve(n, (length,), "bf16") for names, length in norms for n in expand_braces(names)),
    ]
    return build_problems(spec, tensors=tensors)


def test_a_small_program_the_node_limit_stops_is_solved_again_with_highs_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On the Llama example (74 variables) at 6 GiB, pseudocosts alone stop at the node limit
    # 0.09% from the bound; HiGHS's defaults, from that solution, prove it in about 0.1 s.
    budget = 6 * 2**30
    assert knapsack.suggest_best(_llama_example(), budget).optimal
    monkeypatch.setattr(knapsack, "THOROUGH_SIZE", 0)
    assert not knapsack.suggest_best(_llama_example(), budget).optimal


def test_no_first_solve_searches_highs_sub_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    # RENS, RINS and root reduced-cost fixing took about half the first solve's time at scale
    # for no better answers (docs/reference/suggest.md): every solve goes without, but the
    # second of a small program the node limit stopped.
    import highspy

    solves: list[dict] = []

    class Recording(highspy.Highs):
        def __init__(self) -> None:
            super().__init__()
            solves.append({})

        def setOptionValue(self, name, value):
            solves[-1][name] = value
            return super().setOptionValue(name, value)

    monkeypatch.setattr(highspy, "Highs", Recording)
    monkeypatch.setattr(knapsack, "THOROUGH_SIZE", 0)
    problem = build_problems(parse_spec(TWO), bucket_bytes=2 * MIB, loop="any")[0]
    _solve(problem, None, knapsack.NODE_LIMIT, True)
    assert solves
    names = ("mip_heuristic_run_rens", "mip_heuristic_run_rins", "mip_heuristic_run_root_reduced_cost")
    assert all(s.get(name) is False for s in solves for name in names), solves


def test_an_answer_is_proven_only_where_every_problem_solved_was() -> None:
    # 70B on [dp=8, fsdp=4, tp=8]: the flat problem over dp wins, solved to its optimum, but
    # the plain problem's solve stopped at the node limit, and a faster choice may lie there.
    text, _ = bench_scale.model_spec("70b", bench_scale.mesh_axes(256, 3))
    problems = build_problems(parse_spec(text), loop="auto")
    budget = 80 * 2**30
    result = knapsack.suggest_best(problems, budget)
    plain = knapsack.suggest(problems[0], budget, ties=False)
    assert result.problem is not problems[0] and not plain.optimal and plain.gap > 0
    assert not result.optimal and result.gap >= plain.gap


def test_a_tie_the_step_plan_times_slower_gives_way_and_ends_the_tie_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every choice but the fastest solution's is timed a second slower by the step plan: the
    # least-memory tie gives way to the fastest, and no tie of it is broken by fewer changes.
    problem = build_problems(parse_spec(TWO), bucket_bytes=2 * MIB, loop="any")[0]
    program = _program(problem)
    first = _fastest(program, None, knapsack.NODE_LIMIT)[0]
    assert program.memory @ first > 0  # there is a tie-break to run
    fastest = _choice(problem, program, first)
    slower = attrs.evolve(fastest, picks=(), memory=0, seconds=fastest.seconds + 1)
    monkeypatch.setattr(knapsack, "_choice", lambda p, g, x: fastest if x is first else slower)
    solved: list[str] = []

    def run(program, objective, *args, **kwargs):
        solved.append("changes" if objective is program.changes else "memory")
        return _run(program, objective, *args, **kwargs)

    monkeypatch.setattr(knapsack, "_run", run)
    chosen, _, _, _ = _solve(problem, None, knapsack.NODE_LIMIT, True)
    assert chosen is fastest and solved == ["memory"]
