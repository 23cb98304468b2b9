"""Exact search for the cheapest plan between two layouts.

A* over the move graph of :mod:`planner.space`, with the lower bound of :mod:`planner.bound`.
Plans are compared by (time, steps): the cheapest plan, and among plans of equal time one
with the fewest steps. Times are compared exactly, as integers (``planner.cost.integer_rates``),
so summation order never decides a tie. Moves are generated in a fixed order and ties in the
queue are broken by insertion order, so equal inputs always give the same plan.
"""

from __future__ import annotations

import functools
import heapq
import math

from planner.bound import LowerBound, Terms
from planner.cost import DEFAULT_COST, CostModel, PlanError, integer_rates
from planner.plan import Plan, Step, same_geometry
from planner.space import Move, Space, roles_of
from shardlang.dtypes import itemsize as dtype_itemsize
from shardlang.errors import ShardlangError
from shardlang.layout import Layout


def check_request(
    src: Layout,
    dst: Layout,
    shape: tuple[int, ...] | list[int],
    dtype: str,
    cost: CostModel,
    max_local_bytes: int | None,
) -> tuple[int, ...]:
    """The shape as a tuple of ints, once the request makes sense: the shape fits both layouts,
    the dtype is known, the cost model fits both meshes, and ``max_local_bytes`` is ``None`` or
    a byte count that both ends fit in; a :class:`PlanError` naming the pair if not."""
    try:
        shape = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise PlanError(f"cannot plan {src} -> {dst}: the shape {shape!r} is not a sequence of lengths") from None
    try:
        src.check_shape(shape)
        dst.check_shape(shape)
        itemsize = dtype_itemsize(dtype)
        cost.for_mesh(src.mesh)
        if dst.mesh.ndim != src.mesh.ndim:  # the fit depends on the number of axes only
            cost.for_mesh(dst.mesh)
    except ShardlangError as e:
        raise PlanError(f"cannot plan {src} -> {dst}: {e.message}") from None
    if max_local_bytes is None:
        return shape
    if isinstance(max_local_bytes, bool) or not isinstance(max_local_bytes, int) or max_local_bytes < 0:
        raise PlanError(f"cannot plan {src} -> {dst}: max_local_bytes must be a byte count, got {max_local_bytes!r}")
    for name, layout in (("source", src), ("target", dst)):
        held = math.prod(layout.local_shape(shape)) * itemsize
        if held > max_local_bytes:
            raise PlanError(
                f"cannot plan {src} -> {dst}: the {name} holds {held} bytes per rank, "
                f"more than max_local_bytes={max_local_bytes}"
            )
    return shape


def collective_plan(
    src: Layout,
    dst: Layout,
    shape: tuple[int, ...] | list[int],
    dtype: str = "f32",
    cost: CostModel | None = None,
    *,
    max_local_bytes: int | None = None,
) -> Plan:
    """The cheapest plan of collectives (the baseline move set) from ``src`` to ``dst``, two
    layouts on the same mesh, for a tensor of ``shape`` and ``dtype``.

    With ``max_local_bytes``, the cheapest plan whose every state (source and target
    included) holds at most that many bytes per rank; a :class:`PlanError` when none does.
    Results are memoized on all arguments.
    """
    cost = cost or DEFAULT_COST
    shape = check_request(src, dst, shape, dtype, cost, max_local_bytes)
    if not same_geometry(src.mesh, dst.mesh):
        raise PlanError(
            f"cannot plan {src} -> {dst} with collectives: the layouts are on different meshes "
            f"({src.mesh.describe()} and {dst.mesh.describe()})"
        )
    return _plan_cached(src, dst, shape, dtype, cost, max_local_bytes)


