"""``shardlang explain``: the chosen plan next to the one-axis-at-a-time greedy baseline."""

from __future__ import annotations

from typing import Any

import attrs

from cli.greedy import NoGreedyOrder, greedy_plan
from cli.plan_report import format_plan, plan_json, steps_table
from cli.tables import format_bytes, format_seconds
from cli.terminal import Style
from planner import DEFAULT_MAX_STATES, CostModel, Plan, plan
from shardlang import Layout


@attrs.frozen
class Explained:
    chosen: Plan
    greedy: Plan | None
    why_no_greedy: str | None


def explain(
    src: Layout,
    dst: Layout,
    shape: tuple[int, ...],
    dtype: str,
    cost: CostModel,
    *,
    point_to_point: bool = False,
    max_states: int = DEFAULT_MAX_STATES,
) -> Explained:
    chosen = plan(src, dst, shape, dtype, cost, point_to_point=point_to_point, max_states=max_states)
    if not src.mesh.same_geometry(dst.mesh):
        return Explained(chosen, None, "the layouts are on different meshes, which DTensor cannot redistribute between")
    try:
        return Explained(chosen, greedy_plan(src, dst, shape, dtype, cost), None)
    except NoGreedyOrder as e:
        return Explained(chosen, None, str(e))


def explained_json(ex: Explained) -> dict[str, Any]:
    greedy = ex.greedy
    return {
        "chosen": plan_json(ex.chosen),
        "greedy": plan_json(greedy) if greedy else None,
        "greedy_unavailable": ex.why_no_greedy,
        "saved_bytes": greedy.total_bytes - ex.chosen.total_bytes if greedy else None,
        "saved_seconds": greedy.total_seconds - ex.chosen.total_seconds if greedy else None,
    }


def format_explained(ex: Explained, style: Style) -> str:
    mixed = any(step.op == "point_to_point" for step in ex.chosen.steps)
    heading = "chosen plan (the cheapest candidate, point-to-point included)" if mixed else "chosen plan (exact search)"
    out = [format_plan(ex.chosen, style, heading=heading), ""]
    out.append(
        style("greedy baseline", "bold") + ": one mesh axis at a time, each straight to its target "
        "placement (the order of DTensor's default planner)"
    )
    if ex.greedy is None:
        out.append(f"  none: {ex.why_no_greedy}")
        return "\n".join(out)
    out += [steps_table(ex.greedy, style), ""]
    chosen, greedy = ex.chosen, ex.greedy
    if greedy.total_seconds <= chosen.total_seconds:
        out.append(style("same cost", "bold") + ": the greedy order is as cheap as the chosen plan here")
        return "\n".join(out)
    ratio = f"{greedy.total_seconds / chosen.total_seconds:.2f}x" if chosen.total_seconds > 0 else "infinitely"
    saved_bytes = greedy.total_bytes - chosen.total_bytes
    bytes_text = (
        f"{format_bytes(saved_bytes)} less sent per rank"
        if saved_bytes >= 0
        else f"{format_bytes(-saved_bytes)} more sent per rank, over faster axes"
    )
    out.append(
        style("saved", "green", "bold") + f": {format_seconds(greedy.total_seconds - chosen.total_seconds)} "
        f"per call ({bytes_text}); the greedy order costs {ratio} the chosen plan"
    )
    return "\n".join(out)
