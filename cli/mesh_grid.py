"""How a mesh is drawn as a 2-D grid of ranks: leading axes down, trailing axes across.

The split between row and column axes is the one closest to a square that keeps at most
``max_columns`` columns; a mesh whose last axis alone is wider is drawn row-major in wrapped
rows (cells then name their coordinates, since the headers cannot).
"""

from __future__ import annotations

import itertools
import math

import attrs

from shardlang import Mesh
from shardlang.errors import ShardlangError

MAX_COLUMNS = 16
# A grid of more ranks than this helps nobody (and takes long to print or draw).
MAX_DRAWN_RANKS = 1024


class GridTooLarge(ShardlangError):
    """A mesh with more ranks than a grid can show legibly."""


def check_drawable(mesh: Mesh) -> None:
    if mesh.size > MAX_DRAWN_RANKS:
        raise GridTooLarge(
            f"{mesh.describe()} has {mesh.size} ranks; grids show at most {MAX_DRAWN_RANKS} "
            "(`shardlang plan` works on any mesh)"
        )


@attrs.frozen
class Grid:
    row_labels: tuple[str, ...]
    column_labels: tuple[str, ...]
    # cells[row][column] is a mesh coordinate, or None past the end of a wrapped last row.
    cells: tuple[tuple[tuple[int, ...] | None, ...], ...]
    # Whether the labels leave coordinates unsaid (a wrapped mesh of several axes): cells name them.
    wrapped: bool


def _label(mesh: Mesh, axes: range, coordinate: tuple[int, ...]) -> str:
    """``tp=1``, ``dp=0, cp=1`` for named axes; ``axis 1=0``, ``axes 1,2=(0,1)`` for numbered ones."""
    if not axes:
        return ""
    if mesh.axis_names is not None:
        return ", ".join(f"{mesh.axis_names[a]}={coordinate[a]}" for a in axes)
    if len(axes) == 1:
        return f"axis {axes[0]}={coordinate[axes[0]]}"
    return f"axes {','.join(map(str, axes))}=({','.join(str(coordinate[a]) for a in axes)})"


def coordinate_text(coordinate: tuple[int, ...]) -> str:
    return "(" + ",".join(map(str, coordinate)) + ")"


def arrange(mesh: Mesh, max_columns: int = MAX_COLUMNS) -> Grid:
    check_drawable(mesh)
    shape = mesh.shape
    coords = list(itertools.product(*(range(s) for s in shape)))
    splits = [k for k in range(1, mesh.ndim) if math.prod(shape[k:]) <= max_columns]
    if mesh.ndim == 1 and shape[0] <= max_columns:
        splits = [0]
    if splits:
        # Closest to square (in ratio), ties to the wider grid.
        k = min(splits, key=lambda k: (abs(math.log(math.prod(shape[k:]) / math.sqrt(mesh.size))), k))
        columns = math.prod(shape[k:])
        rows = [coords[i : i + columns] for i in range(0, len(coords), columns)]
        row_axes, column_axes = range(k), range(k, mesh.ndim)
        return Grid(
            row_labels=tuple(_label(mesh, row_axes, r[0]) for r in rows),
            column_labels=tuple(_label(mesh, column_axes, c) for c in rows[0]),
            cells=tuple(tuple(r) for r in rows),
            wrapped=False,
        )
    n = mesh.size
    root = math.isqrt(n - 1) + 1  # ceil(sqrt(n))
    columns = next((c for c in range(root, max_columns + 1) if n % c == 0), min(root, max_columns))
    rows = [coords[i : i + columns] for i in range(0, n, columns)]
    if mesh.ndim == 1:
        name = mesh.axis_label(0) if mesh.axis_names else "axis 0"
        # The last row may be short: it names the coordinates it holds.
        row_labels = tuple(f"{name}={r[0][0]}" + (f"..{r[-1][0]}" if len(r) > 1 else "") for r in rows)
    else:
        row_labels = tuple(f"from {coordinate_text(r[0])}" for r in rows)
    return Grid(
        row_labels=row_labels,
        column_labels=tuple(f"+{j}" for j in range(columns)),
        cells=tuple(tuple(r) + (None,) * (columns - len(r)) for r in rows),
        wrapped=mesh.ndim > 1,
    )
