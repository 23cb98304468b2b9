"""Plans as Graphviz pictures (DOT text): one panel per state, one arrow per step.

A panel draws the mesh as a grid of ranks (``cli.mesh_grid``); each cell names the block of
the global tensor its rank holds and is colored by that block, the same block in the same
color in every panel, so a reader sees blocks move, split and merge. The whole tensor is
grey, empty pieces white, and the cells of a partial state (each rank holds an addend) have
dashed borders. An arrow is labelled with its collective, mesh axis, bytes sent per rank
and modeled time. A point-to-point step (possibly between two meshes: each panel draws its own
mesh) passes through a box of its messages merged per rank pair: a list when there are few
pairs, else a sender-by-receiver grid shaded by bytes, legible up to 64 ranks a side.
"""

from __future__ import annotations

import colorsys
import itertools
import math
from collections.abc import Iterable
from html import escape

import attrs

from cli.buckets import bucket_rows, buffer_line, heading, summary_line
from cli.held_block import Block, block_at
from cli.mesh_grid import arrange, check_drawable, coordinate_text
from cli.messages import describe_messages
from cli.plan_report import describe_cost, describe_plan_cost, leg_ops, lower_bound_text
from cli.summary import TensorGroup, largest_first
from cli.tables import format_bytes, format_seconds
from planner import COMMUNICATING_OPS, Plan, Step
from planner.messages import MessageSummary, step_messages
from planner.spec_plan import SpecPlan, TensorPlans
from shardlang import Layout
from shardlang.dtypes import itemsize

FONT = "Helvetica"
WHOLE_COLOR = "#e4e4e4"
EMPTY_COLOR = "#ffffff"


@attrs.frozen
class Panel:
    key: str
    title: str
    layout: Layout


@attrs.frozen
class Arrow:
    tail: str
    head: str
    step: Step


@attrs.frozen
class Picture:
    title: str
    shape: tuple[int, ...]
    dtype: str
    panels: tuple[Panel, ...]
    arrows: tuple[Arrow, ...]


def plan_picture(plan: Plan) -> Picture:
    layouts = plan.layouts()
    last = len(layouts) - 1
    panels = tuple(
        Panel(
            key=f"state{i}",
            title="source" if i == 0 else ("target" if i == last else f"after step {i}"),
            layout=layout,
        )
        for i, layout in enumerate(layouts)
    )
    if last == 0:
        panels = (Panel("state0", "source = target", plan.src),)
    arrows = tuple(Arrow(f"state{i}", f"state{i + 1}", s) for i, s in enumerate(plan.steps))
    shape = "x".join(map(str, plan.shape)) or "()"
    title = (
        f"{plan.src}  ->  {plan.dst}\n"
        f"{shape} {plan.dtype}: {_steps_text(len(plan.steps))}, {_cost_text(plan.total_bytes, plan.total_seconds)}; "
        f"{lower_bound_text(plan)}\n"
        f"cost model: {describe_plan_cost(plan)}"
    )
    return Picture(title, plan.shape, plan.dtype, panels, arrows)


def tensor_picture(tp: TensorPlans, label: str | None = None) -> Picture:
    """One tensor's optimizer step: grad -> state -> param (and any state with its own
    layout); roles whose layouts are equal share one panel."""
    t = tp.tensor
    panels: dict[str, Panel] = {}
    arrows: list[Arrow] = []
    role_key: dict[str, str] = {}

    def role_panel(role: str, layout: Layout) -> str:
        if role not in role_key:
            role_key[role] = role
            panels[role] = Panel(role, role, layout)
        return role_key[role]

    for leg, plan in tp.plans():
        src_role, dst_role = (r.strip() for r in leg.split("->"))
        tail = role_panel(src_role, plan.src)
        if not plan.steps and dst_role not in role_key:
            role_key[dst_role] = tail  # no step: the two roles are one state
            panels[tail] = attrs.evolve(panels[tail], title=f"{panels[tail].title} = {dst_role}")
            continue
        for i, step in enumerate(plan.steps):
            last = i == len(plan.steps) - 1
            if last:
                head = role_panel(dst_role, plan.dst)
            else:
                head = f"{src_role}->{dst_role}:{i + 1}"
                panels[head] = Panel(head, f"{leg}, after step {i + 1}", step.layout)
            arrows.append(Arrow(tail, head, step))
            tail = head
    shape = "x".join(map(str, t.shape)) or "()"
    title = (
        f"{label or t.name} : {t.dtype}[{', '.join(map(str, t.shape))}]  one optimizer step\n"
        f"{shape} {t.dtype}: {_steps_text(len(arrows))}, {_cost_text(tp.total_bytes, tp.total_seconds)}\n"
        f"cost model: {describe_cost(tp.cost, t.param.mesh)}"
    )
    return Picture(title, t.shape, t.dtype, tuple(panels.values()), tuple(arrows))


