"""``shardlang show``: which block of the global tensor each rank holds, as a text grid."""

from __future__ import annotations

from typing import Any

from cli.held_block import block_at
from cli.mesh_grid import arrange, check_drawable, coordinate_text
from cli.tables import format_table, visible_width
from cli.terminal import Style
from shardlang import Layout


def show_json(layout: Layout, shape: tuple[int, ...]) -> dict[str, Any]:
    mesh = layout.mesh
    check_drawable(mesh)
    ranks = []
    for rank in mesh.ranks:
        coordinate = mesh.coordinate(rank)
        block = block_at(layout, shape, coordinate)
        ranks.append(
            {
                "rank": rank,
                "coordinate": list(coordinate),
                "bounds": [list(b) for b in block.bounds],
                "padded": block.padded,
                "empty": block.empty,
            }
        )
    return {"layout": str(layout), "shape": list(shape), "local_shape": list(layout.local_shape(shape)), "ranks": ranks}


def _describe(layout: Layout, shape: tuple[int, ...]) -> list[str]:
    mesh = layout.mesh
    lines = [
        f"tensor shape [{', '.join(map(str, shape))}]; padded piece per rank "
        f"[{', '.join(map(str, layout.local_shape(shape)))}]"
    ]
    for d, axes in enumerate(layout.dims):
        if axes:
            order = ", then ".join(f"{mesh.shape[a]} ways over axis {mesh.axis_label(a)}" for a in axes)
            lines.append(f"dim {d} is split {order}")
    if layout.replicated_axes():
        lines.append("replicated over axis " + ", ".join(mesh.axis_label(a) for a in layout.replicated_axes()))
    for axis, op in layout.partial:
        lines.append(f"partial over axis {mesh.axis_label(axis)}: each rank holds an addend; the tensor is their {op}")
    return lines


def format_show(layout: Layout, shape: tuple[int, ...], style: Style, width: int) -> str:
    layout.check_shape(shape)
    mesh = layout.mesh
    grid = arrange(mesh)
    out = [style(str(layout), "bold"), *("  " + line for line in _describe(layout, shape)), ""]
    cells = []
    marks = set()
    for row in grid.cells:
        texts = []
        for coordinate in row:
            if coordinate is None:
                texts.append("")
                continue
            block = block_at(layout, shape, coordinate)
            where = f"rank {mesh.rank_at(coordinate)}"
            if grid.wrapped:
                where += " " + coordinate_text(coordinate)
            lines = [style(where, "bold"), block.text()]
            mark = block.mark()
            if mark:
                marks.add(mark)
                lines.append(style(mark, "yellow" if block.padded else "dim"))
            texts.append("\n".join(lines))
        cells.append(texts)
    # Columns that do not fit the terminal go to further tables below, as numpy prints arrays.
    column_widths = [
        max([visible_width(grid.column_labels[j])] + [visible_width(line) for r in cells for line in r[j].split("\n")])
        for j in range(len(grid.column_labels))
    ]
    label_width = max(visible_width(label) for label in grid.row_labels)
    chunks: list[list[int]] = [[]]
    used = label_width + 2
    for j, w in enumerate(column_widths):
        if chunks[-1] and used + w + 2 > width:
            chunks.append([])
            used = label_width + 2
        chunks[-1].append(j)
        used += w + 2
    for chunk in chunks:
        headers = ["", *(style(grid.column_labels[j], "cyan") for j in chunk)]
        rows = [[style(label, "cyan"), *(r[j] for j in chunk)] for label, r in zip(grid.row_labels, cells, strict=True)]
        out += [format_table(headers, rows, indent="  "), ""]
    legend = {
        "padded": "padded: shorter than the padded piece (collectives pad it, then trim)",
        "empty": "empty: holds no elements (torch.chunk leaves trailing pieces empty)",
    }
    out += ["  " + legend[m] for m in sorted(marks)]
    return "\n".join(out).rstrip()
