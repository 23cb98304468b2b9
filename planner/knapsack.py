"""The integer program of ``planner.suggest``, solved by HiGHS (``highspy``).

Variables, per group ``g`` and candidate ``c``: ``n[g,c]`` (how many of the group's tensors
take ``c``, an integer), ``u[g,c]`` (binary: any does); per collective kind ``k``: ``b[k]``
(an integer: its buckets); and those of the memory the rank holds (``planner.held``: its
largest buffers). Constraints: ``sum_c n[g,c] = |g|``; ``n[g,c] <= |g| u[g,c]``; per group
and kind, ``sum n[g,c] <= |g| b[k]`` over the group's candidates of that kind (a kind any
tensor uses has a bucket: one row per group, not per candidate, and a tighter relaxation than
``u[g,c] <= b[k]``, since the shares of a group add up); ``cap b[k] >= sum fill[g,c,k]
n[g,c]`` (``fill``: the buffer a tensor's step puts in the kind's buckets, at most the cap);
``planner.held``'s rows; and the held memory, its sums over tensors, its largest buffers and
its fixed part, at most the budget. Objective: ``sum seconds[g,c] n[g,c] + sum latency[k]
b[k]``; among choices of that time (within a relative 1e-6), the least memory, then the
fewest tensors changed from the spec's layouts (two more solves, each bounded by the last
optimum). Every solution's memory is the prediction's (``planner.memory``, what ``shardlang
suggest`` prints), checked against the budget in whole bytes (the program works in floats,
and bounds a kind of several buckets by the cap), and the program is solved again with the
budget lowered by any excess. The
HiGHS stops each solve after :data:`NODE_LIMIT` branch-and-bound nodes (``node_limit``), not
after wall seconds: the answer is the same on a loaded machine as on an idle one, and a solve
the limit stops reports its optimality gap (docs/reference/suggest.md). A solve that yields
nothing usable falls back to the least-memory choice and says why (``Suggestion.solved``,
``Suggestion.fallback``), never silently.
The solution's exact time (the step plan's buckets, ``Problem.evaluate``) is compared with the
spec's own layouts' and every fixed strategy's that fits, and the best by the same order kept:
where the cap cuts a kind into more buckets than the program counts, it stays no worse than
any of those.

numpy and highspy are imported when a program is solved, not with this module, which the
``shardlang`` command imports for every command (README, "The `shardlang` command").
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from typing import Any

import attrs

from planner.held import program_rows
from planner.memory import host_bytes
from planner.suggest import Candidate, Choice, Group, Problem, SuggestError, Suggestion

_MIB = float(2**20)
_US = 1e6


# Branch-and-bound nodes per solve: at 131,072 ranks on a 5-D mesh the plain problem's last
# few microseconds of bucket rounding take HiGHS 10^5 nodes to prove (docs/reference/suggest.md).
NODE_LIMIT = 200
# A solve the node limit stops on a program of at most this many variables runs again with
# HiGHS's defaults (strong branching, sub-programs), from its best solution: on such programs
# they prove in about 0.1 s what pseudocosts alone leave open (docs/reference/suggest.md).
THOROUGH_SIZE = 128
_TIE = 1e-6  # relative: times this close are a tie (the solver's own tolerance), broken by memory, then changes


@attrs.frozen(eq=False)  # by identity: a key of the solves kept (_fastest)
class _Program:
    """The program's parts (module doc) over its ``cells`` (group, candidate)."""

    cells: tuple[tuple[int, int], ...]
    size: int
    fixed: int  # bytes held whatever the choice, left out of ``memory`` (planner.held.fixed_bytes)
    rows: tuple[Any, Any, Any]  # (row, column, value) of each entry: numpy arrays
    lo: Any
    hi: Any
    lower: Any  # the variables' bounds
    upper: Any
    integrality: Any
    time: Any  # objective vectors over the variables
    memory: Any
    changes: Any


def _dominates(a: Candidate, b: Candidate, fills_a: dict[int, int], fills_b: dict[int, int]) -> bool:
    """Whether ``a`` is nowhere worse than ``b``: every term of its memory, own time, and a
    subset of its kinds each filled no more (so the kinds' latencies are no more either);
    ``fills_*``: each candidate's fill per kind."""
    if a.seconds > b.seconds or not a.held.no_worse_than(b.held):
        return False
    return all(k in fills_b and f <= fills_b[k] for k, f in fills_a.items())


