"""A BASELINE FOR DISPLAY, NOT A PLANNER: the one-mesh-axis-at-a-time order of DTensor's
default (greedy) redistribute planner, written in shardlang layouts, so that ``shardlang
explain`` can show what the exact planner saves over it.

The rule it follows (torch's ``generate_greedy_transform_infos``, default device order):
every mesh axis goes straight from its source placement to its target placement.

1. If the source is split at all, walk the mesh axes inner to outer (last axis first). An
   axis whose target splits tensor dim ``d`` while the axes before it split ``d`` differently
   now than in the target is replicated instead (its split cannot stay under a misaligned
   outer split); every other axis goes straight to its target.
2. Walk the mesh axes outer to inner and take every axis not yet at its target there.

A placement change is one collective: S->R all_gather, S(d)->S(j) all_to_all, P->R
all_reduce, P->S reduce_scatter, R->S slice, R->P partial; S->P and P->P' (DTensor rejects
both) go through R. DTensor nests the splits of a dim in mesh-axis order, so the baseline
exists only for such layouts (``S01``, not ``S10``); for the others DTensor itself switches to
its graph planner.

Each step is costed under the planner's cost model: the planner plans the same placement
change alone, on a one-axis mesh over the block of the tensor that the step's collective
works on, so the cost is that of the collective and nothing else. On that mesh every other
collective kind is priced out of reach (:data:`OUT_OF_REACH`): with per-collective figures the
planner's cheapest way through one change can be two collectives (a reduce_scatter and an
all_gather for an all_reduce), and DTensor runs the one.
"""

from __future__ import annotations

import math

from planner import CostModel, OpCost, Plan, Step
from planner import plan as plan_exact
from planner.cost import LOCAL_OPS, PRICED_OPS
from shardlang import Layout, Mesh
from shardlang.layout import reduce_ops_commute

# A mesh axis' placement: ("S", dim), ("R",) or ("P", reduce_op).
Placement = tuple
OUT_OF_REACH = 1e6  # seconds per round of the kinds a step does not run (module docstring)


class NoGreedyOrder(Exception):
    """The baseline has no answer for these layouts (the message says why)."""


def placement(layout: Layout, axis: int) -> Placement:
    dim = layout.dim_of_axis(axis)
    if dim is not None:
        return ("S", dim)
    op = layout.partial_ops.get(axis)
    return ("P", op) if op is not None else ("R",)


def greedy_order(src: Layout, dst: Layout) -> list[tuple[int, Placement]]:
    """The (mesh axis, new placement) changes the greedy rule makes, in order."""
    for name, layout in (("source", src), ("target", dst)):
        for d, axes in enumerate(layout.dims):
            if list(axes) != sorted(axes):
                raise NoGreedyOrder(
                    f"the {name} nests dim {d} out of mesh-axis order ({layout}); DTensor's default "
                    "planner cannot express that (DTensor uses its graph planner there)"
                )
    n = src.mesh.ndim
    current = [placement(src, a) for a in range(n)]
    target = [placement(dst, a) for a in range(n)]
    changes: list[tuple[int, Placement]] = []
    split_ways = math.prod(src.mesh.shape[a] for axes in src.dims for a in axes)
    if split_ways > 1:
        for a in reversed(range(n)):
            want = target[a]
            if want[0] == "S":
                before_now = [i for i in range(a) if current[i] == want]
                before_target = [i for i in range(a) if target[i] == want]
                if before_now != before_target:
                    want = ("R",)
            if current[a] != want:
                changes.append((a, want))
                current[a] = want
    for a in range(n):
        if current[a] != target[a]:
            changes.append((a, target[a]))
            current[a] = target[a]
    return changes


def greedy_plan(
    src: Layout, dst: Layout, shape: tuple[int, ...], dtype: str = "f32", cost: CostModel | None = None
) -> Plan:
    """What the greedy order does and costs, as a :class:`planner.Plan`."""
    cost = cost or CostModel()
    src.check_shape(shape)
    steps: list[Step] = []
    state = src
    for axis, want in greedy_order(src, dst):
        have = placement(state, axis)
        if have[0] != "R" and want[0] == "P":  # DTensor rejects S->P and P->P'; go through R.
            state = _take(state, axis, ("R",), shape, dtype, cost, steps)
        state = _take(state, axis, want, shape, dtype, cost, steps)
    if state != dst:
        raise NoGreedyOrder(f"the greedy order ends in {state}, not in {dst}")
    return Plan(src=src, dst=dst, shape=shape, dtype=dtype, steps=tuple(steps), cost=cost)


