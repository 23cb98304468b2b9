"""Plans as text tables and as JSON (the keys of ``PLAN_KEYS``, with the receive lower bound
and, for point-to-point steps, their transfers; docs/reference/cli.md)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any, TextIO, TypeVar

from cli.buckets import bucket_cap_warnings, format_buckets
from cli.messages import describe_messages
from cli.summary import TensorGroup, group_tensors, largest_first
from cli.tables import format_bytes, format_seconds, format_table, total_row
from cli.terminal import Style
from planner import COMMUNICATING_OPS, CostModel, Plan, Step
from planner.errors import PlanBudgetError, PlanError
from planner.messages import step_messages
from planner.spec_plan import SpecPlan, TensorPlans
from shardlang import Layout, Mesh
from shardlang.spec import STATE_DEFAULT

T = TypeVar("T")

# The JSON of one plan: the keys every plan has, the receive lower bound last (Plan.to_json adds more).
PLAN_KEYS = ("src", "dst", "shape", "dtype", "steps", "total_bytes", "total_seconds", "lower_bound_bytes")


def plan_json(plan: Plan) -> dict[str, Any]:
    """The keys of :data:`PLAN_KEYS`, as ``Plan.to_json`` writes them."""
    return {
        "src": str(plan.src),
        "dst": str(plan.dst),
        "shape": list(plan.shape),
        "dtype": plan.dtype,
        "steps": [s.to_json() for s in plan.steps],
        "total_bytes": plan.total_bytes,
        "total_seconds": plan.total_seconds,
        "lower_bound_bytes": plan.lower_bound_bytes,
    }


def tensor_json(tp: TensorPlans) -> dict[str, Any]:
    t = tp.tensor
    return {
        "name": t.name,
        "shape": list(t.shape),
        "dtype": t.dtype,
        "legs": [{"leg": label, **plan_json(plan)} for label, plan in tp.plans()],
        "total_bytes": tp.total_bytes,
        "total_seconds": tp.total_seconds,
    }


def spec_plan_json(spec_plan: SpecPlan) -> dict[str, Any]:
    spec = spec_plan.spec
    return {
        "file": spec.filename,
        "meshes": {d.mesh.name: d.mesh.text() for d in spec.meshes},
        "tensors": [tensor_json(tp) for tp in spec_plan.tensors],
        "total_bytes": spec_plan.total_bytes,
        "total_seconds": spec_plan.total_seconds,
        "step": spec_plan.step.to_json(),
        "warnings": padding_warnings(spec_plan) + bucket_cap_warnings(spec_plan),
    }


def describe_cost(cost: CostModel, mesh: Mesh) -> str:
    """``axis dp: 25 GB/s, 10 us; axis tp: 300 GB/s, 2 us``, or one clause when all axes agree;
    then each collective kind with figures of its own (``all_reduce: every axis: ...``)."""
    text = _describe_figures(*cost.for_mesh(mesh), mesh)
    for c in cost.ops:
        text += f"; {c.op}: {_describe_figures(*cost.for_op(c.op, mesh), mesh, ', ')}"
        if c.large is not None:
            text += f"; {c.op}, large messages: {_describe_large(cost, c.op, mesh)}"
    return text


def _describe_large(cost: CostModel, op: str, mesh: Mesh) -> str:
    """``every axis: from 4 MiB, 0.5 GB/s, 1 ms per round``, or one clause per axis."""
    per_axis = []
    for axis in range(mesh.ndim):
        large = cost.on_axis(op, mesh, axis).large
        assert large is not None and isinstance(large.alpha, float) and isinstance(large.bandwidth, float)
        rate = f"{large.bandwidth / 1e9:g} GB/s, {format_seconds(large.alpha)} per round"
        per_axis.append(f"from {format_bytes(large.from_bytes)}, {rate}")  # type: ignore[arg-type]
    if len(set(per_axis)) == 1:
        return f"every axis: {per_axis[0]}"
    return ", ".join(f"axis {mesh.axis_label(i)}: {text}" for i, text in enumerate(per_axis))


def _describe_figures(alphas: tuple[float, ...], betas: tuple[float, ...], mesh: Mesh, between: str = "; ") -> str:
    per_axis = [f"{b / 1e9:g} GB/s, {format_seconds(a)} per round" for a, b in zip(alphas, betas, strict=True)]
    if len(set(per_axis)) == 1:
        return f"every axis: {per_axis[0]}"
    return between.join(f"axis {mesh.axis_label(i)}: {text}" for i, text in enumerate(per_axis))


def describe_plan_cost(plan: Plan) -> str:
    """The cost model of a plan: of its mesh, or of both meshes and the messages between them."""
    src, dst = plan.src.mesh, plan.dst.mesh
    if src.same_geometry(dst):
        return describe_cost(plan.cost, dst)
    # Messages between the meshes take the point-to-point figures (planner.p2p).
    rates = [plan.cost.for_op("point_to_point", mesh) for mesh in (src, dst)]
    alphas = {a for per_axis, _ in rates for a in per_axis}
    bandwidths = {b for _, per_axis in rates for b in per_axis}
    alpha, bandwidth = max(alphas), min(bandwidths)
    if len(alphas) == len(bandwidths) == 1 and not plan.cost.ops:
        return f"both meshes, every axis and message: {bandwidth / 1e9:g} GB/s, {format_seconds(alpha)} per round"
    return (
        f"source {src.describe()}: {describe_cost(plan.cost, src)}; target {dst.describe()}: "
        f"{describe_cost(plan.cost, dst)}; between the meshes the slowest of both: "
        f"{bandwidth / 1e9:g} GB/s, {format_seconds(alpha)} per message"
    )


def axis_text(step: Step) -> str:
    """The step's mesh axis as its own mesh names it; ``-`` for a point-to-point step."""
    return "-" if step.axis is None else step.layout.mesh.axis_label(step.axis)