@functools.lru_cache(maxsize=8192)
def _plan_cached(
    src: Layout, dst: Layout, shape: tuple[int, ...], dtype: str, cost: CostModel, max_local_bytes: int | None
) -> Plan:
    mesh = dst.mesh
    itemsize = dtype_itemsize(dtype)
    alpha, bandwidth = cost.for_mesh(mesh)  # check_request made sure it fits
    per_round, per_byte = integer_rates(alpha, bandwidth)
    twin_key = tuple(zip(mesh.shape, per_round, per_byte, strict=True))
    space = Space(mesh.shape, shape, itemsize, (dst.dims, dst.partial), twin_key)
    if src.dims == dst.dims and src.partial == dst.partial:
        return Plan(src=src, dst=dst, shape=shape, dtype=dtype, steps=(), cost=cost)
    bound = LowerBound(
        mesh.shape,
        itemsize,
        len(shape),
        per_round,
        per_byte,
        space.target_roles,
        space.local_elements(dst.dims),
        math.prod(shape),
    )
    terms = bound.state_terms(roles_of((src.dims, src.partial), mesh.ndim, dst.dims))
    start = space.encode(src.dims, src.partial)
    path = _astar(space, bound, per_round, per_byte, start, space.local_elements(src.dims), terms, max_local_bytes)
    if path is None:
        limit = f" within max_local_bytes={max_local_bytes}" if max_local_bytes is not None else ""
        raise PlanError(f"no plan takes {src} to {dst}{limit}")
    steps = []
    for op, axis, dim, to_dim, reduce_op, state, nbytes, rounds, *_ in path:
        dims, partial = space.decode(state)
        layout = dst if state == space.goal else Layout.trusted(dims, mesh, partial)
        seconds = rounds * alpha[axis] + nbytes / bandwidth[axis]
        steps.append(Step(op, axis, dim, to_dim, reduce_op, layout, nbytes, seconds))
    return Plan(src=src, dst=dst, shape=shape, dtype=dtype, steps=tuple(steps), cost=cost)


def _astar(
    space: Space,
    bound: LowerBound,
    per_round: tuple[int, ...],
    per_byte: tuple[int, ...],
    start: int,
    elements: int,
    terms: Terms,
    max_local_bytes: int | None,
) -> list[Move] | None:
    """The moves of a cheapest plan by (time units, steps) from ``start`` (which holds
    ``elements`` per rank and whose bound terms are ``terms``) to ``space.goal``, or ``None``
    if none exists."""
    goal = space.goal
    # state -> (time units, steps, previous state, move) of the cheapest way there known
    best: dict[int, tuple[int, int, int | None, Move | None]] = {start: (0, 0, None, None)}
    # Entries: (f time, f steps, -g time, tie, g time, g steps, state, local elements, bound
    # terms, bound is full). Among equal f the entry nearer the goal (more time spent) goes
    # first, which ends plateaus of equal-cost orders. Entries are queued with the quick
    # bound; the full one is computed when an entry comes first, and the entry requeued if
    # it rose (most queued entries are never taken, so most full bounds are never computed).
    heap = [(terms[0], terms[1], 0, 0, 0, 0, start, elements, terms, False)]
    tie = 0
    term_table = bound.terms
    quick_bound = bound.quick_bytes_bound
    limit = math.inf if max_local_bytes is None else max_local_bytes // space.itemsize  # in elements
    while heap:
        f, f_steps, _, _, g, g_steps, state, elements, terms, full = heapq.heappop(heap)
        known = best[state]
        if known[0] != g or known[1] != g_steps:
            continue  # a cheaper way here was found after this entry was queued
        h_rounds, h_steps, h_reduce, h_move = terms
        if not full:
            f_full = g + h_rounds + bound.bytes_bound(elements, h_reduce, h_move)
            if f_full > f:
                tie += 1
                heapq.heappush(heap, (f_full, f_steps, -g, tie, g, g_steps, state, elements, terms, True))
                continue
        if state == goal:
            path = []
            while known[3] is not None:
                path.append(known[3])
                known = best[known[2]]
            path.reverse()
            return path
        n_steps = g_steps + 1
        for move in space.moves(state, elements, known[3]):
            _, axis, _, _, _, nxt, nbytes, rounds, before, after, next_elements = move
            if next_elements > limit:
                continue
            n_g = g + rounds * per_round[axis] + nbytes * per_byte[axis]
            seen = best.get(nxt)
            if seen is not None and (seen[0] < n_g or (seen[0] == n_g and seen[1] <= n_steps)):
                continue
            best[nxt] = (n_g, n_steps, state, move)
            axis_terms = term_table[axis]
            old, new = axis_terms[before], axis_terms[after]
            n_rounds = h_rounds - old[0] + new[0]
            steps = h_steps - old[1] + new[1]
            reducing = h_reduce - old[2] + new[2]
            moving = h_move - old[3] + new[3]
            tie += 1
            entry = (n_rounds, steps, reducing, moving)
            f = n_g + n_rounds + quick_bound(next_elements, reducing)
            heapq.heappush(heap, (f, n_steps + steps, -n_g, tie, n_g, n_steps, nxt, next_elements, entry, False))
    return None
