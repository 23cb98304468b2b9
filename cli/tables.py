"""Aligned text tables and human units for bytes and seconds."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def visible_width(text: str) -> int:
    return len(_ANSI.sub("", text))


def _pad(text: str, width: int, align: str) -> str:
    gap = " " * (width - visible_width(text))
    return gap + text if align == ">" else text + gap


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None, indent: str = ""
) -> str:
    """Columns aligned to their widest cell; ``align`` has one ``<`` or ``>`` per column.

    A cell may hold several lines; its row is then as tall as its tallest cell. Trailing
    spaces are trimmed so that piped output diffs cleanly.
    """
    align = align or "<" * len(headers)
    split_rows = [[str(c).split("\n") for c in row] for row in [list(headers), *rows]]
    widths = [max(visible_width(line) for row in split_rows for line in row[i]) for i in range(len(headers))]
    out = []
    for row in split_rows:
        height = max(len(cell) for cell in row)
        for k in range(height):
            cells = [
                _pad(cell[k] if k < len(cell) else "", w, a) for cell, w, a in zip(row, widths, align, strict=True)
            ]
            out.append((indent + "  ".join(cells)).rstrip())
    return "\n".join(out)


def total_row(headers: Sequence[str], cells: Mapping[str, str]) -> list[str]:
    """A table's total row for :func:`format_table`: each of ``cells`` (header -> text, styled
    by the caller) under its header, the other cells blank."""
    unknown = set(cells) - set(headers)
    if unknown:
        raise ValueError(f"total row cells {sorted(unknown)} name no column of {list(headers)}")
    return [cells.get(h, "") for h in headers]


def _three_digits(value: float, units: Sequence[tuple[float, str]]) -> str:
    """``value`` in the smallest of ``units`` (divisor, name) that keeps it below 1000 once
    rounded to three significant digits (so 999.9 us prints as 1 ms, not 1e+03 us)."""
    for i, (divisor, name) in enumerate(units):
        digits = f"{value / divisor:.3g}"
        if float(digits) < 1000 or i == len(units) - 1:
            return f"{digits if float(digits) < 1000 else f'{value / divisor:.0f}'} {name}"
    raise AssertionError("units must not be empty")


def format_bytes(n: float) -> str:
    """``0 B``, ``512 B``, ``3.5 MiB``: binary units, three significant digits."""
    return _three_digits(n, [(1, "B"), (2**10, "KiB"), (2**20, "MiB"), (2**30, "GiB"), (2**40, "TiB")])


def format_seconds(s: float) -> str:
    """``0 s``, ``47.2 us``, ``1.25 ms``, ``3.1 s``: three significant digits."""
    if s == 0:
        return "0 s"
    return _three_digits(s, [(1e-9, "ns"), (1e-6, "us"), (1e-3, "ms"), (1.0, "s")])