def op_text(step: Step, style: Style) -> str:
    return style(step.op, "cyan") if step.op in COMMUNICATING_OPS else style(step.op, "dim")


def _dim_text(step: Step) -> str:
    if step.dim is None:
        return "-"
    return f"{step.dim}->{step.to_dim}" if step.to_dim is not None else str(step.dim)


def steps_table(plan: Plan, style: Style, indent: str = "  ") -> str:
    rows = [
        [
            str(i),
            op_text(s, style),
            axis_text(s),
            _dim_text(s),
            s.reduce_op or "-",
            str(s.layout),
            format_bytes(s.bytes),
            format_seconds(s.seconds),
        ]
        for i, s in enumerate(plan.steps, 1)
    ]
    if not rows:
        return f"{indent}nothing to do: the layouts are equal"
    headers = ["#", "op", "axis", "dim", "reduce", "layout after the step", "bytes/rank", "time"]
    totals = {"op": "total", "bytes/rank": format_bytes(plan.total_bytes), "time": format_seconds(plan.total_seconds)}
    rows.append(total_row(headers, {h: style(t, "bold") for h, t in totals.items()}))
    table = format_table(headers, rows, "><<<<<>>", indent)
    return "\n".join([table, *copy_lines(plan, indent), *message_lines(plan, indent), *margin_lines(plan, indent)])


def margin_lines(plan: Plan, indent: str = "  ") -> list[str]:
    """Under the table, where the model has a choice margin (``planner.cost``): that the plan was
    chosen with it, and that the times leave it out; nothing where it is 0."""
    if not plan.cost.margin:
        return []
    return [
        f"{indent}chosen with a margin of {format_seconds(plan.cost.margin)} a step, not in the times: "
        "a plan of more steps wins only by more than that for each step it adds"
    ]


def copy_lines(plan: Plan, indent: str = "  ") -> list[str]:
    """Under the table, where the model prices local copies: the most bytes a rank copies in
    each step (``Plan.copied_bytes``), which its time includes; nothing where copies are free or
    no step copies."""
    bandwidth = plan.cost.copy_bandwidth
    if bandwidth is None:
        return []
    copied = [(i, b) for i, b in enumerate(plan.copied_bytes(), 1) if b]
    if not copied:
        return []
    each = ", ".join(f"step {i} {format_bytes(b)} ({format_seconds(b / bandwidth)})" for i, b in copied)
    return [f"{indent}local copies at {bandwidth / 1e9:.3g} GB/s, in the steps' times: {each}"]


def message_lines(plan: Plan, indent: str = "  ", most_pairs: int = 12) -> list[str]:
    """Under the table, per point-to-point step: its messages, and who sends whom how much
    (every rank pair when there are few, else the largest)."""
    lines = []
    for i, step in enumerate(plan.steps, 1):
        if step.op != "point_to_point":
            continue
        messages = step_messages(step, plan.dtype)
        lines.append(f"{indent}step {i}: {describe_messages(messages)}")
        largest = sorted(messages.pairs.items(), key=lambda item: (-item[1], item[0]))[:most_pairs]
        for (sender, receiver), nbytes in sorted(largest):
            lines.append(f"{indent}  r{sender} -> r{receiver}  {format_bytes(nbytes)}")
        if len(messages.pairs) > most_pairs:
            lines.append(
                f"{indent}  ({len(messages.pairs) - most_pairs} more rank pairs: the largest are listed; "
                "--format json --expand gives every transfer)"
            )
    return lines


def lower_bound_text(plan: Plan) -> str:
    """The receive lower bound: what the busiest target rank lacks of its target piece."""
    return f"receive lower bound: {format_bytes(plan.lower_bound_bytes)} per rank"