def _undominated(group: Group) -> list[int]:
    """The candidates the program needs: a candidate another dominates (the first of equal
    ones stays) is never needed for the least time or memory, and the spec's own layouts stay
    for the fewest changes."""
    import numpy as np

    candidates = group.candidates
    fills = [{k: f for k, _, f in c.kinds} for c in candidates]
    # The scalar terms first, all pairs at once: ``may[j, i]``, whether j can dominate i.
    terms = np.array([(c.seconds, c.held.linear, c.held.roots[1], c.held.unshared) for c in candidates], dtype=float)
    may = (terms[:, None, :] <= terms[None, :, :]).all(axis=2)
    np.fill_diagonal(may, False)
    out = []
    for i, c in enumerate(candidates):
        beaten = any(
            _dominates(candidates[j], c, fills[j], fills[i])
            and (j < i or not _dominates(c, candidates[j], fills[i], fills[j]))
            for j in np.flatnonzero(may[:, i]).tolist()
        )
        if not beaten or i == group.original:
            out.append(i)
    return out


# A problem's program is built once for its several solves (least memory, least time, the
# tie-breaks); a few problems are kept, those of one suggest_best.
@functools.lru_cache(maxsize=8)
def _program(problem: Problem) -> _Program:
    import numpy as np

    latency: dict[int, float] = {}
    for g in problem.groups:
        for c in g.candidates:
            latency.update((k, lat) for k, lat, _ in c.kinds)
    kind_index = {k: i for i, k in enumerate(latency)}
    cells = tuple((gi, ci) for gi, g in enumerate(problem.groups) for ci in _undominated(g))
    n_cells, n_kinds = len(cells), len(latency)
    data: list[float] = []
    row_of: list[int] = []
    col_of: list[int] = []
    lo: list[float] = []
    hi: list[float] = []
    # Variables: n..., u..., b..., then the held memory's (planner.held.program_rows).
    upper = [float(len(problem.groups[gi].tensors)) for gi, _ in cells] + [1.0] * n_cells + [0.0] * n_kinds
    lower = [0.0] * (2 * n_cells + n_kinds)
    integer = [1] * (2 * n_cells + n_kinds)

    def row(entries: dict[int, float], low: float, high: float) -> None:
        for i, v in entries.items():
            row_of.append(len(lo))
            col_of.append(i)
            data.append(v)
        lo.append(low)
        hi.append(high)

    def var(most: float, whole: bool, low: float = 0.0) -> int:
        upper.append(most)
        lower.append(low)
        integer.append(int(whole))
        return len(upper) - 1

    cap = problem.solver_cap / _MIB
    fills: list[dict[int, float]] = [{} for _ in range(n_kinds)]
    for gi, g in enumerate(problem.groups):
        count = len(g.tensors)
        row({i: 1.0 for i, (gj, _) in enumerate(cells) if gj == gi}, count, count)
    uses: dict[tuple[int, int], list[int]] = {}  # (group, kind) -> the cells of that group using the kind
    for i, (gi, ci) in enumerate(cells):
        g = problem.groups[gi]
        cand = g.candidates[ci]
        row({i: 1.0, n_cells + i: -float(len(g.tensors))}, -np.inf, 0.0)
        for k, _, fill in cand.kinds:
            uses.setdefault((gi, kind_index[k]), []).append(i)
            fills[kind_index[k]][i] = fills[kind_index[k]].get(i, 0.0) + fill / _MIB
    for (gi, k), users in uses.items():  # a kind that a tensor of the group uses has a bucket
        row({**dict.fromkeys(users, 1.0), 2 * n_cells + k: -float(len(problem.groups[gi].tensors))}, -np.inf, 0.0)
    for k, fill in enumerate(fills):
        full = sum(v * len(problem.groups[cells[i][0]].tensors) for i, v in fill.items())  # every tensor in
        upper[2 * n_cells + k] = most = max(1, math.ceil(full / cap - _TIE))  # at most this many buckets
        if most > 1:  # else b[k] is the binary "some candidate uses it"
            row({**{i: -v for i, v in fill.items()}, 2 * n_cells + k: cap}, 0.0, np.inf)
    held = [(gi, len(problem.groups[gi].tensors), problem.groups[gi].candidates[ci].held) for gi, ci in cells]
    buckets = {k: (2 * n_cells + i, int(upper[2 * n_cells + i])) for k, i in kind_index.items()}
    memory = program_rows(held, buckets, problem.solver_cap, _MIB, row, var)
    size = len(upper)
    time_vector, memory_vector, changes = np.zeros(size), np.zeros(size), np.zeros(size)
    for i, (gi, ci) in enumerate(cells):
        g = problem.groups[gi]
        time_vector[i] = g.candidates[ci].seconds * _US
        changes[i] = float(g.candidates[ci].layouts != g.candidates[g.original].layouts)
    for k, value in latency.items():
        time_vector[2 * n_cells + kind_index[k]] = value * _US
    for column, value in memory.items():
        memory_vector[column] = value
    return _Program(
        cells=cells,
        size=size,
        fixed=host_bytes(problem.optimizer, len(problem.tensors)),
        rows=(np.array(row_of, dtype=int), np.array(col_of, dtype=int), np.array(data, dtype=float)),
        lo=np.array(lo),
        hi=np.array(hi),
        lower=np.array(lower),
        upper=np.array(upper),
        integrality=np.array(integer),
        time=time_vector,
        memory=memory_vector,
        changes=changes,
    )