def _steps_text(count: int) -> str:
    return f"{count} step{'s' * (count != 1)}"


def _cost_text(nbytes: int, seconds: float) -> str:
    return f"{format_bytes(nbytes)} sent per rank, {format_seconds(seconds)} modeled"


def _block_colors(picture: Picture) -> dict[tuple[tuple[int, int], ...], str]:
    """A color per distinct block of the picture, hues in the blocks' order in the tensor, so
    that the pieces of one block get neighbouring hues."""
    blocks: set[tuple[tuple[int, int], ...]] = set()
    for panel in picture.panels:
        for coordinate in itertools.product(*(range(n) for n in panel.layout.mesh.shape)):
            block = block_at(panel.layout, picture.shape, coordinate)
            if not block.whole and not block.empty:
                blocks.add(block.bounds)
    ordered = sorted(blocks, key=lambda b: (tuple(s for s, _ in b), tuple(-e for _, e in b)))
    colors = {}
    for i, bounds in enumerate(ordered):
        # Hues from orange round to violet (0.83 of the wheel), skipping back to red.
        colors[bounds] = _hsv_color((0.08 + 0.75 * i / max(1, len(ordered) - 1)) % 1.0, 0.38, 0.98)
    return colors


def _hsv_color(hue: float, saturation: float, value: float) -> str:
    """``#rrggbb`` of a color given as hue, saturation and value (each 0 to 1)."""
    r, g, b = colorsys.hsv_to_rgb(hue, saturation, value)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def _cell_color(block: Block, colors: dict[tuple[tuple[int, int], ...], str]) -> str:
    if block.empty:
        return EMPTY_COLOR
    if block.whole:
        return WHOLE_COLOR
    return colors[block.bounds]


def _panel_label(panel: Panel, picture: Picture, colors: dict[tuple[tuple[int, int], ...], str]) -> str:
    layout = panel.layout
    mesh = layout.mesh
    grid = arrange(mesh)
    local = layout.local_shape(picture.shape)
    nbytes = math.prod(local) * itemsize(picture.dtype)
    details = [f"piece per rank [{', '.join(map(str, local))}] = {format_bytes(nbytes)}"]
    if layout.partial:
        ops = ", ".join(f"{op} over axis {mesh.axis_label(a)}" for a, op in layout.partial)
        details.append(f"partial, pending {ops}: dashed cells hold addends")
    columns = len(grid.column_labels)
    rows = [
        f'<TR><TD COLSPAN="{columns + 1}" BGCOLOR="#f4f4f4" ALIGN="LEFT" BALIGN="LEFT">'
        f'<B>{escape(panel.title)}</B>   <FONT FACE="Courier">{escape(str(layout))}</FONT><BR/>'
        f'<FONT POINT-SIZE="10">{escape("; ".join(details))}</FONT></TD></TR>',
        '<TR><TD BORDER="0"></TD>' + "".join(f'<TD BORDER="0">{_small(c)}</TD>' for c in grid.column_labels) + "</TR>",
    ]
    style = ' STYLE="dashed"' if layout.partial else ""
    for label, row in zip(grid.row_labels, grid.cells, strict=True):
        cells = [f'<TD BORDER="0" ALIGN="RIGHT">{_small(label)}</TD>']
        for coordinate in row:
            if coordinate is None:
                cells.append('<TD BORDER="0"></TD>')
                continue
            block = block_at(layout, picture.shape, coordinate)
            where = f"r{mesh.rank_at(coordinate)}"
            if grid.wrapped:
                where += " " + coordinate_text(coordinate)
            text = escape(block.text())
            mark = block.mark()
            if mark:
                text += f'<BR/><FONT POINT-SIZE="8">{mark}</FONT>'
            cells.append(
                f'<TD BGCOLOR="{_cell_color(block, colors)}"{style}>'
                f'<FONT POINT-SIZE="8" COLOR="#555555">{where}</FONT><BR/>{text}</TD>'
            )
        rows.append("<TR>" + "".join(cells) + "</TR>")
    return '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="3">' + "".join(rows) + "</TABLE>>"


