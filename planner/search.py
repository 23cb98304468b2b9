"""Exact search for the cheapest plan between two layouts.

A* over the move graph of :mod:`planner.space`, with the lower bound of :mod:`planner.bound`.
Plans are compared by (time, steps): the cheapest plan, and among plans of equal time one
with the fewest steps; the time compared is the model's with its choice margin on every step
(``planner.cost``: 0 but in a calibrated model), the plan's seconds the model's alone. Times
are compared exactly, as integers (``planner.units.integer_rates``), so summation order never
decides a tie. Moves are generated in a fixed order and ties in the queue are broken by
insertion order, so equal inputs always give the same plan.

Mesh axes of size 1 that both layouts leave replicated are dropped before the search (no
cheapest plan moves them: a step on a size-1 axis sends nothing and only adds a step), and the
plan's steps and layouts are mapped back to the full mesh.

Budget. A search may generate at most ``max_states`` states (``DEFAULT_MAX_STATES``, about a
second here; a state is generated when a move reaches it more cheaply than before, so the
count bounds the queue and the memory). One that would need more ends in a
:class:`PlanBudgetError` naming the pair and the budget, never in a plan that is not the
cheapest. The count is a property of the request, not of the machine or of what is cached, so
every process plans or refuses alike.
"""

from __future__ import annotations

import functools
import heapq
import math

import attrs

from planner.bound import KindRates, LowerBound, Terms, kind_rates
from planner.cost import COPY, DEFAULT_COST, LOCAL_OPS, STEP, CostModel, large_key, priced_as
from planner.errors import PlanBudgetError, PlanError
from planner.plans import Plan, Step
from planner.space import Fields, PackedMove, Space, pruning, roles_of
from planner.units import integer_op_rates
from shardlang.dtypes import itemsize as dtype_itemsize
from shardlang.errors import ShardlangError
from shardlang.layout import Layout
from shardlang.mesh import Mesh

# About half a second of search on one core here (some 100,000 states a second); every plan of
# the benchmarks and conformance data needs under a tenth of it.
DEFAULT_MAX_STATES = 50_000
# What a collective search gives back: the plan, or why there is none, and the states it generated.
Outcome = tuple["Plan | PlanError", int]


@attrs.frozen
class Request:
    """A request that makes sense (:func:`checked`): what the memos key plans by."""

    src: Layout
    dst: Layout
    shape: tuple[int, ...]
    dtype: str
    cost: CostModel
    max_local_bytes: int | None
    max_states: int

    def between(self, src: Layout, dst: Layout) -> Request:
        """The same request between two other layouts (a leg of a mixed plan), checked."""
        return checked(src, dst, self.shape, self.dtype, self.cost, self.max_local_bytes, self.max_states)


def checked(
    src: Layout,
    dst: Layout,
    shape: tuple[int, ...] | list[int],
    dtype: str,
    cost: CostModel | None,
    max_local_bytes: int | None,
    max_states: int = DEFAULT_MAX_STATES,
) -> Request:
    """The request, once it makes sense: the shape (made a tuple of ints) fits both layouts,
    the dtype is known, the cost model (default :data:`planner.cost.DEFAULT_COST`) fits both
    meshes, ``max_local_bytes`` is ``None`` or a byte count that both ends fit in, and
    ``max_states`` a positive count; a :class:`PlanError` naming the pair if not."""
    cost = cost or DEFAULT_COST
    try:
        shape = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise PlanError(f"cannot plan {src} -> {dst}: the shape {shape!r} is not a sequence of lengths") from None
    try:
        src.check_shape(shape)
        dst.check_shape(shape)
        itemsize = dtype_itemsize(dtype)
        _check_fit(cost, src.mesh)
        if dst.mesh.ndim != src.mesh.ndim:
            _check_fit(cost, dst.mesh)
    except ShardlangError as e:
        raise PlanError(f"cannot plan {src} -> {dst}: {e.message}") from None
    if isinstance(max_states, bool) or not isinstance(max_states, int) or max_states < 1:
        raise PlanError(f"cannot plan {src} -> {dst}: max_states must be a positive count, got {max_states!r}")
    request = Request(src, dst, shape, dtype, cost, max_local_bytes, max_states)
    if max_local_bytes is None:
        return request
    if isinstance(max_local_bytes, bool) or not isinstance(max_local_bytes, int) or max_local_bytes < 0:
        raise PlanError(f"cannot plan {src} -> {dst}: max_local_bytes must be a byte count, got {max_local_bytes!r}")
    for name, layout in (("source", src), ("target", dst)):
        held = math.prod(layout.local_shape(shape)) * itemsize
        if held > max_local_bytes:
            raise PlanError(
                f"cannot plan {src} -> {dst}: the {name} holds {held} bytes per rank, "
                f"more than max_local_bytes={max_local_bytes}"
            )
    return request


