"""Command-line values (shapes, durations, bandwidths, byte counts) and what they name (a pair
of layouts or a spec file)."""

from __future__ import annotations

import argparse
import math
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

import attrs

from shardlang import Layout, Spec, load_spec, parse_layout
from shardlang.errors import ShardlangError
from shardlang.parser import parse_duration

_MAX_BYTES = 2**63  # no memory is larger; a bigger count is a typo
_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class UsageError(ShardlangError):
    """Arguments that do not fit together (a pair without --shape, ...)."""


def shape_arg(text: str) -> tuple[int, ...]:
    """``32000x1024``, ``37,24``, ``1048576``; ``()`` or nothing for a scalar."""
    text = text.strip()
    if text in ("", "()", "[]"):
        return ()
    parts = re.split(r"\s*[x,×]\s*", text.strip("[]()"))
    if not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"'{text}' is not a shape; write lengths like 32000x1024 (or () for a scalar)")
    return tuple(int(p) for p in parts)


def _number(text: str) -> Decimal:
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not value.is_finite():
        raise argparse.ArgumentTypeError(f"'{text}' is not a finite number")
    return value


def duration_arg(text: str) -> float:
    """Seconds, as spec files write them: ``5e-6``, ``5us``, ``0.01 ms``; zero or positive."""
    compact = "".join(text.split())
    if compact.startswith("-"):
        raise argparse.ArgumentTypeError(f"'{text}' is negative; a latency is zero or more")
    try:
        value = parse_duration(compact)
    except ShardlangError as e:
        raise argparse.ArgumentTypeError(e.message) from None
    if not value < math.inf:
        raise argparse.ArgumentTypeError(f"'{text}' is too large a duration")
    return value


def bandwidth_arg(text: str) -> float | tuple[float, ...]:
    """Bytes per second: one number for every mesh axis, or one per axis: ``25e9,300e9``."""
    values = [float(_number(v)) for v in text.split(",")]
    if any(not 0 < v < math.inf for v in values):
        raise argparse.ArgumentTypeError(f"'{text}': bandwidths must be positive and below infinity (bytes per second)")
    return values[0] if len(values) == 1 else tuple(values)


def bytes_arg(text: str) -> int:
    """A byte count: ``1048576``, ``64MiB``, ``2GB``."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"'{text}' is not a byte count; write 1048576, 64MiB or 2GB")
    try:
        value = _number(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
    except ArithmeticError:  # decimal's Overflow on absurd exponents
        value = Decimal(_MAX_BYTES)
    if value >= _MAX_BYTES:
        raise argparse.ArgumentTypeError(f"'{text}' is too large a byte count (at most {_MAX_BYTES - 1})")
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number of bytes")
    return int(value)


@attrs.frozen
class Pair:
    """Two layouts and the tensor they describe."""

    src: Layout
    dst: Layout
    shape: tuple[int, ...]
    dtype: str


def read_pair(src: str, dst: str, shape: tuple[int, ...] | None, dtype: str | None) -> Pair:
    """The layouts named SRC and DST in errors (``SRC:1:7: unexpected ...``)."""
    if shape is None:
        raise UsageError("planning a pair of layouts needs the tensor's --shape (e.g. --shape 32000x1024)")
    return Pair(
        src=parse_layout(src, filename="SRC"),
        dst=parse_layout(dst, filename="DST"),
        shape=shape,
        dtype=dtype or "f32",
    )


def read_spec(path: str) -> Spec:
    if not Path(path).exists() and " over " in path:
        raise UsageError(f"'{path}' looks like a layout: give two layouts (SRC DST) with --shape, or one spec file")
    return load_spec(path)