def _take(
    state: Layout, axis: int, want: Placement, shape: tuple[int, ...], dtype: str, cost: CostModel, steps: list[Step]
) -> Layout:
    """Append the step that moves ``axis`` of ``state`` to ``want``; return the new state."""
    have = placement(state, axis)
    label = state.mesh.axis_label(axis)
    dims = [list(axes) for axes in state.dims]
    partial = dict(state.partial)
    if have[0] == "S":
        if dims[have[1]][-1] != axis:
            raise NoGreedyOrder(f"the greedy order moves axis {label} while it is not the innermost split of {state}")
        dims[have[1]].pop()
    elif have[0] == "P":
        blocking = [b for b, op in state.partial if b < axis and not reduce_ops_commute(op, have[1])]
        if blocking:
            raise NoGreedyOrder(
                f"the greedy order reduces axis {label} ({have[1]}) before axis "
                f"{state.mesh.axis_label(blocking[0])}, but {state} reduces in mesh-axis order"
            )
        del partial[axis]
    if want[0] == "S":
        if dims[want[1]] and dims[want[1]][-1] > axis:
            raise NoGreedyOrder(f"the greedy order splits dim {want[1]} over axis {label} outside of an inner split")
        dims[want[1]].append(axis)
    elif want[0] == "P":
        partial[axis] = want[1]
    after = Layout(dims=dims, mesh=state.mesh, partial=partial)
    op = {
        ("S", "R"): "all_gather",
        ("S", "S"): "all_to_all",
        ("P", "R"): "all_reduce",
        ("P", "S"): "reduce_scatter",
        ("R", "S"): "slice",
        ("R", "P"): "partial",
    }[(have[0], want[0])]
    nbytes, seconds = _step_cost(state, after, axis, op, shape, dtype, cost)
    steps.append(
        Step(
            op=op,
            axis=axis,
            dim=have[1] if have[0] == "S" else (want[1] if want[0] == "S" else None),
            to_dim=want[1] if op == "all_to_all" else None,
            reduce_op=have[1] if have[0] == "P" else (want[1] if want[0] == "P" else None),
            layout=after,
            bytes=nbytes,
            seconds=seconds,
        )
    )
    return after


def _step_cost(
    state: Layout, after: Layout, axis: int, op: str, shape: tuple[int, ...], dtype: str, cost: CostModel
) -> tuple[int, float]:
    """Bytes and seconds of changing only ``axis`` with ``op``: the planner's plan for that
    change on a one-axis mesh, over the rank's block of the tensor with ``axis`` taken out, where
    the other collective kinds are out of reach."""
    block = Layout(dims=[[a for a in axes if a != axis] for axes in state.dims], mesh=state.mesh).local_shape(shape)
    line = Mesh(shape=(state.mesh.shape[axis],))

    def on_line(layout: Layout) -> Layout:
        op = layout.partial_ops.get(axis)
        return Layout(
            dims=[(0,) if axis in axes else () for axes in layout.dims],
            mesh=line,
            partial=[(0, op)] if op is not None else [],
        )

    alphas, betas = cost.for_mesh(state.mesh)
    ops = [
        cost.on_axis(kind, state.mesh, axis) if kind == op else OpCost(kind, OUT_OF_REACH, betas[axis])
        for kind in PRICED_OPS
    ]
    # The executor terms and the margin too, so the step is priced and chosen as the planner's are.
    line_cost = CostModel(
        alpha=alphas[axis],
        bandwidth=betas[axis],
        ops=ops,
        overhead=cost.overhead,
        copy_bandwidth=cost.copy_bandwidth,
        margin=cost.margin,
    )
    alone = plan_exact(on_line(state), on_line(after), block, dtype, line_cost)
    if [s.op for s in alone.steps if s.op not in LOCAL_OPS] not in ([], [op]):
        raise NoGreedyOrder(f"the greedy order's {op} of {state} -> {after} is no one collective here ({alone})")
    return alone.total_bytes, alone.total_seconds
