"""Exact search for the cheapest plan between two layouts.

States are layouts in raw form, ``(dims, partial)``; the moves are the baseline move set of
the planner issue (one mesh axis per step). Dijkstra over ``(seconds, steps)`` finds the
cheapest plan, and among plans of equal time one with the fewest steps. Moves are generated
in a fixed order, so equal inputs always give the same plan.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Iterator

from planner.cost import CostModel, PlanError
from planner.plan import Plan, Step, same_geometry
from shardlang.dtypes import itemsize as dtype_itemsize
from shardlang.errors import ShardlangError
from shardlang.layout import Layout, padded_length, reduce_ops_commute

Dims = tuple[tuple[int, ...], ...]
Partial = tuple[tuple[int, str], ...]
State = tuple[Dims, Partial]
# A move: op, axis, dim, to_dim, reduce_op, next state.
Move = tuple[str, int, int | None, int | None, str | None, State]


def plan(
    src: Layout,
    dst: Layout,
    shape: tuple[int, ...] | list[int],
    dtype: str = "f32",
    cost: CostModel | None = None,
    *,
    max_local_bytes: int | None = None,
) -> Plan:
    """The cheapest plan from ``src`` to ``dst`` for a tensor of ``shape`` and ``dtype``.

    With ``max_local_bytes``, the cheapest plan whose every state (source and target
    included) holds at most that many bytes per rank; a :class:`PlanError` when none does.
    Results are memoized on all arguments.
    """
    shape = tuple(int(s) for s in shape)
    try:
        src.check_shape(shape)
        dst.check_shape(shape)
        dtype_itemsize(dtype)
    except ShardlangError as e:
        raise PlanError(f"cannot plan {src} -> {dst}: {e.message}") from None
    if not same_geometry(src.mesh, dst.mesh):
        raise PlanError(
            f"cannot plan {src} -> {dst}: the layouts are on different meshes "
            f"({src.mesh.describe()} and {dst.mesh.describe()})"
        )
    return _plan_cached(src, dst, shape, dtype, cost or CostModel(), max_local_bytes)


@functools.lru_cache(maxsize=8192)
def _plan_cached(
    src: Layout, dst: Layout, shape: tuple[int, ...], dtype: str, cost: CostModel, max_local_bytes: int | None
) -> Plan:
    mesh = dst.mesh
    alpha, bandwidth = cost.for_mesh(mesh)
    space = _Space(mesh.shape, shape, dtype_itemsize(dtype), dict(dst.partial))
    start: State = (src.dims, src.partial)
    goal: State = (dst.dims, dst.partial)
    if max_local_bytes is not None:
        for name, state in (("source", start), ("target", goal)):
            if space.local_bytes(state[0]) > max_local_bytes:
                raise PlanError(
                    f"cannot plan {src} -> {dst}: the {name} holds {space.local_bytes(state[0])} bytes per rank, "
                    f"more than max_local_bytes={max_local_bytes}"
                )

    best: dict[State, tuple[float, int]] = {start: (0.0, 0)}
    parent: dict[State, tuple[State, Move, int, float]] = {}
    heap: list[tuple[float, int, int, State]] = [(0.0, 0, 0, start)]
    tie = 0
    while heap:
        seconds, steps, _, state = heapq.heappop(heap)
        if best[state] < (seconds, steps):
            continue
        if state == goal:
            return _build_plan(src, dst, shape, dtype, cost, start, goal, parent)
        for move in space.moves(state):
            nxt = move[5]
            if max_local_bytes is not None and space.local_bytes(nxt[0]) > max_local_bytes:
                continue
            nbytes, rounds = space.step_cost(move, state)
            axis = move[1]
            step_seconds = rounds * alpha[axis] + nbytes / bandwidth[axis]
            key = (seconds + step_seconds, steps + 1)
            if nxt not in best or key < best[nxt]:
                best[nxt] = key
                parent[nxt] = (state, move, nbytes, step_seconds)
                tie += 1
                heapq.heappush(heap, (key[0], key[1], tie, nxt))
    bound = f" within max_local_bytes={max_local_bytes}" if max_local_bytes is not None else ""
    raise PlanError(f"no plan takes {src} to {dst}{bound}")


def _build_plan(
    src: Layout,
    dst: Layout,
    shape: tuple[int, ...],
    dtype: str,
    cost: CostModel,
    start: State,
    goal: State,
    parent: dict[State, tuple[State, Move, int, float]],
) -> Plan:
    steps: list[Step] = []
    state = goal
    while state != start:
        prev, (op, axis, dim, to_dim, reduce_op, _), nbytes, seconds = parent[state]
        layout = dst if state == goal else Layout(dims=state[0], mesh=dst.mesh, partial=state[1])
        steps.append(Step(op, axis, dim, to_dim, reduce_op, layout, nbytes, seconds))
        state = prev
    return Plan(src=src, dst=dst, shape=shape, dtype=dtype, steps=tuple(reversed(steps)), cost=cost)


class _Space:
    """The move graph for one mesh, tensor shape and target (partial ops it may create)."""

    def __init__(
        self, mesh_shape: tuple[int, ...], shape: tuple[int, ...], itemsize: int, target_partial: dict[int, str]
    ) -> None:
        self.mesh_shape = mesh_shape
        self.shape = shape
        self.itemsize = itemsize
        self.target_partial = target_partial

    @functools.cache  # noqa: B019 - one _Space per planning call
    def local_length(self, dim: int, axes: tuple[int, ...]) -> int:
        return padded_length(self.shape[dim], (self.mesh_shape[a] for a in axes))

    def local_elements(self, dims: Dims) -> int:
        return math.prod(self.local_length(d, axes) for d, axes in enumerate(dims))

    def local_bytes(self, dims: Dims) -> int:
        return self.local_elements(dims) * self.itemsize

    def moves(self, state: State) -> Iterator[Move]:
        dims, partial = state
        ops = dict(partial)
        owner = {a: d for d, axes in enumerate(dims) for a in axes}
        ndim = len(dims)
        for axis in range(len(self.mesh_shape)):
            if axis in owner:
                d = owner[axis]
                if dims[d][-1] != axis:
                    continue  # only the innermost split of a dim can move
                rest = dims[d][:-1]
                yield ("all_gather", axis, d, None, None, (_set_dim(dims, d, rest), partial))
                for j in range(ndim):
                    if j != d:
                        moved = _set_dim(_set_dim(dims, d, rest), j, dims[j] + (axis,))
                        yield ("all_to_all", axis, d, j, None, (moved, partial))
            elif axis in ops:
                op = ops[axis]
                # Reductions apply in ascending axis order; an axis may go first only if its
                # op commutes with every partial axis before it.
                if any(b < axis and not reduce_ops_commute(o, op) for b, o in partial):
                    continue
                rest_partial = tuple(p for p in partial if p[0] != axis)
                yield ("all_reduce", axis, None, None, op, (dims, rest_partial))
                for d in range(ndim):
                    yield ("reduce_scatter", axis, d, None, op, (_set_dim(dims, d, dims[d] + (axis,)), rest_partial))
            else:
                for d in range(ndim):
                    yield ("slice", axis, d, None, None, (_set_dim(dims, d, dims[d] + (axis,)), partial))
                if axis in self.target_partial:
                    op = self.target_partial[axis]
                    yield ("partial", axis, None, None, op, (dims, tuple(sorted((*partial, (axis, op))))))

    def step_cost(self, move: Move, state: State) -> tuple[int, int]:
        """(bytes sent per rank, latency rounds) of ``move`` taken from ``state``."""
        op, axis, _dim, to_dim, _, nxt = move
        n = self.mesh_shape[axis]
        if op in ("slice", "partial") or n == 1:
            return 0, 0
        if op == "all_gather":
            return (n - 1) * self.local_bytes(state[0]), n - 1
        if op == "reduce_scatter":
            return (n - 1) * self.local_bytes(nxt[0]), n - 1
        if op == "all_reduce":
            return 2 * (n - 1) * -(-self.local_elements(state[0]) // n) * self.itemsize, 2 * (n - 1)
        assert op == "all_to_all" and to_dim is not None
        dims = state[0]
        cut = -(-self.local_length(to_dim, dims[to_dim]) // n)
        elements = math.prod(cut if d == to_dim else self.local_length(d, axes) for d, axes in enumerate(dims))
        return (n - 1) * elements * self.itemsize, n - 1


def _set_dim(dims: Dims, d: int, axes: tuple[int, ...]) -> Dims:
    return (*dims[:d], axes, *dims[d + 1:])