def _small(text: str) -> str:
    # An empty <FONT></FONT> is a syntax error to dot.
    return f'<FONT POINT-SIZE="9">{escape(text)}</FONT>' if text else ""


def _arrow_label(step: Step) -> str:
    mesh = step.layout.mesh
    if step.axis is None:  # point_to_point: its messages are drawn in a box of their own
        count = step.message_count
        cost = f"{format_bytes(step.bytes)} per rank (most sent or received), {format_seconds(step.seconds)}"
        return (
            f'<<B>{step.op}</B> ({count} message{"s" * (count != 1)})<BR ALIGN="LEFT"/>{escape(cost)}'
            '<BR ALIGN="LEFT"/>>'
        )
    args = [f"axis {mesh.axis_label(step.axis)}"]
    if step.dim is not None:
        args.append(f"dim {step.dim}" + (f" -> {step.to_dim}" if step.to_dim is not None else ""))
    if step.reduce_op is not None:
        args.append(step.reduce_op)
    cost = (
        "local, no communication"
        if step.op not in COMMUNICATING_OPS
        else (f"{format_bytes(step.bytes)} per rank, {format_seconds(step.seconds)}")
    )
    # Left-aligned lines keep the label clear of the arrow it sits beside.
    return f'<<B>{step.op}</B> ({escape(", ".join(args))})<BR ALIGN="LEFT"/>{escape(cost)}<BR ALIGN="LEFT"/>>'


# Up to this many rank pairs are listed; more are drawn as a sender-by-receiver grid of cells
# wide enough for a two-digit rank in the header.
LISTED_PAIRS = 24
CELL = 'WIDTH="11" HEIGHT="11" FIXEDSIZE="TRUE"'


def _messages_label(title: str, messages: MessageSummary) -> str:
    head = (
        f'<TR><TD COLSPAN="{{span}}" BGCOLOR="#f4f4f4" ALIGN="LEFT" BALIGN="LEFT"><B>{escape(title)}</B><BR/>'
        f'<FONT POINT-SIZE="10">{"<BR/>".join(escape(part) for part in describe_messages(messages).split("; "))}</FONT>'
        "</TD></TR>"
    )
    pairs = messages.pairs
    if len(pairs) <= LISTED_PAIRS:
        rows = [head.format(span=2)] + [
            f'<TR><TD ALIGN="LEFT">r{s} &#8594; r{d}</TD><TD ALIGN="RIGHT">{format_bytes(n)}</TD></TR>'
            for (s, d), n in pairs.items()
        ]
    else:
        senders = sorted({s for s, _ in pairs})
        receivers = sorted({d for _, d in pairs})
        most = max(pairs.values())
        rows = [head.format(span=len(receivers) + 1)]
        rows.append(
            '<TR><TD BORDER="0"><FONT POINT-SIZE="7">from \\ to</FONT></TD>'
            + "".join(f'<TD BORDER="0" {CELL}><FONT POINT-SIZE="7">{d}</FONT></TD>' for d in receivers)
            + "</TR>"
        )
        for s in senders:
            cells = []
            for d in receivers:
                n = pairs.get((s, d), 0)
                shade = EMPTY_COLOR if not n else _shade(n / most)
                cells.append(f'<TD BGCOLOR="{shade}" {CELL}></TD>')
            rows.append(f'<TR><TD BORDER="0" ALIGN="RIGHT"><FONT POINT-SIZE="7">{s}</FONT></TD>{"".join(cells)}</TR>')
        rows.append(
            f'<TR><TD BORDER="0" COLSPAN="{len(receivers) + 1}" ALIGN="LEFT"><FONT POINT-SIZE="9">'
            f"rows send, columns receive; the darkest cell is {escape(format_bytes(most))}, white is none"
            "</FONT></TD></TR>"
        )
    return '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="2">' + "".join(rows) + "</TABLE>>"


