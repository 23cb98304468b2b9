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

Per-collective figures (``planner.cost``). ``R`` and ``B`` are then per task: what the
cheapest kind that can do the task costs on the axis, at the least of its regimes' rates
(:func:`kind_rates`; a step is priced by one regime, whose rates are at least those least
ones, whatever its bytes). Rounds: the table's rounds are those of the cheapest way to do
the axis's task, e.g. ``min(2(n-1) R_ar, (n-1)(R_rs + R_ag))`` to reduce an axis to
replicated (an all_reduce, or a reduce_scatter and, later, the all_gather that alone makes
a split axis replicated), ``(n-1) R_ag`` to leave a split for replicated, ``(n-1) min(R_ag,
R_a2a)`` to leave it for another split. Bytes: a reduction is priced at ``min(2 B_ar, B_rs)``
(an all_reduce sends twice the (n-1)E/n that a reduce_scatter sends at least), a move and
the growth at ``min(B_ag, B_a2a)`` (the only kinds that grow a piece or move a split axis);
the facts above hold kind by kind, and in (B) a gather or all_to_all that moves an axis and
grows E pays both parts from its own bytes at its own rate, so the bound stays admissible.

The executor terms (``planner.cost``): the overhead and the choice margin are paid by every
step alike (the pseudo-kind ``step``), so each axis's rounds entry also charges them for the
steps its task needs at least (the table's steps), taking the cheapest way to do the task
with its steps counted (a reduce_scatter and an all_gather pay two overheads, an all_reduce
one). The bytes a collective copies locally are never negative, and the bound leaves them
out. docs/calibration.md, "Exactness and the A* bound", says why each part is a lower bound.
"""

from __future__ import annotations

import math

from planner.cost import STEP, large_key
from planner.space import REPLICATED, role_code
from shardlang.layout import REDUCE_OPS

Terms = tuple[int, int, int, int]


class KindRates:
    """The bound's integer rates for one mesh (its kept axes) and cost model, whatever the pair
    (module docstring): per axis, the units of each task (:func:`_task_units`, from the least
    units per round of each collective kind over its regimes and the units of a step), and the
    units per byte of a reduction (``reduce_byte``) and of a move or growth (``move_byte``).
    Made once per mesh and model (``planner.search`` caches it), so it also keeps the tables it
    derives per axis role and per element size, and the bytes bounds per element size, tensor
    size and target size, which every search of those shares."""

    def __init__(
        self, mesh_shape: tuple[int, ...], per_round: dict[str, tuple[int, ...]], per_byte: dict[str, tuple[int, ...]]
    ) -> None:
        def least(rate: dict[str, tuple[int, ...]], op: str) -> tuple[int, ...]:
            regimes = [rate[k] for k in (op, large_key(op)) if k in rate]
            return tuple(min(values) for values in zip(*regimes, strict=True))

        kinds = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
        rounds = [least(per_round, op) for op in kinds]
        gather, scatter, reduce, to_all = (least(per_byte, op) for op in kinds)
        self.mesh_shape = mesh_shape
        self.per_step = per_round[STEP][0] if STEP in per_round else 0
        self.tasks = tuple(_task_units(n, *(r[a] for r in rounds), self.per_step) for a, n in enumerate(mesh_shape))
        self.reduce_byte = tuple(min(2 * r, s) for r, s in zip(reduce, scatter, strict=True))
        self.move_byte = tuple(min(g, t) for g, t in zip(gather, to_all, strict=True))
        self._terms: dict[tuple[int, int, int], tuple[Terms, ...]] = {}
        self._bytes: dict[int, tuple[int, int, int, tuple[int, ...], tuple[int, ...], int, tuple[int, ...]]] = {}
        self._bytes_bounds: dict[tuple[int, int, int], BytesBound] = {}

    def axis_terms(self, axis: int, target: int, ndim: int) -> tuple[Terms, ...]:
        """The terms of ``axis`` by role code, for the target role ``target`` (:func:`_axis_terms`)."""
        key = (axis, target, ndim)
        found = self._terms.get(key)
        if found is None:
            found = self._terms[key] = _axis_terms(self.tasks[axis], 1 << axis, target, ndim)
        return found

    def byte_rates(self, itemsize: int) -> tuple[int, int, int, tuple[int, ...], tuple[int, ...], int, tuple[int, ...]]:
        """:func:`_mesh_rates` for ``itemsize``."""
        found = self._bytes.get(itemsize)
        if found is None:
            found = self._bytes[itemsize] = _mesh_rates(self.mesh_shape, itemsize, self.reduce_byte, self.move_byte)
        return found

    def bytes_bound(self, itemsize: int, total_elements: int, target_elements: int) -> BytesBound:
        """The :class:`BytesBound` of a tensor of ``total_elements`` whose target holds
        ``target_elements`` per rank. It depends on no axis's role, so its memos serve every
        search of those sizes (a process plans many pairs of few sizes); cleared when full."""
        key = (itemsize, total_elements, target_elements)
        found = self._bytes_bounds.get(key)
        if found is None:
            if len(self._bytes_bounds) >= 1024:
                self._bytes_bounds.clear()
            rates = self.byte_rates(itemsize)
            found = self._bytes_bounds[key] = BytesBound(self.mesh_shape, rates, total_elements, target_elements)
        return found


def kind_rates(
    mesh_shape: tuple[int, ...], per_round: dict[str, tuple[int, ...]], per_byte: dict[str, tuple[int, ...]]
) -> KindRates:
    """The :class:`KindRates` of a mesh of ``mesh_shape`` from the search's integer rates per
    kind (``planner.units.integer_op_rates`` of :meth:`CostModel.figures`)."""
    return KindRates(mesh_shape, per_round, per_byte)


class LowerBound:
    """Lower bounds for one search.

    ``terms[axis][role]`` is (units, steps, reduce bit, move bit): the rounds' and steps' units
    and the steps the axis still needs at least in that role, and ``1 << axis`` if it must
    still reduce (must still move). A state's bound is the sum of its axes' units plus the
    bytes bound of its size and the summed reduce and move bits (``bytes``, shared by the
    searches of one mesh, model and sizes: :meth:`KindRates.bytes_bound`).
    """

    def __init__(
        self,
        itemsize: int,
        ndim: int,
        rates: KindRates,
        target_roles: tuple[int, ...],
        target_elements: int,
        total_elements: int,
    ) -> None:
        self.terms = tuple(rates.axis_terms(a, target, ndim) for a, target in enumerate(target_roles))
        self.bytes = rates.bytes_bound(itemsize, total_elements, target_elements)

    def state_terms(self, roles: tuple[int, ...]) -> Terms:
        """The terms of a state whose axes have the role codes ``roles``, summed."""
        rows = [self.terms[a][role] for a, role in enumerate(roles)]
        return sum(r[0] for r in rows), sum(r[1] for r in rows), sum(r[2] for r in rows), sum(r[3] for r in rows)

    def quick_bytes_bound(self, elements: int, reduce_mask: int) -> int:
        """:meth:`BytesBound.quick_bytes_bound`."""
        return self.bytes.quick_bytes_bound(elements, reduce_mask)

    def bytes_bound(self, elements: int, reduce_mask: int, move_mask: int) -> int:
        """:meth:`BytesBound.bytes_bound`."""
        return self.bytes.bytes_bound(elements, reduce_mask, move_mask)


class BytesBound:
    """The bytes part of the bound, (A) and (B) (module docstring), of a tensor of ``total``
    elements whose target holds ``target`` per rank, on one mesh and cost model (``rates``:
    :func:`_mesh_rates`), memoized."""

    def __init__(
        self,
        mesh_shape: tuple[int, ...],
        rates: tuple[int, int, int, tuple[int, ...], tuple[int, ...], int, tuple[int, ...]],
        total: int,
        target: int,
    ) -> None:
        self.mesh_shape = mesh_shape
        self.total = total
        self.target = target
        self.size, self.scale, self.growth, self.reduce_rate, self.move_rate, self.moving_growth, self.reduce_order = (
            rates
        )
        self.ordered: dict[int, int] = {}  # reduce mask -> the reductions' part of (A)
        self._floors: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._moving: dict[tuple[int, int, int], int] = {}

    def quick_bytes_bound(self, elements: int, reduce_mask: int) -> int:
        """(A): the growth to the target and the reductions in their cheapest order."""
        growth = self.growth * max(0, self.target - elements)
        if not reduce_mask:
            return growth
        ordered = self.ordered.get(reduce_mask)
        if ordered is None:
            ordered, partial_sizes = 0, 1
            for a in reversed(self.reduce_order):
                if reduce_mask >> a & 1:
                    partial_sizes *= self.mesh_shape[a]
                    ordered += self.reduce_rate[a] * self.total * partial_sizes
            ordered = self.ordered[reduce_mask] = ordered // self.scale
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
        """(rate, least size), scaled, of every axis in ``mask``: a reduction's rate and size
        floor for the axes in ``reduce_mask``, a move's for the others."""
        return [
            (self.reduce_rate[a], self.total * self.mesh_shape[a])
            if reduce_mask >> a & 1
            else (self.move_rate[a], self.total)
            for a in range(len(self.mesh_shape))
            if mask >> a & 1
        ]


def _mesh_rates(
    mesh_shape: tuple[int, ...], itemsize: int, reduce_byte: tuple[int, ...], move_byte: tuple[int, ...]
) -> tuple[int, int, int, tuple[int, ...], tuple[int, ...], int, tuple[int, ...]]:
    """What the bytes bounds need of a mesh and cost model, whatever the pair: (mesh size,
    scale, growth rate, per-axis reduction and move rates, moving growth rate, axes in
    reduction order)."""
    size = math.prod(mesh_shape)
    growth = itemsize * min((b for n, b in zip(mesh_shape, move_byte, strict=True) if n > 1), default=0)
    # (A) and (B) are computed scaled by q * mesh size, so that the rates (n-1)/n and the
    # floors T * n / N are integers, then divided back, rounding down.
    q = math.lcm(*mesh_shape)

    def rates(per_byte: tuple[int, ...]) -> tuple[int, ...]:
        return tuple((n - 1) * itemsize * b * (q // n) for n, b in zip(mesh_shape, per_byte, strict=True))

    reduce_rate, move_rate = rates(reduce_byte), rates(move_byte)
    moving_growth = min((r for n, r in zip(mesh_shape, move_rate, strict=True) if n > 1), default=0)
    reduce_order = tuple(sorted(range(len(mesh_shape)), key=lambda a: (reduce_byte[a], a)))
    return size, q * size, growth, reduce_rate, move_rate, moving_growth, reduce_order


_FIRST_PARTIAL = role_code("P", "sum")
_FIRST_SPLIT = role_code("S", 0)


def _task_units(
    n: int, gather: int, scatter: int, reduce: int, to_all: int, step: int
) -> tuple[int, int, int, int, int, int]:
    """The units of each task on an axis of size ``n`` whose kinds cost ``gather``, ``scatter``,
    ``reduce`` and ``to_all`` units a round and every step ``step``, each task the cheapest way
    to do it with every step's overhead and margin counted (module docstring): (reduce into a
    split, reduce to replicated, leave a split for another, leave a split and come back to it,
    leave a split for replicated, one local step)."""
    gather, scatter, reduce, to_all = (n - 1) * gather, (n - 1) * scatter, 2 * (n - 1) * reduce, (n - 1) * to_all
    return (
        min(scatter + step, reduce + 2 * step),  # reduce_scatter, or all_reduce then slice
        min(reduce + step, scatter + gather + 2 * step),  # all_reduce, or reduce_scatter then all_gather
        min(to_all + step, gather + 2 * step),  # all_to_all, or all_gather then slice
        2 * step + min(gather, 2 * to_all),  # all_gather then slice, or two all_to_alls
        gather + step,  # only an all_gather makes a split axis replicated
        step,
    )


def _axis_terms(units: tuple[int, int, int, int, int, int], bit: int, target: int, ndim: int) -> tuple[Terms, ...]:
    """The terms of one axis, indexed by role code (the table above); ``units`` are the axis's
    task units (:func:`_task_units`)."""
    into_split, reduced, away, back, gathered, step = units
    zero = (0, 0, 0, 0)
    if target >= _FIRST_SPLIT:
        # Replicated: slice. Partial: reduce_scatter. Split out of place: leave; leave and come
        # back to the same dim.
        row = [(step, 1, 0, 0), *[(into_split, 1, bit, 0)] * len(REDUCE_OPS)]
        for dim in range(ndim):
            row += ((back, 2, 0, bit) if target == _FIRST_SPLIT + 2 * dim + 1 else (away, 1, 0, bit), zero)
        return tuple(row)
    # Replicated or partial target. Partial with another op: reduce, then for a partial target
    # the partial step. Split: leave by an all_gather (then the partial step).
    extra = 0 if target == REPLICATED else 1
    row = [(extra * step, extra, 0, 0)]
    partial = (reduced + extra * step, 1 + extra, bit, 0)
    row += [zero if code == target else partial for code in range(_FIRST_PARTIAL, _FIRST_SPLIT)]
    return tuple(row + [(gathered + extra * step, 1 + extra, 0, bit), zero] * ndim)


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