def _run(
    program: _Program,
    objective: Any,
    limits: Sequence[tuple[Any, float]],
    node_limit: int,
    *,
    relaxed: bool = False,
    start: Any = None,
    thorough: bool = False,
) -> tuple[Any, bool, float]:
    """Minimize ``objective`` within the program and ``limits`` (vector, most): the solution
    (the best found when the node limit stops the solver), whether it is proven optimal, and
    the gap; a :class:`SuggestError` when there is none. ``relaxed``: every variable real
    (the linear relaxation, whose optimum bounds the program's from below); ``start``: a
    solution within the limits, HiGHS's first incumbent. HiGHS branches on pseudocosts and
    searches no sub-programs that fix the variables its relaxation or best solution round
    alike, or that its root's reduced costs fix (RENS, RINS, root reduced cost), unless
    ``thorough``: a solve the node limit stops on a program of at most
    :data:`THOROUGH_SIZE` variables is run again so, from its best solution, and the better
    answer kept (docs/reference/suggest.md)."""
    import highspy
    import numpy as np

    row_of, col_of, data = program.rows
    lo, hi = program.lo, program.hi
    if limits:  # rows of their own after the program's, of the vectors' nonzero entries
        entries = [(np.flatnonzero(v), v) for v, _ in limits]
        row_of = np.concatenate([row_of, *(np.full(len(i), len(lo) + r) for r, (i, _) in enumerate(entries))])
        col_of = np.concatenate([col_of, *(i for i, _ in entries)])
        data = np.concatenate([data, *(v[i] for i, v in entries)])
        lo = np.concatenate([lo, np.full(len(limits), -np.inf)])
        hi = np.concatenate([hi, np.array([m for _, m in limits])])
    order = np.lexsort((row_of, col_of))  # by column, then row: HiGHS's column-wise matrix
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = program.size, len(lo)
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = objective, program.lower, program.upper
    lp.row_lower_, lp.row_upper_ = lo, hi
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.concatenate([[0], np.cumsum(np.bincount(col_of, minlength=program.size))])
    lp.a_matrix_.index_ = row_of[order]
    lp.a_matrix_.value_ = data[order]
    if not relaxed:
        whole, real = highspy.HighsVarType.kInteger, highspy.HighsVarType.kContinuous
        lp.integrality_ = [whole if v else real for v in program.integrality]
    solver = highspy.Highs()
    options: dict[str, Any] = {"output_flag": False, "presolve": "on", "mip_rel_gap": 0.0, "mip_max_nodes": node_limit}
    if not thorough:
        # Branching on pseudocosts from the first node, no strong branching, and no
        # sub-programs: the node limit counts neither's solves (docs/reference/suggest.md).
        options |= {
            "mip_pscost_minreliable": 0,
            "mip_heuristic_run_rens": False,
            "mip_heuristic_run_rins": False,
            "mip_heuristic_run_root_reduced_cost": False,
        }
    for name, value in options.items():
        solver.setOptionValue(name, value)
    solver.passModel(lp)
    if start is not None:
        solution = highspy.HighsSolution()
        solution.col_value = start
        solver.setSolution(solution)
    solver.run()
    status, info, kinds = solver.getModelStatus(), solver.getInfo(), highspy.HighsModelStatus
    optimal = status == kinds.kOptimal
    # A limit that stops a search keeps the best solution found, where it found one.
    stopped = not relaxed and status in (kinds.kSolutionLimit, kinds.kIterationLimit, kinds.kTimeLimit)
    found = optimal or (stopped and info.objective_function_value < highspy.kHighsInf)
    x = np.array(solver.getSolution().col_value) if found else None
    if stopped and not thorough and program.size <= THOROUGH_SIZE:
        try:
            again = _run(program, objective, limits, node_limit, start=start if x is None else x, thorough=True)
        except SuggestError:
            again = None
        if again is not None and (x is None or again[1] or objective @ again[0] <= objective @ x):
            return again
    if x is None:
        infeasible = status == kinds.kInfeasible
        why = "HiGHS found the program infeasible" if infeasible else "HiGHS stopped before it found a solution"
        raise SuggestError(f"{why} ({solver.modelStatusToString(status)})")
    return x, optimal, 0.0 if relaxed else float(info.mip_gap)