# (cost model, number of mesh axes) that fit: the fit depends on the number of axes only.
_FITS: set[tuple[CostModel, int]] = set()


def _check_fit(cost: CostModel, mesh: Mesh) -> None:
    """``cost.for_mesh(mesh)``'s check (a ShardlangError where the model's per-axis figures do
    not fit the mesh), remembered once passed: every request checks it."""
    key = (cost, mesh.ndim)
    if key not in _FITS:
        cost.for_mesh(mesh)
        if len(_FITS) >= 1024:
            _FITS.clear()
        _FITS.add(key)


def collective_outcome(request: Request) -> Outcome:
    """The cheapest plan of collectives (the baseline move set) between the request's two
    layouts on one mesh, or the :class:`PlanError` that says why there is none, not raised,
    with the states its search generated (what a caller that plans many legs charges to one
    budget). Memoized on the request; ``planner.plan`` is the public entry point."""
    src, dst = request.src, request.dst
    if not src.mesh.same_geometry(dst.mesh):
        raise PlanError(
            f"cannot plan {src} -> {dst} with collectives: the layouts are on different meshes "
            f"({src.mesh.describe()} and {dst.mesh.describe()})"
        )
    return _plan_cached(request)


def budget_error(src: Layout, dst: Layout, shape: tuple[int, ...], max_states: int, what: str) -> PlanBudgetError:
    """The error of a request that used up ``max_states`` (``what`` says on what). Between two
    meshes only point-to-point steps move data, pricing them at one state per rank of both:
    only a larger budget helps there."""
    if src.mesh.same_geometry(dst.mesh):
        advice = (
            "plan with fewer mesh axes (or fewer partial ones), without point-to-point steps (--p2p off), "
            "with a max_local_bytes, or with a larger max_states (--max-states)"
        )
    else:
        advice = "between two meshes only a larger max_states (--max-states) plans it"
    return PlanBudgetError(
        f"cannot plan {src} -> {dst} (shape {list(shape)}): {what} would take more than the search budget "
        f"of max_states={max_states} states; {advice}"
    )


class _OverBudget(Exception):
    """Raised inside the search when it has generated more states than it may."""


