"""An admissible lower bound on the cost of finishing a plan (the A* heuristic).

Costs are in the search's integer units (``planner.units.integer_rates``): a step on axis
``a`` of size ``n`` costs ``rounds * R[a] + bytes * B[a]``. The bound adds a rounds part and
a bytes part, each a lower bound on its term of the steps still to take.

Rounds, per axis. Every axis not in its target role needs steps of its own (a step moves one
axis), at least:

========================  ==================================  ======================
role now                  target role                         rounds at least
========================  ==================================  ======================
partial op o              partial o / split / anything else   0 / n-1 / 2(n-1)
split, not in place       anything                            n-1
replicated, or in place   anything                            0
========================  ==================================  ======================

(partial o -> replicated or partial o' needs all_reduce, 2(n-1) rounds, or reduce_scatter
then all_gather, (n-1) + (n-1).) The same table in steps breaks ties between plans of
equal time. An axis "must reduce" when it is partial and not so in the target; it "must
move" when it is split and not in place.

Bytes. Let E be the local elements of a state, N the mesh size, T the total elements,
rate[a] = (n-1)/n * itemsize * B[a]. Facts: a reduction at size E sends at least (n-1)E/n
elements (all_reduce 2(n-1)ceil(E/n), reduce_scatter (n-1)E' with E' >= E/n); so does the
all_gather (n-1)E or all_to_all (n-1)E_cut (E_cut >= E/n) that moves a split axis. A step
grows E by at most (n-1)E (all_gather) or nE_cut - E (all_to_all); other steps never grow
E. While an axis of size n is partial it splits nothing, so E >= T * n / N then.

(A) Growth and ordered reductions. The growing steps send at least (E_target - E) elements,
    at itemsize * min B each. Each axis that must reduce does so at a size of at least
    T / N times the sizes of the axes still partial then, itself included; over the orders
    of the reductions this sum is least when faster axes (smaller B) reduce first.
(B) Moves. Every axis that must reduce or move pays rate[a] * E_t at its size E_t then (at
    least T * n / N or T / N), and after the least of those sizes, x, the plan must grow
    back to E_target, charged at min over axes of rate[a]: a gather or all_to_all that
    both moves an axis and grows E sends enough for both (by the facts above). So the rest
    costs at least min over x of sum(rate * max(x, floor)) + growth * (E_target - min(E, x))+,
    a convex piecewise linear function of x whose minimum lies at a breakpoint.

The bytes part is the larger of (A) and (B). The search queues states with (A), which is
cheap, and computes (B) when a state comes first. Both are admissible; the search does not
rely on consistency (a state reached again more cheaply is expanded again).

Per-collective figures (``planner.cost``): ``R[a]`` and ``B[a]`` are then the least of the
axis's rates over the collective kinds and their large-message regimes (:func:`cheapest_rates`;
a step is priced by one regime, whose rates are at least those least ones, whatever its bytes).
Every step on axis ``a`` costs at least ``rounds * R[a] + bytes * B[a]`` in that model, and the bound above is a lower
bound of the sum of those over the steps still to take, so it stays admissible. So it does with
the executor terms (``planner.cost``): the overhead of every step and the bytes a collective
copies locally add to a step's cost and are never negative, and the bound leaves them out.
"""

from __future__ import annotations

import functools
import math

from planner.cost import PRICED_OPS, large_key
from planner.space import REPLICATED, role_code
from shardlang.layout import REDUCE_OPS

Terms = tuple[int, int, int, int]
LARGE_KEYS = frozenset(large_key(op) for op in PRICED_OPS)


class LowerBound:
    """Lower bounds for one search.

    ``terms[axis][role]`` is (rounds units, steps, reduce bit, move bit): the rounds and steps
    the axis still needs at least in that role, and ``1 << axis`` if it must still reduce
    (must still move). A state's bound is the sum of its axes' rounds plus the bytes bound of
    its size and the summed reduce and move bits.
    """

    def __init__(
        self,
        mesh_shape: tuple[int, ...],
        itemsize: int,
        ndim: int,
        units_per_round: tuple[int, ...],
        units_per_byte: tuple[int, ...],
        target_roles: tuple[int, ...],
        target_elements: int,
        total_elements: int,
    ) -> None:
        self.mesh_shape = mesh_shape
        self.terms = tuple(
            _axis_terms((n - 1) * r, 1 << a, target, ndim)
            for a, (n, r, target) in enumerate(zip(mesh_shape, units_per_round, target_roles, strict=True))
        )
        self.total = total_elements
        self.target = target_elements
        self.size, self.scale, self.growth, self.rate, self.moving_growth, self.reduce_order = _mesh_rates(
            mesh_shape, itemsize, units_per_byte
        )
        self._ordered: dict[int, int] = {}
        self._floors: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._moving: dict[tuple[int, int, int], int] = {}

    def state_terms(self, roles: tuple[int, ...]) -> Terms:
        """The terms of a state whose axes have the role codes ``roles``, summed."""
        rows = [self.terms[a][role] for a, role in enumerate(roles)]
        return sum(r[0] for r in rows), sum(r[1] for r in rows), sum(r[2] for r in rows), sum(r[3] for r in rows)

    def quick_bytes_bound(self, elements: int, reduce_mask: int) -> int:
        """(A): the growth to the target and the reductions in their cheapest order."""
        growth = self.growth * max(0, self.target - elements)
        if not reduce_mask:
            return growth
        ordered = self._ordered.get(reduce_mask)
        if ordered is None:
            ordered, partial_sizes = 0, 1
            for a in reversed(self.reduce_order):
                if reduce_mask >> a & 1:
                    partial_sizes *= self.mesh_shape[a]
                    ordered += self.rate[a] * self.total * partial_sizes
            ordered = self._ordered[reduce_mask] = ordered // self.scale
        return ordered + growth

    def bytes_bound(self, elements: int, reduce_mask: int, move_mask: int) -> int:
        """The larger of (A) and (B) for a state of ``elements`` whose axes in ``reduce_mask``
        must still reduce and in ``move_mask`` must still move."""
        quick = self.quick_bytes_bound(elements, reduce_mask)
        mask = reduce_mask | move_mask
        if not mask:
            return quick
        key = (elements, reduce_mask, mask)
        moving = self._moving.get(key)
        if moving is None:
            floors = self._floors.get((reduce_mask, mask))
            if floors is None:
                floors = self._floors[reduce_mask, mask] = self._moving_floors(reduce_mask, mask)
            now, target = elements * self.size, self.target * self.size
            moving = self._moving[key] = _least(floors, self.moving_growth, now, target) // self.scale
        return max(quick, moving)

    def _moving_floors(self, reduce_mask: int, mask: int) -> list[tuple[int, int]]:
        """(rate, least size, scaled) of every axis in ``mask``, reductions first."""
        return [
            (self.rate[a], self.total * (self.mesh_shape[a] if reduce_mask >> a & 1 else 1))
            for a in range(len(self.mesh_shape))
            if mask >> a & 1
        ]


