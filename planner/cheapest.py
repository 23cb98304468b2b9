"""``planner.plan``: collectives, point-to-point steps, or a mix of both.

Two layouts on one mesh get the baseline move set by default: the cheapest sequence of
collectives over one mesh axis at a time (``planner.search``, exact in that move set; the shared
conformance data is its optimum). With ``point_to_point=True``, and always for layouts on
different meshes (no collective joins two meshes), the plan is the cheapest of these candidates,
compared by (time, steps, candidate order) in the exact integer units of ``planner.p2p.Links``:

1. the collective plan (one mesh only);
2. mixes ``collectives on the source mesh -> one point-to-point step -> collectives on the
   target mesh`` through two intermediate layouts, neither partial (the state around a
   point-to-point step never is): ``M`` on the source mesh and ``M'`` on the target mesh.

   - ``M``: the source with every pending reduction resolved, each partial axis either dropped
     (all_reduce) or appended as the innermost split of a dim (reduce_scatter); the source
     itself when it is not partial.
   - ``M'``: the target without its pending reductions, or with some of its axes that split no
     dim appended, in ascending order, as the innermost splits of one dim. The point-to-point
     step then fills thinner pieces and all_gathers on the target mesh fan them out, which
     beats messages when few ranks hold a block that many need.

   Axes are appended only to the dims that the layout across the step splits (so pieces line
   up with it) and to the longest dim (the most even pieces), which bounds the candidates.

   The legs ``src -> M`` and ``M' -> dst`` are exact cheapest collective plans (a partial
   target's leg ends in local ``partial`` steps). Pairs are priced lazily, cheapest bound
   first: the legs' time, then plus a lower bound on the step (``planner.p2p.time_lower_bound``),
   then exactly; pairs whose bound is no better than the best exact price are never priced.

The collective legs are exact; the set of intermediate layouts is a choice (the plan is the
cheapest among these candidates, not over every possible mix). ``max_local_bytes`` bounds every
state, intermediate layouts included. Results are memoized on all arguments.

Budget: one ``max_states`` (``planner.search``) covers the whole request. Each collective leg
charges the states its search generated, each candidate one more, and pricing a
point-to-point step charges ``planner.p2p.pricing_states`` (its arrays: the ranks holding a piece
on either side, a pattern-valued step's transfers) and making its list ``exchange_states`` (one
per transfer), both counted before anything is built.
The request ends in a :class:`PlanBudgetError` as soon as the charges pass ``max_states``;
charges depend only on the request, so every process agrees.
"""

from __future__ import annotations

import functools
import heapq
import itertools

import attrs

from planner.cost import COPY, STEP, CostModel, collective_rounds, priced_as
from planner.errors import PlanBudgetError, PlanError
from planner.p2p import Links, PlannedExchange, exchange_states, pricing_states, time_lower_bound
from planner.plans import Plan
from planner.search import DEFAULT_MAX_STATES, Request, budget_error, checked, collective_outcome
from planner.units import OpUnits
from shardlang.dtypes import itemsize as dtype_itemsize
from shardlang.layout import Layout


def plan(
    src: Layout,
    dst: Layout,
    shape: tuple[int, ...] | list[int],
    dtype: str = "f32",
    cost: CostModel | None = None,
    *,
    max_local_bytes: int | None = None,
    point_to_point: bool = False,
    max_states: int = DEFAULT_MAX_STATES,
) -> Plan:
    """The cheapest plan from ``src`` to ``dst`` for a tensor of ``shape`` and ``dtype``.

    Layouts on one mesh: the cheapest collective plan (the baseline move set), or with
    ``point_to_point=True`` the cheapest of collective, point-to-point and mixed plans. Layouts
    on different meshes (another shape or rank set, overlapping or disjoint): always the latter
    without the collective plan. Among equally cheap plans, one with the fewest steps.

    With ``max_local_bytes``, the cheapest plan whose every state (source and target
    included) holds at most that many bytes per rank; a :class:`PlanError` when none does.
    A request whose search would generate more than ``max_states`` states (module docstring)
    raises :class:`PlanBudgetError` instead.
    """
    request = checked(src, dst, shape, dtype, cost, max_local_bytes, max_states)
    one_mesh = src.mesh.same_geometry(dst.mesh)
    found = collective_outcome(request)[0] if one_mesh and not point_to_point else _cheapest(request)
    if isinstance(found, PlanError):
        raise found
    return found