def _within(program: _Program, budget: int) -> tuple[Any, float]:
    """The memory's limit of ``budget`` bytes: the program's sums and largest buffers within
    what the fixed part leaves (``planner.held``)."""
    return program.memory, (budget - program.fixed) / _MIB


def _choice(problem: Problem, program: _Program, x: Any) -> Choice:
    """The choice of solution ``x``, timed."""
    import numpy as np

    counts = np.rint(x[: len(program.cells)]).astype(int)
    picks: list[list[int]] = [[] for _ in problem.groups]
    for (gi, ci), n in zip(program.cells, counts, strict=True):
        picks[gi] += [ci] * int(n)
    return _evaluated(problem, tuple(map(tuple, picks)))


# A solve often ends where an earlier one did (a tie-break that keeps the time solve's choice,
# suggest_best's second pass): its exact time and memory (a step plan and a memory prediction,
# the larger part of a solve at scale) are taken once.
@functools.lru_cache(maxsize=32)
def _evaluated(problem: Problem, picks: tuple[tuple[int, ...], ...]) -> Choice:
    return problem.evaluate(picks)


def _solve(
    problem: Problem, budget: int | None, node_limit: int, ties: bool
) -> tuple[Choice, float, bool, tuple[str, ...]]:
    """The fastest choice (modeled by the program) within ``budget``; with ``ties``, among those
    of its time the least memory, then the fewest changes. Each tie-break is a solve of its own
    bounded by the last optimum, within the same node limit: stopped early it keeps the best it
    found, which is never slower, and says so (the last item: notes). The program's time of a
    tie is the fastest's, its step plan's need not be (the program counts a kind's buckets as a
    lower bound where the cap cuts it, module doc): a tie the step plan times slower than the
    fastest choice gives way to the last choice kept, and ends the tie-breaks (the next would
    break a tie among the slower's). Each tie-break starts from the solution it breaks a tie
    of (docs/reference/suggest.md)."""
    program = _program(problem)
    limits = [] if budget is None else [_within(program, budget)]
    x, optimal, gap = _fastest(program, budget, node_limit)
    fastest = chosen = _choice(problem, program, x)
    notes: tuple[str, ...] = ()
    if ties:
        limits.append((program.time, float(program.time @ x) * (1 + _TIE) + _TIE))
        for objective, what in ((program.memory, "less memory"), (program.changes, "fewer changes")):
            if objective @ x > 0:  # else at its least (every tensor in its own layouts)
                try:
                    x = _run(program, objective, limits, node_limit, start=x)[0]
                except SuggestError as e:  # none found in time: keep the last
                    notes = (f"ties not broken by {what}: {e.message}",)
                    break
                tie = _choice(problem, program, x)
                if better(fastest, tie, problem):
                    break
                chosen = tie
            limits.append((objective, float(objective @ x) + 0.5 / _MIB))  # memory: half a byte (in MiB)
    return chosen, gap, optimal, notes