@functools.lru_cache(maxsize=8192)
def _plan_cached(request: Request) -> Outcome:
    src, dst, shape, dtype, cost = request.src, request.dst, request.shape, request.dtype, request.cost
    max_local_bytes, max_states = request.max_local_bytes, request.max_states
    if src.dims == dst.dims and src.partial == dst.partial:
        return Plan(src=src, dst=dst, shape=shape, dtype=dtype, steps=(), cost=cost), 0
    mesh = dst.mesh
    kept = _kept_axes(src, dst)
    tables = _tables(cost, mesh, kept)
    problem = _Problem(src, dst, shape, dtype_itemsize(dtype), kept, tables)
    figures, large_from = tables.figures, tables.full_large_from
    counter = [0]
    try:
        path = _astar(
            problem.space,
            problem.bound,
            problem.per_round,
            problem.per_byte,
            problem.large_from,
            problem.start,
            problem.space.local_elements(problem.src_dims),
            problem.start_terms,
            max_local_bytes,
            (max_states, counter),
        )
    except _OverBudget:
        return budget_error(src, dst, shape, max_states, "the collective search"), counter[0]
    if path is None:
        limit = f" within max_local_bytes={max_local_bytes}" if max_local_bytes is not None else ""
        return PlanError(f"no plan takes {src} to {dst}{limit}"), counter[0]
    steps = []
    for op, axis, dim, to_dim, reduce_op, state, nbytes, rounds, *_, copied in path:
        full_axis = kept[axis]
        if state == problem.space.goal:
            layout = dst
        else:
            dims, partial = problem.space.decode(state)
            if len(kept) < mesh.ndim:
                dims = tuple(tuple(kept[a] for a in axes) for axes in dims)
                partial = tuple((kept[a], o) for a, o in partial)
            layout = Layout.trusted(dims, mesh, partial)
        alpha, bandwidth = figures[priced_as(op, full_axis, nbytes, large_from)]
        seconds = rounds * alpha[full_axis] + nbytes / bandwidth[full_axis] + cost.overhead + cost.copy_seconds(copied)
        steps.append(Step(op, full_axis, dim, to_dim, reduce_op, layout, nbytes, seconds))
    if all(s.op in LOCAL_OPS for s in steps):  # the executor's copy of the result (planner.cost)
        last = steps[-1]
        copy = cost.copy_seconds(math.prod(dst.local_shape(shape)) * problem.space.itemsize)
        steps[-1] = attrs.evolve(last, seconds=last.seconds + copy)
    return Plan(src=src, dst=dst, shape=shape, dtype=dtype, steps=tuple(steps), cost=cost), counter[0]


def _kept_axes(src: Layout, dst: Layout) -> tuple[int, ...]:
    """The mesh axes the search sees: all but those of size 1 that both layouts leave
    replicated (module docstring)."""
    shape = dst.mesh.shape
    if 1 not in shape:
        return tuple(range(len(shape)))
    mentioned = {a for layout in (src, dst) for axes in layout.dims for a in axes}
    mentioned |= {a for layout in (src, dst) for a, _ in layout.partial}
    return tuple(a for a, n in enumerate(shape) if n > 1 or a in mentioned)


@attrs.frozen
class _Tables:
    """What a search needs of a mesh (its ``kept`` axes only, renumbered ``0..len(kept)-1``) and
    a cost model, whatever the pair: the integer rates per kind, the large-message regimes'
    pseudo-kinds and starts per kept axis, the twin keys and pruning rules of
    ``planner.space``, and the bound's rates (``planner.bound.kind_rates``)."""

    figures: dict[str, tuple[tuple[float, ...], tuple[float, ...]]]  # the model's, on the whole mesh
    full_large_from: dict[str, tuple[int, ...]]  # its regimes' starts, on the whole mesh
    mesh_shape: tuple[int, ...]
    per_round: dict[str, tuple[int, ...]]
    per_byte: dict[str, tuple[int, ...]]
    large_from: dict[str, tuple[str, tuple[int, ...]]]
    twin_key: tuple[object, ...]
    rules: tuple[tuple[bool, bool, bool], ...]
    rates: KindRates


# (cost model, mesh shape, kept axes) -> tables; cleared when full (few meshes recur in a process).
_TABLES: dict[tuple[CostModel, tuple[int, ...], tuple[int, ...]], _Tables] = {}


def _tables(cost: CostModel, mesh: Mesh, kept: tuple[int, ...]) -> _Tables:
    """The :class:`_Tables` of ``mesh``'s ``kept`` axes under ``cost``. Cached by the mesh's
    shape (the figures depend on its axes, not its ranks): a process plans many pairs on few
    meshes, and these depend on neither layout."""
    key = (cost, mesh.shape, kept)
    found = _TABLES.get(key)
    if found is None:
        if len(_TABLES) >= 256:
            _TABLES.clear()
        found = _TABLES[key] = _tables_of(cost, mesh, kept)
    return found