class _Budget:
    """The states a request may still charge (module docstring); :class:`PlanBudgetError`
    once its charges pass its ``max_states``."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.spent = 0

    def charge(self, states: int, what: str) -> None:
        self.spent += states
        r = self.request
        if self.spent > r.max_states:
            raise budget_error(r.src, r.dst, r.shape, r.max_states, what)


def candidate_counts(src: Layout, dst: Layout, shape: tuple[int, ...]) -> tuple[int, int]:
    """How many layouts :func:`source_resolutions` and :func:`target_fillings` give, without
    making them."""
    resolutions = 1
    if src.partial:
        joins = len(joinable_dims(dst, shape))
        for a, _ in src.partial:
            resolutions *= 1 if src.mesh.shape[a] == 1 else 1 + joins
    free = sum(1 for a in range(dst.mesh.ndim) if dst.dim_of_axis(a) is None and dst.mesh.shape[a] > 1)
    return resolutions, 1 + ((1 << free) - 1) * len(joinable_dims(src, shape))


def joinable_dims(across: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The dims an intermediate layout appends axes to: the dims that ``across``, the layout on
    the other side of the point-to-point step, splits (pieces that line up with it cross in
    fewer, larger messages) and the longest dim (the most even pieces)."""
    longest = max(range(len(shape)), key=lambda d: (shape[d], -d)) if shape else None
    return tuple(sorted({d for d, axes in enumerate(across.dims) if axes} | ({longest} - {None})))


def source_resolutions(src: Layout, dst: Layout, shape: tuple[int, ...]) -> tuple[Layout, ...]:
    """The layouts ``M`` (module docstring): every way to resolve the source's pending reductions."""
    if not src.partial:
        return (src,)
    mesh = src.mesh
    dims_to_join = joinable_dims(dst, shape)
    choices = [(None,) if mesh.shape[a] == 1 else (None, *dims_to_join) for a, _ in src.partial]
    out = []
    for placement in itertools.product(*choices):
        dims = [list(axes) for axes in src.dims]
        for (axis, _), d in zip(src.partial, placement, strict=True):
            if d is not None:
                dims[d].append(axis)
        out.append(Layout(dims=dims, mesh=mesh))
    return tuple(out)


def target_fillings(dst: Layout, src: Layout, shape: tuple[int, ...]) -> tuple[Layout, ...]:
    """The layouts ``M'`` (module docstring): the target without pending reductions, then with
    every nonempty set of its non-splitting axes (size > 1) appended to one dim."""
    mesh = dst.mesh
    filled = Layout(dims=dst.dims, mesh=mesh)
    free = [a for a in range(mesh.ndim) if dst.dim_of_axis(a) is None and mesh.shape[a] > 1]
    dims_to_join = joinable_dims(src, shape)
    out = [filled]
    for count in range(1, len(free) + 1):
        for axes in itertools.combinations(free, count):
            for d in dims_to_join:
                dims = [list(x) for x in dst.dims]
                dims[d].extend(axes)
                out.append(Layout(dims=dims, mesh=mesh))
    return tuple(out)


@attrs.frozen
class _Mix:
    """A mixed candidate: the leg ``src -> M``, the leg ``M' -> dst``, their time in units, and
    once priced, the point-to-point exchange ``M -> M'``."""

    before: Plan
    after: Plan
    legs_units: int
    exchange: PlannedExchange | None = None


def _leg(src: Layout, dst: Layout, budget: _Budget) -> Plan | None:
    """The cheapest collective plan of the budget's request between ``src`` and ``dst``, or
    ``None`` when none keeps within its ``max_local_bytes``; its search's states (at least one)
    charged to ``budget``."""
    try:
        found, states = collective_outcome(budget.request.between(src, dst))
    except PlanError:  # an end that does not fit in max_local_bytes
        found, states = None, 1
    budget.charge(max(states, 1), f"the collective leg {src} -> {dst}")
    if isinstance(found, PlanBudgetError):  # charged more than the budget above already
        raise found
    return found if isinstance(found, Plan) else None