def _shade(fraction: float) -> str:
    """A blue from pale (little) to dark (the most), never white."""
    return _hsv_color(0.6, 0.15 + 0.75 * fraction, 0.98 - 0.35 * fraction)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _graph_header(name: str, title: str) -> list[str]:
    label = "".join(escape(line) + '<BR ALIGN="LEFT"/>' for line in title.split("\n"))
    return [
        f"digraph {_quote(name)} {{",
        f'  graph [rankdir=TB, labelloc=t, labeljust=l, fontname="{FONT}", fontsize=14, nodesep=0.5, '
        f"ranksep=0.45, label=<{label}>];",
        f'  node [shape=plain, fontname="{FONT}", fontsize=11];',
        f'  edge [fontname="{FONT}", fontsize=11, color="#333333", arrowsize=0.8];',
    ]


def picture_dot(picture: Picture) -> str:
    for panel in picture.panels:
        check_drawable(panel.layout.mesh)
    colors = _block_colors(picture)
    lines = _graph_header("plan", picture.title)
    for panel in picture.panels:
        lines.append(
            f"  {_quote(panel.key)} [id={_quote('panel-' + panel.key)}, label={_panel_label(panel, picture, colors)}];"
        )
    for i, arrow in enumerate(picture.arrows, 1):
        local = arrow.step.op not in COMMUNICATING_OPS
        style = ', style=dashed, color="#888888"' if local else ", penwidth=1.6"
        head = arrow.head
        if arrow.step.op == "point_to_point":  # the arrow passes through the box of its messages
            head = f"messages-{i}"
            # every message is drawn: a pattern-valued step's list (planner.pattern)
            messages = step_messages(arrow.step.expanded(), picture.dtype)
            label = _messages_label(f"messages of step {i}", messages)
            lines.append(f"  {_quote(head)} [id={_quote(head)}, label={label}];")
            lines.append(f"  {_quote(head)} -> {_quote(arrow.head)} [penwidth=1.6];")
        lines.append(
            f"  {_quote(arrow.tail)} -> {_quote(head)} [id={_quote(f'step-{i}')}, "
            f"class={_quote('step ' + arrow.step.op)}, label={_arrow_label(arrow.step)}{style}];"
        )
    lines.append("}")
    return "\n".join(lines) + "\n"


def summary_dot(spec_plan: SpecPlan, groups: Iterable[TensorGroup], flat_axis: str | int | None = None) -> str:
    """The whole optimizer step: a table per tensor (group) of its plans, bytes and time,
    largest first, with a bar for the time; below it a table of the step's buckets."""
    spec = spec_plan.spec
    n = len(spec_plan.tensors)
    title = (
        f"{spec.filename or 'spec'}: one optimizer step, {n} tensors, "
        f"{format_bytes(spec_plan.total_bytes)} sent per rank\n"
        f"{heading(spec_plan.step, flat_axis).partition(':')[0]}: {summary_line(spec_plan.step)}\n"
        "tensors largest first; a row with a count sums its tensors; times are each tensor's plans on their own"
    )
    lines = _graph_header("summary", title)
    lines += [
        f'  summary [id="summary", label={_tensors_table(spec_plan, groups)}];',
        f'  buckets [id="buckets", label={_buckets_table(spec_plan)}];',
        "  summary -> buckets [style=invis];",
        "}",
    ]
    return "\n".join(lines) + "\n"