# suggest_best solves each problem for time, then again with its tie-breaks where it is as fast
# as the fastest: the second time solve is the first's.
@functools.lru_cache(maxsize=32)
def _fastest(program: _Program, budget: int | None, node_limit: int) -> tuple[Any, bool, float]:
    """:func:`_run` for the least time within ``budget`` bytes."""
    limits = [] if budget is None else [_within(program, budget)]
    return _run(program, program.time, limits, node_limit)


def _time_bound(problem: Problem, budget: int) -> float:
    """Seconds no choice of ``problem`` within ``budget`` beats: the linear relaxation's least
    time (the program's time is at most a choice's exact one, module doc); inf where none fits."""
    program = _program(problem)
    try:
        x, optimal, _ = _run(program, program.time, [_within(program, budget)], NODE_LIMIT, relaxed=True)
    except SuggestError:
        return math.inf
    return float(program.time @ x) / _US if optimal else 0.0


def smallest_memory(
    problem: Problem,
    node_limit: int = NODE_LIMIT,
    fixed: Sequence[tuple[str | None, Choice | None]] | None = None,
) -> Choice:
    """The choice of least memory per rank the program finds (the least of its count, which is
    the prediction's where its bounds are exact: ``planner.held``), or the fixed choice of
    least memory where that holds less (or where the solve finds nothing in ``node_limit``);
    ``fixed``: :func:`fixed_choices`' answer, when the caller has it."""
    program = _program(problem)
    candidates = [other for _, other in (fixed_choices(problem) if fixed is None else fixed) if other is not None]
    try:
        x, _, _ = _run(program, program.memory, [], node_limit)
        candidates.insert(0, _choice(problem, program, x))
    except SuggestError:
        pass  # the fixed choices (the spec's own layouts among them) stand
    return min(candidates, key=lambda c: c.memory)


def better(a: Choice, b: Choice, problem: Problem | None) -> bool:
    """Whether ``a`` comes before ``b``: less time (beyond a relative tie), then less memory,
    then (choices of one ``problem``; ``None`` for two problems) fewer tensors changed."""
    if not math.isclose(a.seconds, b.seconds, rel_tol=_TIE):
        return a.seconds < b.seconds
    if a.memory != b.memory or problem is None:
        return a.memory < b.memory
    return problem.changed(a) < problem.changed(b)


def fixed_choices(problem: Problem) -> tuple[tuple[str | None, Choice | None], ...]:
    """``(None, the spec's own layouts)``, then per fixed strategy its name and choice (``None``
    where some tensor lacks it)."""
    return ((None, problem.original()), *((name, problem.strategy(name)) for name in problem.strategy_names()))


def suggest(
    problem: Problem,
    budget: int,
    node_limit: int = NODE_LIMIT,
    *,
    least: Choice | None = None,
    ties: bool = True,
    fixed: Sequence[tuple[str | None, Choice | None]] | None = None,
) -> Suggestion:
    """The fastest choice (modeled) within ``budget`` bytes per rank (``ties``: among those of
    its time the least memory, then the fewest changes); a :class:`SuggestError` naming the
    smallest budget that fits when none does. The result is never behind, in that order, the
    spec's own layouts or a fixed strategy that fits (each evaluated exactly). ``least`` and
    ``fixed``: :func:`smallest_memory`'s and :func:`fixed_choices`' answers, when the caller
    has them; the least memory is found only where no fixed choice fits or a solve falls
    back to it."""
    started = time.perf_counter()
    fixed = fixed_choices(problem) if fixed is None else tuple(fixed)

    def smallest() -> Choice:  # a solve of its own: taken only where needed
        nonlocal least
        if least is None:
            least = smallest_memory(problem, node_limit, fixed)
        return least

    # A fixed choice that fits says the least memory fits (it is at most any fixed one's).
    if not _fits(fixed, budget) and smallest().memory > budget:
        raise _too_small(budget, smallest().memory, problem.loop)
    limit = budget
    gap, optimal, notes, solved = 0.0, False, (), True
    instead = "the least-memory choice taken, or a fixed strategy that fits and is faster"
    for _ in range(8):
        try:
            best, gap, optimal, notes = _solve(problem, limit, node_limit, ties)
        except SuggestError as e:  # never silently (docs/reference/suggest.md)
            best, gap, optimal, notes, solved = smallest(), 0.0, False, (f"{e.message}; {instead}",), False
        if best.memory <= budget:
            break
        # The program's floats, or its bounds of several buckets by the cap (planner.held),
        # let the prediction exceed: tighten.
        limit -= best.memory - budget
    else:
        best, gap, optimal, solved = smallest(), 0.0, False, False
        notes = (f"every solution HiGHS found held more than {budget} bytes; {instead}",)
    for _, other in fixed:
        if other is not None and other.memory <= budget and better(other, best, problem):
            best = other
    took = time.perf_counter() - started
    return Suggestion(problem, budget, best, optimal, gap, took, ((problem, fixed),), solved, notes)