def _units(leg: Plan, rates: OpUnits) -> int:
    """The leg's time in the search's units: its steps' rounds, bytes, overheads, margins and copies."""
    per_round, per_byte = rates
    shape = leg.src.mesh.shape
    large_from = leg.cost.large_from(leg.src.mesh)
    copied = sum(leg.copied_bytes()) * per_byte[COPY][0] if COPY in per_byte else 0
    kinds = [priced_as(s.op, s.axis, s.bytes, large_from) for s in leg.steps]
    return (
        sum(
            collective_rounds(s.op, shape[s.axis]) * per_round[kind][s.axis] + s.bytes * per_byte[kind][s.axis]
            for s, kind in zip(leg.steps, kinds, strict=True)
        )
        + len(leg.steps) * per_round[STEP][0]
        + copied
    )


@functools.lru_cache(maxsize=4096)
def _cheapest(request: Request) -> Plan | PlanError:
    """The cheapest candidate, or the error that says why there is none (kept in the memo too,
    so a request over its budget is refused at once the next time)."""
    try:
        return _cheapest_within(_Budget(request))
    except PlanError as e:
        return e


def _cheapest_within(budget: _Budget) -> Plan:
    """The cheapest candidate of the budget's request (module docstring), charged to it."""
    request = budget.request
    src, dst, shape, dtype, cost = request.src, request.dst, request.shape, request.dtype, request.cost
    budget.charge(sum(candidate_counts(src, dst, shape)), "listing the intermediate layouts")
    links = Links(cost, src.mesh, dst.mesh)
    one_mesh = src.mesh.same_geometry(dst.mesh)
    itemsize = dtype_itemsize(dtype)
    # Candidates are refined lazily, cheapest bound first (as A* does). An entry is (bound on
    # time units, steps, order, stage, candidate): a mix enters with the time of its legs
    # (stage 0), then gets the point-to-point lower bound added (1), then is priced exactly
    # (2). The first exact entry out of the queue is the cheapest by (time, steps, order).
    queue: list[tuple[int, int, int, int, Plan | _Mix]] = []
    if one_mesh:
        whole = _leg(src, dst, budget)
        if whole is not None:
            queue.append((_units(whole, links.src_rates), len(whole.steps), 0, 2, whole))
    befores = [(leg, _units(leg, links.src_rates)) for m in source_resolutions(src, dst, shape)
               if (leg := _leg(src, m, budget)) is not None]  # fmt: skip
    afters = [(leg, _units(leg, links.dst_rates)) for m in target_fillings(dst, src, shape)
              if (leg := _leg(m, dst, budget)) is not None]  # fmt: skip
    budget.charge(len(befores) * len(afters), "pairing the intermediate layouts")
    for order, ((before, b_units), (after, a_units)) in enumerate(itertools.product(befores, afters), start=1):
        if one_mesh and before.dst.dims == after.src.dims:
            continue  # the step would only copy locally: the collective plan through it is never worse
        steps = len(before.steps) + 1 + len(after.steps)
        queue.append((b_units + a_units, steps, order, 0, _Mix(before, after, b_units + a_units)))
    heapq.heapify(queue)
    while queue:
        units, steps, order, stage, candidate = heapq.heappop(queue)
        if stage == 2:
            break
        mix: _Mix = candidate  # type: ignore[assignment]
        if stage == 0:
            states = pricing_states(mix.before.dst, mix.after.src, shape)
            budget.charge(states, f"pricing the point-to-point step {mix.before.dst} -> {mix.after.src}")
            units += time_lower_bound(mix.before.dst, mix.after.src, shape, itemsize, links)
        else:
            budget.charge(
                exchange_states(mix.before.dst, mix.after.src, shape),
                f"the messages of the point-to-point step {mix.before.dst} -> {mix.after.src}",
            )
            mix = attrs.evolve(mix, exchange=PlannedExchange(mix.before.dst, mix.after.src, shape, itemsize, links))
            units = mix.legs_units + mix.exchange.units
        heapq.heappush(queue, (units, steps, order, stage + 1, mix))
    else:
        limit = request.max_local_bytes
        within = f" within max_local_bytes={limit}" if limit is not None else ""
        raise PlanError(f"no plan takes {src} to {dst}{within}")
    return _assembled(request, candidate)


def _assembled(request: Request, candidate: Plan | _Mix) -> Plan:
    if isinstance(candidate, Plan):
        steps = candidate.steps
    else:
        steps = (*candidate.before.steps, candidate.exchange.step(), *candidate.after.steps)
    r = request
    return Plan(src=r.src, dst=r.dst, shape=r.shape, dtype=r.dtype, steps=steps, cost=r.cost)
