"""The integer program of ``planner.suggest``, solved by HiGHS (``scipy.optimize.milp``).

Variables, per group ``g`` and candidate ``c``: ``n[g,c]`` (how many of the group's tensors
take ``c``, an integer), ``u[g,c]`` (binary: any does); per collective kind ``k``: ``y[k]``
(binary: some chosen candidate runs it); ``z``, the largest transient buffer. Constraints:
``sum_c n[g,c] = |g|``; ``n[g,c] <= |g| u[g,c]``; ``u[g,c] <= y[k]`` for every kind of
``c``; ``z >= buffer[g,c] u[g,c]``; ``sum memory[g,c] n[g,c] + z <= budget``. Objective:
``sum seconds[g,c] n[g,c] + sum latency[k] y[k]``. Every solution is checked against the
budget in whole bytes (the solver works in floats), and the program is solved again with the
budget lowered by any excess.

numpy and scipy are imported when a program is solved, not with this module, which the
``shardlang`` command imports for every command: scipy takes about half a second to import
(README, "The `shardlang` command").
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs

from planner.suggest import Choice, Problem, SuggestError, Suggestion

_MIB = float(2**20)
_US = 1e6


def _program(problem: Problem, objective: str, budget: int | None) -> tuple:
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint

    kinds: dict[tuple, float] = {}
    for g in problem.groups:
        for c in g.candidates:
            kinds.update(c.kinds)
    kind_index = {k: i for i, k in enumerate(kinds)}
    cells = [(gi, ci) for gi, g in enumerate(problem.groups) for ci in range(len(g.candidates))]
    n_cells, n_kinds = len(cells), len(kinds)
    size = 2 * n_cells + n_kinds + 1  # n..., u..., y..., z
    z = size - 1
    rows, lo, hi = [], [], []

    def row(entries: dict[int, float], low: float, high: float) -> None:
        vector = np.zeros(size)
        for i, v in entries.items():
            vector[i] = v
        rows.append(vector)
        lo.append(low)
        hi.append(high)

    for gi, g in enumerate(problem.groups):
        count = len(g.tensors)
        row({i: 1.0 for i, (gj, _) in enumerate(cells) if gj == gi}, count, count)
    for i, (gi, ci) in enumerate(cells):
        g = problem.groups[gi]
        cand = g.candidates[ci]
        row({i: 1.0, n_cells + i: -float(len(g.tensors))}, -np.inf, 0.0)
        for k, _ in cand.kinds:
            row({n_cells + i: 1.0, 2 * n_cells + kind_index[k]: -1.0}, -np.inf, 0.0)
        row({n_cells + i: cand.transient / _MIB, z: -1.0}, -np.inf, 0.0)
    memory = {i: problem.groups[gi].candidates[ci].memory / _MIB for i, (gi, ci) in enumerate(cells)}
    memory[z] = 1.0
    if budget is not None:
        row(memory, -np.inf, budget / _MIB)
    cost = np.zeros(size)
    if objective == "time":
        for i, (gi, ci) in enumerate(cells):
            cost[i] = problem.groups[gi].candidates[ci].seconds * _US
        for k, latency in kinds.items():
            cost[2 * n_cells + kind_index[k]] = latency * _US
    else:
        for i, v in memory.items():
            cost[i] = v
    upper = np.array([len(problem.groups[gi].tensors) for gi, _ in cells] + [1] * (n_cells + n_kinds) + [np.inf])
    integrality = np.array([1] * (2 * n_cells + n_kinds) + [0])
    return cells, cost, LinearConstraint(np.array(rows), lo, hi), Bounds(np.zeros(size), upper), integrality


def _solve(problem: Problem, objective: str, budget: int | None, time_limit: float) -> tuple[Choice, float, bool]:
    import numpy as np
    from scipy.optimize import milp

    cells, cost, constraints, bounds, integrality = _program(problem, objective, budget)
    options = {"mip_rel_gap": 0.0, "time_limit": time_limit, "presolve": True}
    result = milp(cost, constraints=constraints, bounds=bounds, integrality=integrality, options=options)
    if result.x is None:
        raise SuggestError("infeasible")
    counts = np.rint(result.x[: len(cells)]).astype(int)
    picks: list[list[int]] = [[] for _ in problem.groups]
    for (gi, ci), n in zip(cells, counts, strict=True):
        picks[gi] += [ci] * int(n)
    gap = float(getattr(result, "mip_gap", 0.0) or 0.0)
    return problem.evaluate(picks), gap, result.status == 0


def smallest_memory(problem: Problem, time_limit: float = 10.0) -> Choice:
    """The choice of least memory per rank."""
    return _solve(problem, "memory", None, time_limit)[0]


def suggest(problem: Problem, budget: int, time_limit: float = 10.0) -> Suggestion:
    """The fastest choice (modeled) within ``budget`` bytes per rank; a :class:`SuggestError`
    naming the smallest budget that fits when none does."""
    started = time.perf_counter()
    least = smallest_memory(problem, time_limit)
    if least.memory > budget:
        raise _too_small(budget, least.memory)
    limit = budget
    for _ in range(8):
        try:
            best, gap, optimal = _solve(problem, "time", limit, time_limit)
        except SuggestError:
            best, gap, optimal = least, 0.0, False
        if best.memory <= budget:
            return Suggestion(problem, budget, best, optimal, gap, time.perf_counter() - started)
        limit -= best.memory - budget  # the solver's float tolerance let it exceed: tighten
    return Suggestion(problem, budget, least, False, 0.0, time.perf_counter() - started)


def _too_small(budget: int, least: int) -> SuggestError:
    return SuggestError(
        f"no choice of layouts fits {budget} bytes per rank; the smallest budget that fits is "
        f"{least} bytes ({least / 2**30:.3f} GiB)"
    )


def suggest_best(problems: Sequence[Problem], budget: int, time_limit: float = 10.0) -> Suggestion:
    """The fastest of :func:`suggest` over ``problems`` (the plain one and the flat ones of
    ``planner.suggest.build_problems``; the first on a tie); when none fits, the error names
    the smallest budget that fits any of them."""
    started = time.perf_counter()
    least = [smallest_memory(p, time_limit).memory for p in problems]
    fitting = [suggest(p, budget, time_limit) for p, m in zip(problems, least, strict=True) if m <= budget]
    if not fitting:
        raise _too_small(budget, min(least))
    best = min(fitting, key=lambda r: r.best.seconds)
    return attrs.evolve(best, solve_seconds=time.perf_counter() - started)