def _tables_of(cost: CostModel, mesh: Mesh, kept: tuple[int, ...]) -> _Tables:
    figures = cost.figures(mesh)  # checked() made sure it fits
    large_from = cost.large_from(mesh)
    mesh_shape = tuple(mesh.shape[a] for a in kept)
    kept_figures = {op: (tuple(al[a] for a in kept), tuple(b[a] for a in kept)) for op, (al, b) in figures.items()}
    ((per_round, per_byte),) = integer_op_rates(kept_figures)
    kept_large = {op: (large_key(op), tuple(starts[a] for a in kept)) for op, starts in large_from.items()}
    keys = [
        (
            n,
            *((per_round[op][a], per_byte[op][a]) for op in sorted(per_round)),
            *((op, starts[a]) for op, (_, starts) in sorted(kept_large.items())),
        )
        for a, n in enumerate(mesh_shape)
    ]
    twin_key = tuple(keys.index(key) for key in keys)  # equal for axes of equal keys, cheap to compare
    rules = pruning(per_round, per_byte)
    rates = kind_rates(mesh_shape, per_round, per_byte)
    return _Tables(figures, large_from, mesh_shape, per_round, per_byte, kept_large, twin_key, rules, rates)


class _Problem:
    """A request on the mesh of its ``kept`` axes only: the move graph, the bound, the integer
    rates and the start, with axes renumbered ``0..len(kept)-1``."""

    def __init__(
        self, src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int, kept: tuple[int, ...], tables: _Tables
    ) -> None:
        index = None if len(kept) == src.mesh.ndim else {a: i for i, a in enumerate(kept)}
        self.per_round, self.per_byte, self.large_from = tables.per_round, tables.per_byte, tables.large_from
        self.src_dims, src_partial = _renumbered(src, index)
        goal_dims, goal_partial = _renumbered(dst, index)
        mesh_shape = tables.mesh_shape
        self.space = Space(
            mesh_shape,
            shape,
            itemsize,
            (goal_dims, goal_partial),
            tables.twin_key,
            tables.rules,
            copies=COPY in self.per_byte,
        )
        self.bound = LowerBound(
            itemsize,
            len(shape),
            tables.rates,
            self.space.target_roles,
            self.space.local_elements(goal_dims),
            math.prod(shape),
        )
        self.start_terms = self.bound.state_terms(roles_of((self.src_dims, src_partial), len(mesh_shape), goal_dims))
        self.start = self.space.encode(self.src_dims, src_partial)


def _renumbered(layout: Layout, index: dict[int, int] | None) -> Fields:
    """The layout's fields with its axes renumbered by ``index`` (``None``: every axis kept)."""
    if index is None:
        return layout.dims, layout.partial
    dims = tuple(tuple(index[a] for a in axes) for axes in layout.dims)
    return dims, tuple((index[a], op) for a, op in layout.partial)