def _tensors_table(spec_plan: SpecPlan, groups: Iterable[TensorGroup]) -> str:
    ordered = largest_first(list(groups))
    n = len(spec_plan.tensors)
    longest = max((g.total_seconds for g in ordered), default=0.0) or 1.0
    bar_width = 160
    head = ["tensor", "count", "shape", "dtype", "plans: op(axis), ...", "bytes/rank", "time", ""]
    rows = ["<TR>" + "".join(f'<TD BGCOLOR="#f4f4f4">{f"<B>{h}</B>" if h else ""}</TD>' for h in head) + "</TR>"]
    for g in ordered:
        tp = g.first
        width = max(1, round(bar_width * g.total_seconds / longest))
        cells = [
            f'<TD ALIGN="LEFT">{escape(g.label)}</TD>',
            f'<TD ALIGN="RIGHT">{g.count}</TD>',
            f"<TD>{'x'.join(map(str, tp.tensor.shape)) or '()'}</TD>",
            f"<TD>{tp.tensor.dtype}</TD>",
            '<TD ALIGN="LEFT" BALIGN="LEFT">'
            + "<BR/>".join(escape(f"{label}: {leg_ops(plan)}") for label, plan in tp.plans())
            + "</TD>",
            f'<TD ALIGN="RIGHT">{format_bytes(g.total_bytes)}</TD>',
            f'<TD ALIGN="RIGHT">{format_seconds(g.total_seconds)}</TD>',
            f'<TD ALIGN="LEFT" WIDTH="{bar_width}"><TABLE BORDER="0" CELLPADDING="0" CELLSPACING="0"><TR>'
            f'<TD BGCOLOR="#4c78a8" WIDTH="{width}" HEIGHT="10" FIXEDSIZE="TRUE"></TD></TR></TABLE></TD>',
        ]
        rows.append("<TR>" + "".join(cells) + "</TR>")
    rows.append(
        '<TR><TD ALIGN="LEFT"><B>total</B></TD>'
        f'<TD ALIGN="RIGHT"><B>{n}</B></TD><TD></TD><TD></TD><TD></TD>'
        f'<TD ALIGN="RIGHT"><B>{format_bytes(sum(g.total_bytes for g in ordered))}</B></TD>'
        f'<TD ALIGN="RIGHT"><B>{format_seconds(sum(g.total_seconds for g in ordered))}</B></TD><TD></TD></TR>'
    )
    return _html_table(rows)


def _html_table(rows: list[str]) -> str:
    return '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="4">' + "".join(rows) + "</TABLE>>"


def _buckets_table(spec_plan: SpecPlan) -> str:
    """One row per bucket, in the order every rank runs them: its collective, tensors, bytes and time."""
    step = spec_plan.step
    head = ["#", "stage", "collective", "tensors", "bytes/rank", "buffer", "time"]
    rows = [
        '<TR><TD COLSPAN="7" BGCOLOR="#f4f4f4" ALIGN="LEFT"><B>buckets</B>: one collective each, in the order '
        "every rank runs them</TD></TR>",
        "<TR>" + "".join(f'<TD BGCOLOR="#f4f4f4"><B>{h}</B></TD>' for h in head) + "</TR>",
    ]
    for r in bucket_rows(spec_plan):
        cells = [
            f'<TD ALIGN="RIGHT">{r.number}</TD>',
            f'<TD ALIGN="LEFT">{r.stage}</TD>',
            f'<TD ALIGN="LEFT">{escape(r.collective)}</TD>',
            f'<TD ALIGN="LEFT">{escape(r.count)}: {escape(r.names)}</TD>',
            f'<TD ALIGN="RIGHT">{format_bytes(r.bytes)}</TD>',
            f'<TD ALIGN="RIGHT">{format_bytes(r.buffer_bytes)}</TD>',
            f'<TD ALIGN="RIGHT">{format_seconds(r.seconds)}</TD>',
        ]
        rows.append("<TR>" + "".join(cells) + "</TR>")
    if not step.buckets:
        rows.append('<TR><TD COLSPAN="7" ALIGN="LEFT">none: no step of any tensor communicates</TD></TR>')
    rows.append(
        f'<TR><TD></TD><TD ALIGN="LEFT"><B>total</B></TD><TD ALIGN="LEFT">{step.collectives} collectives</TD><TD></TD>'
        f'<TD ALIGN="RIGHT"><B>{format_bytes(step.total_bytes)}</B></TD><TD></TD>'
        f'<TD ALIGN="RIGHT"><B>{format_seconds(step.total_seconds)}</B></TD></TR>'
    )
    rows.append(f'<TR><TD COLSPAN="7" ALIGN="LEFT">{escape(buffer_line(step))}</TD></TR>')
    return _html_table(rows)