def format_plan(plan: Plan, style: Style, heading: str = "plan") -> str:
    shape = "x".join(map(str, plan.shape)) or "() (a scalar)"
    lines = [
        f"{style(heading, 'bold')}  {plan.src}  ->  {plan.dst}",
        f"  tensor {shape} {plan.dtype}; {lower_bound_text(plan)}; cost model: {describe_plan_cost(plan)}",
        steps_table(plan, style),
    ]
    return "\n".join(lines)


def format_tensor_plans(tp: TensorPlans, style: Style) -> str:
    t = tp.tensor
    out = [
        f"{style(t.name, 'bold')} : {t.dtype}[{', '.join(map(str, t.shape))}]; cost model: "
        f"{describe_cost(tp.cost, t.param.mesh)}"
    ]
    for label, plan in tp.plans():
        # A flat hop plans the rank's block as one dim (README, "Optimizers": flat ZeRO).
        view = "" if plan.shape == t.shape else f"  (on the flat view [{', '.join(map(str, plan.shape))}])"
        out.append(f"\n{style(label, 'bold')}:  {plan.src}  ->  {plan.dst}{view}")
        out.append(steps_table(plan, style))
    out.append(
        f"\n{style('tensor total', 'bold')}: {format_bytes(tp.total_bytes)} sent per rank, "
        f"{format_seconds(tp.total_seconds)} (its plans on their own; buckets share latency)"
    )
    return "\n".join(out)


def leg_ops(plan: Plan) -> str:
    """``reduce_scatter(dp)``, steps joined by ``, ``; ``-`` when there is nothing to do."""
    return ", ".join(f"{s.op}({axis_text(s)})" for s in plan.steps) or "-"


def summary_rows(groups: list[TensorGroup], style: Style) -> list[list[str]]:
    rows = []
    for g in groups:
        tp = g.first
        t = tp.tensor
        legs = "\n".join(f"{label}: {leg_ops(plan)}" for label, plan in tp.plans())
        rows.append(
            [
                g.label,
                str(g.count),
                "x".join(map(str, t.shape)) or "()",
                t.dtype,
                legs,
                format_bytes(g.total_bytes),
                format_seconds(g.total_seconds),
            ]
        )
    return rows


def format_spec_summary(spec_plan: SpecPlan, style: Style) -> str:
    spec = spec_plan.spec
    groups = largest_first(group_tensors(spec_plan))
    n = len(spec_plan.tensors)
    lines = [
        f"{style(spec.filename or 'spec', 'bold')}: one optimizer step, {n} tensor{'s' * (n != 1)} "
        "(largest first; a row with a count sums its tensors; times are each tensor's plans on their own)",
    ]
    # The cost model each mesh was planned with: the spec's hints unless options overrode them.
    for mesh, cost in dict.fromkeys((tp.tensor.param.mesh, tp.cost) for tp in spec_plan.tensors):
        name = f"{mesh.name} = {mesh.describe()}" if mesh.name else mesh.describe()
        lines.append(f"  mesh {name}; cost model: {describe_cost(cost, mesh)}")
    rows = summary_rows(groups, style)
    headers = ["tensor", "count", "shape", "dtype", "plans (op(axis), ...)", "bytes/rank", "time"]
    totals = {
        "tensor": "total",
        "bytes/rank": format_bytes(sum(tp.total_bytes for tp in spec_plan.tensors)),
        "time": format_seconds(sum(tp.total_seconds for tp in spec_plan.tensors)),
    }
    rows.append(total_row(headers, {h: style(t, "bold") for h, t in totals.items()} | {"count": str(n)}))
    lines.append(format_table(headers, rows, "<><<<>>", "  "))
    return "\n".join(lines)


def format_spec_report(
    spec_plan: SpecPlan, style: Style, *, each_tensor: bool = False, flat_axis: str | int | None = None
) -> str:
    """``shardlang plan FILE.shard``: the tensors (a summary, or each tensor's plans), then the
    step's buckets."""
    if each_tensor:
        tensors = "\n\n".join(format_tensor_plans(tp, style) for tp in spec_plan.tensors)
    else:
        tensors = format_spec_summary(spec_plan, style)
    warnings = "".join(f"\n{style(w, 'yellow')}" for w in padding_warnings(spec_plan) + bucket_cap_warnings(spec_plan))
    return f"{tensors}\n\n{format_buckets(spec_plan, style, flat_axis)}" + (f"\n{warnings}" if warnings else "")


def max_states_arg(text: str) -> int:
    """The search budget (``planner.plan``'s ``max_states``): a count of states, at least 1."""
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number of search states") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"'{text}': the search budget is at least 1 state")
    return value


