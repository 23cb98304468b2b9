"""The search's exact integer scale (``planner.cost``, "The search compares times exactly"):
per-axis figures of floats turned into integer units per round and per byte on one common scale,
so that equal-time plans compare equal whatever the order of their steps."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping


@functools.lru_cache(maxsize=256)
def integer_rates(alpha: tuple[float, ...], bandwidth: tuple[float, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-axis (units per round, units per byte): the integers ``alpha[a] * D`` and
    ``D / bandwidth[a]`` for one common scale ``D``, so that a step's time times ``D`` is the
    integer ``rounds * units_per_round[a] + bytes * units_per_byte[a]``, exactly."""
    # Floats are exact ratios of integers: alpha = p / q, and 1 / bandwidth = q / p.
    ratios = {value: value.as_integer_ratio() for value in {*alpha, *bandwidth}}
    scale = math.lcm(*{ratios[a][1] for a in alpha}, *{ratios[b][0] for b in bandwidth})
    per_round = tuple(ratios[a][0] * (scale // ratios[a][1]) for a in alpha)
    per_byte = tuple(ratios[b][1] * (scale // ratios[b][0]) for b in bandwidth)
    return per_round, per_byte


# Per op: per-axis integer units per round, and per byte.
OpUnits = tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]


def integer_op_rates(*figures: Mapping[str, tuple[tuple[float, ...], tuple[float, ...]]]) -> list[OpUnits]:
    """:func:`integer_rates` of several :meth:`CostModel.figures` at once, on one common scale:
    for each, per op, the per-axis (units per round, units per byte)."""
    keys = [(i, op) for i, f in enumerate(figures) for op in f]
    alpha = tuple(v for i, op in keys for v in figures[i][op][0])
    bandwidth = tuple(v for i, op in keys for v in figures[i][op][1])
    per_round, per_byte = integer_rates(alpha, bandwidth)
    out: list[OpUnits] = [({}, {}) for _ in figures]
    start = 0
    for i, op in keys:
        end = start + len(figures[i][op][0])
        out[i][0][op], out[i][1][op] = per_round[start:end], per_byte[start:end]
        start = end
    return out