def _astar(
    space: Space,
    bound: LowerBound,
    per_round: dict[str, tuple[int, ...]],
    per_byte: dict[str, tuple[int, ...]],
    large_from: dict[str, tuple[str, tuple[int, ...]]],
    start: int,
    elements: int,
    terms: Terms,
    max_local_bytes: int | None,
    budget: tuple[int, list[int]] = (DEFAULT_MAX_STATES, [0]),
) -> list[PackedMove] | None:
    """The moves of a cheapest plan by (time units, steps) from ``start`` (which holds
    ``elements`` per rank and whose bound terms are ``terms``) to ``space.goal``, or ``None``
    if none exists. ``large_from`` maps a kind with a large-message regime to its pseudo-kind
    and the bytes per axis where it starts (``planner.cost``). ``budget`` is (most states to
    generate, a one-item counter of those generated); :class:`_OverBudget` when the search
    would generate more."""
    goal = space.goal
    # state -> (time units, steps, previous state, move) of the cheapest way there known
    best: dict[int, tuple[int, int, int | None, PackedMove | None]] = {start: (0, 0, None, None)}
    # Entries: (f time, f steps, -g time, tie, g time, g steps, state, local elements, bound
    # terms, bound is full). Among equal f the entry nearer the goal (more time spent) goes
    # first, which ends plateaus of equal-cost orders. Entries are queued with the quick
    # bound; the full one is computed when an entry comes first, and the entry requeued if
    # it rose (most queued entries are never taken, so most full bounds are never computed).
    heap = [(terms[0], terms[1], 0, 0, 0, 0, start, elements, terms, False)]
    tie = 0
    term_table = bound.terms
    # bound.quick_bytes_bound, inlined: the growth to the target, the reductions' part memoized
    bytes_part = bound.bytes
    quick_bound, ordered = bytes_part.quick_bytes_bound, bytes_part.ordered
    growth, target = bytes_part.growth, bytes_part.target
    push, pop = heapq.heappush, heapq.heappop
    limit = math.inf if max_local_bytes is None else max_local_bytes // space.itemsize  # in elements
    max_states, counter = budget
    generated = 0
    per_step = per_round[STEP][0]  # the overhead and margin every step pays (planner.cost)
    per_copied = per_byte[COPY][0] if COPY in per_byte else 0  # a byte copied locally, left out of the bound
    while heap:
        f, f_steps, _, _, g, g_steps, state, elements, terms, full = pop(heap)
        known = best[state]
        if known[0] != g or known[1] != g_steps:
            continue  # a cheaper way here was found after this entry was queued
        h_rounds, h_steps, h_reduce, h_move = terms
        if not full:
            f_full = g + h_rounds + bytes_part.bytes_bound(elements, h_reduce, h_move)
            if f_full > f:
                tie += 1
                push(heap, (f_full, f_steps, -g, tie, g, g_steps, state, elements, terms, True))
                continue
        if state == goal:
            path = []
            while known[3] is not None:
                path.append(known[3])
                known = best[known[2]]
            path.reverse()
            counter[0] = generated
            return path
        n_steps = g_steps + 1
        for move in space.moves(state, elements, known[3]):
            op, axis, _, _, _, nxt, nbytes, rounds, before, after, next_elements, copied = move
            if next_elements > limit:
                continue
            if op in large_from and nbytes >= large_from[op][1][axis]:
                op = large_from[op][0]  # priced by its large-message regime
            n_g = g + per_step
            if rounds:  # local steps and steps on a size-1 axis send nothing
                n_g += rounds * per_round[op][axis] + nbytes * per_byte[op][axis]
            if copied:
                n_g += copied * per_copied
            seen = best.get(nxt)
            if seen is not None and (seen[0] < n_g or (seen[0] == n_g and seen[1] <= n_steps)):
                continue
            generated += 1
            if generated > max_states:
                counter[0] = generated
                raise _OverBudget
            best[nxt] = (n_g, n_steps, state, move)
            axis_terms = term_table[axis]
            old, new = axis_terms[before], axis_terms[after]
            n_rounds = h_rounds - old[0] + new[0]
            steps = h_steps - old[1] + new[1]
            reducing = h_reduce - old[2] + new[2]
            moving = h_move - old[3] + new[3]
            tie += 1
            entry = (n_rounds, steps, reducing, moving)
            f = n_g + n_rounds
            if target > next_elements:
                f += growth * (target - next_elements)
            if reducing:
                known_part = ordered.get(reducing)
                f += quick_bound(target, reducing) if known_part is None else known_part
            push(heap, (f, n_steps + steps, -n_g, tie, n_g, n_steps, nxt, next_elements, entry, False))
    counter[0] = generated
    return None