def with_collective_fallback(run: Callable[[bool], T], p2p: bool, note: TextIO) -> T:
    """``run(p2p)``; where ``--p2p`` planning ran past the search budget, ``run(False)``, the
    collective plans (the baseline move set, always within budget on one mesh), with a note on
    ``note`` saying so. Without ``--p2p``, or where the collective plan fails too (a pair on two
    meshes plans point to point either way), the first error stands."""
    try:
        return run(p2p)
    except PlanBudgetError as e:
        if not p2p:
            raise
        try:
            result = run(False)
        except PlanError:
            raise e from None
        print(f"note: --p2p: {e.message}\nnote: planned with collectives instead (as without --p2p)", file=note)
        return result


# --- chunk padding ------------------------------------------------------------------------
# A tensor whose step sends more than this times its data (chunk padding) is warned about,
# when the excess is at least PADDING_FLOOR bytes per rank (less costs under a microsecond at
# 100 GB/s: small tensors' padding is no news).
PADDING_WARNING = 1.25
PADDING_FLOOR = 64 * 2**10


def padding(layout: Layout, shape: tuple[int, ...]) -> float:
    """How much larger the tensor is as its ranks' padded pieces: every dim's largest piece
    times its number of pieces, over the dim (1.0 for no padding; an empty tensor counts 1)."""
    local = layout.local_shape(shape)
    ratio = 1.0
    for d, length in enumerate(shape):
        parts = math.prod(layout.mesh.shape[a] for a in layout.dims[d])
        if length:
            ratio *= local[d] * parts / length
    return ratio


def _step_padding(before: Layout, step: Step, shape: tuple[int, ...]) -> float:
    """The padding of what a collective moves: its pieces are the more padded of its two sides."""
    return max(padding(before, shape), padding(step.layout, shape))


def padded_traffic(tp: TensorPlans) -> tuple[int, float]:
    """The bytes a tensor's step sends per rank, and what they carry of the tensor's data (each
    collective's bytes over its pieces' padding; point-to-point steps send no padding)."""
    sent, data = 0, 0.0
    for _, plan in tp.plans():
        before = plan.src
        for step in plan.steps:
            if step.op in COMMUNICATING_OPS and step.bytes:
                sent += step.bytes
                ratio = 1.0 if step.axis is None else _step_padding(before, step, plan.shape)
                data += step.bytes / ratio
            before = step.layout
    return sent, data


def _less_padded(layout: Layout, shape: tuple[int, ...], keep: frozenset[int]) -> Layout | None:
    """The least padded layout that moves one mesh axis of ``layout`` (not one of ``keep``) from
    a padded dim to the innermost place of another dim; ``None`` if none pads less."""
    best, best_ratio = None, padding(layout, shape)
    for d, axes in enumerate(layout.dims):
        for a in axes:
            if a in keep:
                continue
            for other in range(layout.ndim):
                if other == d:
                    continue
                dims = [tuple(x for x in dim if x != a) for dim in layout.dims]
                dims[other] += (a,)
                moved = Layout(dims=tuple(dims), mesh=layout.mesh, partial=layout.partial)
                ratio = padding(moved, shape)
                if ratio < best_ratio - 1e-12:
                    best, best_ratio = moved, ratio
    return best


def padding_warnings(spec_plan: SpecPlan) -> list[str]:
    """One line per group of like tensors whose step sends more than :data:`PADDING_WARNING`
    times its data (and :data:`PADDING_FLOOR` bytes more): the ratio, the most padded of its
    layouts, and one that pads less (an axis moved to another dim; the param's axes stay where
    the param has them, unless the param itself pads)."""
    out = []
    for group in group_tensors(spec_plan):
        tp = group.first
        sent, data = padded_traffic(tp)
        if not data or sent <= PADDING_WARNING * data or sent - data < PADDING_FLOOR:
            continue
        t = tp.tensor
        named = [("param", t.param), ("grad", t.grad), *_states(t)]
        role, worst = max(named, key=lambda item: padding(item[1], t.shape))
        keep = frozenset() if role == "param" else frozenset(a for axes in t.param.dims for a in axes)
        better = _less_padded(worst, t.shape, keep)
        advice = (
            f"{better} pads {padding(better, t.shape):.2f}x"
            if better is not None
            else "no layout moving one axis to another dim pads less"
        )
        out.append(
            f"warning: tensor {group.label}: chunk padding: its step sends {format_bytes(sent)} per rank for "
            f"{format_bytes(round(data))} of data ({sent / data:.2f}x); {role} = {worst} pads "
            f"{padding(worst, t.shape):.2f}x; {advice}"
        )
    return out


def _states(tensor: Any) -> list[tuple[str, Layout]]:
    """The tensor's state layouts: the default one as ``state``, the others as ``state.X``."""
    named = [("state" if k == STATE_DEFAULT else f"state.{k}", v) for k, v in tensor.layouts.states]
    return named or [("state", tensor.state())]