def _fits(fixed: Sequence[tuple[str | None, Choice | None]], budget: int) -> bool:
    """Whether some fixed choice (:func:`fixed_choices`) fits ``budget`` bytes."""
    return any(c is not None and c.memory <= budget for _, c in fixed)


def _too_small(budget: int, least: int, loop: str) -> SuggestError:
    """No choice of the loop's layouts (``planner.loops``) fits ``budget``; ``least`` does: the
    least memory held found, the optimizer's Python objects included."""
    within = "" if loop == "any" else f" that the {loop} loop runs"
    other = "" if loop == "any" else " (another loop may hold less: --loop)"
    return SuggestError(
        f"no choice of layouts{within} fits {budget} bytes per rank as the runtime holds it; the smallest "
        f"budget that fits is {least} bytes ({least / 2**30:.3f} GiB){other}"
    )


def suggest_best(problems: Sequence[Problem], budget: int, node_limit: int = NODE_LIMIT) -> Suggestion:
    """The best of :func:`suggest` over ``problems`` (the plain one and the flat ones of
    ``planner.suggest.build_problems``) by time, then memory; on a tie the first (the plain
    one: flat sharding changes how every tensor's state is kept); when none fits, the error
    names the smallest budget that fits any of them."""
    started = time.perf_counter()
    fixed = [fixed_choices(p) for p in problems]
    # The least memory, where no fixed choice fits (else it fits too: suggest finds it if needed).
    least = [
        None if _fits(f, budget) else smallest_memory(p, node_limit, f) for p, f in zip(problems, fixed, strict=True)
    ]
    fitting: list[Suggestion] = []
    for p, m, f in zip(problems, least, fixed, strict=True):
        if m is not None and m.memory > budget:
            continue
        # A problem whose least time cannot come within a tie of the fastest found is not
        # solved: its relaxation bounds every choice of it from below, its fixed ones too.
        if fitting and _time_bound(p, budget) > min(r.best.seconds for r in fitting) * (1 + _TIE):
            continue
        fitting.append(suggest(p, budget, node_limit, least=m, ties=False, fixed=f))
    if not fitting:  # then no fixed choice fits: every problem's least memory was found
        raise _too_small(budget, min(m.memory for m in least if m is not None), problems[0].loop)
    fastest = min(r.best.seconds for r in fitting)
    first = list(fitting)
    # Ties are broken within the problems as fast as the fastest: the others cannot win.
    fitting = [
        suggest(r.problem, budget, node_limit, least=least[i], fixed=fixed[i])
        if math.isclose(r.best.seconds, fastest, rel_tol=_TIE)
        else r
        for r in fitting
        for i in [problems.index(r.problem)]
    ]
    best = fitting[0]
    for other in fitting[1:]:
        if better(other.best, best.best, None):
            best = other
    # Proven only where every problem solved was: one stopped short may hold a faster choice
    # (docs/reference/suggest.md). The gap stated is then the largest solve's.
    if not all(r.optimal for r in [*first, *fitting]):
        best = attrs.evolve(best, optimal=False, gap=max(r.gap for r in [*first, *fitting]))
    every = tuple(zip(problems, fixed, strict=True))
    # A problem whose solve fell back may have lost for it: every problem's notes are said.
    notes = [
        n if len(problems) == 1 else f"{problem_kind(r.problem)}: {n}" for r in [*first, *fitting] for n in r.fallback
    ]
    return attrs.evolve(
        best, solve_seconds=time.perf_counter() - started, fixed=every, fallback=tuple(dict.fromkeys(notes))
    )


def problem_kind(problem: Problem) -> str:
    """``plain``, or ``flat over <axis>``: which of ``build_problems``' problems it is."""
    return "plain" if problem.flat_axis is None else f"flat over {problem.flat_axis}"