@functools.lru_cache(maxsize=256)
def _mesh_rates(
    mesh_shape: tuple[int, ...], itemsize: int, units_per_byte: tuple[int, ...]
) -> tuple[int, int, int, tuple[int, ...], int, tuple[int, ...]]:
    """What the bytes bounds need of a mesh and cost model, whatever the pair: (mesh size,
    scale, growth rate, per-axis rate, moving growth rate, axes in reduction order). Cached:
    a model plans many pairs on one mesh."""
    size = math.prod(mesh_shape)
    growth = itemsize * min((b for n, b in zip(mesh_shape, units_per_byte, strict=True) if n > 1), default=0)
    # (A) and (B) are computed scaled by q * mesh size, so that the rates (n-1)/n and the
    # floors T * n / N are integers, then divided back, rounding down.
    q = math.lcm(*mesh_shape)
    rate = tuple((n - 1) * itemsize * b * (q // n) for n, b in zip(mesh_shape, units_per_byte, strict=True))
    moving_growth = min((r for n, r in zip(mesh_shape, rate, strict=True) if n > 1), default=0)
    reduce_order = tuple(sorted(range(len(mesh_shape)), key=lambda a: (units_per_byte[a], a)))
    return size, q * size, growth, rate, moving_growth, reduce_order


def cheapest_rates(
    per_round: dict[str, tuple[int, ...]], per_byte: dict[str, tuple[int, ...]]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per axis, the least units per round and per byte over the collective kinds and their
    large-message regimes (module docstring)."""
    ops = [op for op in per_round if op in PRICED_OPS or op in LARGE_KEYS]
    return (
        tuple(min(per_round[op][a] for op in ops) for a in range(len(per_round[ops[0]]))),
        tuple(min(per_byte[op][a] for op in ops) for a in range(len(per_byte[ops[0]]))),
    )


_FIRST_PARTIAL = role_code("P", "sum")
_FIRST_SPLIT = role_code("S", 0)


def _axis_terms(one_step: int, bit: int, target: int, ndim: int) -> tuple[Terms, ...]:
    """The terms of one axis, indexed by role code (the table above); ``one_step`` is the
    units of n-1 rounds on the axis."""
    zero = (0, 0, 0, 0)
    if target >= _FIRST_SPLIT:
        # Partial: reduce_scatter. Split out of place: leave; leave and come back to the same dim.
        partial, away, back = (one_step, 1, bit, 0), (one_step, 1, 0, bit), (one_step, 2, 0, bit)
        row = [(0, 1, 0, 0), *[partial] * len(REDUCE_OPS)]
        for dim in range(ndim):
            row += (back if target == _FIRST_SPLIT + 2 * dim + 1 else away, zero)
        return tuple(row)
    # Replicated or partial target. Partial with another op: reduce (2(n-1) rounds' worth),
    # then for a partial target the partial step. Split: leave (then the partial step).
    steps = 1 if target == REPLICATED else 2
    partial, away = (2 * one_step, steps, bit, 0), (one_step, steps, 0, bit)
    row = [(0, int(target != REPLICATED), 0, 0)]
    row += [zero if code == target else partial for code in range(_FIRST_PARTIAL, _FIRST_SPLIT)]
    return tuple(row + [away, zero] * ndim)


def _least(floors: list[tuple[int, int]], growth: int, now: int, target: int) -> int:
    """``min over x >= min floor of sum(rate * max(x, floor)) + growth * (target - min(now, x))+``."""
    lowest = min(floor for _, floor in floors)
    best = -1
    for x in (*(floor for _, floor in floors), now, target):
        if x < lowest:
            continue
        value = growth * (target - x if x < now else target - now) if target > min(now, x) else 0
        for rate, floor in floors:
            value += rate * (x if x > floor else floor)
        if best < 0 or value < best:
            best = value
    return best
