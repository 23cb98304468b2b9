"""Command-line values (shapes, durations, bandwidths, byte counts) and what they name (a pair
of layouts or a spec file)."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path

import attrs

from planner.bucket_cap import AUTO
from shardlang import Layout, Spec, TensorSpec, load_spec, parse_layout
from shardlang.errors import ShardlangError
from shardlang.parser import MAX_INT, parse_duration

_MAX_BYTES = 2**63  # no memory is larger; a bigger count is a typo
_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class UsageError(ShardlangError):
    """Arguments that do not fit together (a pair without --shape, ...)."""


class OptionError(ShardlangError):
    """An option's value that does not fit the input it applies to (a flat axis that a
    tensor's state mesh lacks): bad input, exit 1, as a spec's own errors."""


def shape_arg(text: str) -> tuple[int, ...]:
    """``32000x1024``, ``37,24``, ``1048576``; ``()`` or nothing for a scalar."""
    text = text.strip()
    if text in ("", "()", "[]"):
        return ()
    parts = re.split(r"\s*[x,×]\s*", text.strip("[]()"))
    if not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"'{text}' is not a shape; write lengths like 32000x1024 (or () for a scalar)")
    lengths = tuple(int(p) for p in parts)
    if any(length > MAX_INT for length in lengths):
        raise argparse.ArgumentTypeError(f"'{text}': a length is at most 2^63-1 ({MAX_INT}), as in spec files")
    return lengths


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


def axis_arg(text: str) -> str | int:
    """A mesh axis: its name (``dp``) or its index (``0``)."""
    name = text.strip()
    if name.isdigit():
        return int(name)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise argparse.ArgumentTypeError(f"'{text}' is not a mesh axis; give its name (dp) or index (0)")
    return name


def bucket_cap_arg(text: str) -> int | str:
    """:func:`bucket_bytes_arg`, or ``auto``: the cost model's cap (``planner.bucket_cap``)."""
    return AUTO if text == AUTO else bucket_bytes_arg(text)


def bucket_bytes_arg(text: str) -> int:
    """The most buffer bytes a bucket holds per rank: a byte count of at least 1."""
    value = bytes_arg(text)
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"'{text}': a bucket holds at least 1 byte (1 puts every step in a bucket of its own)"
        )
    return value


def check_flat_axis(tensors: Sequence[TensorSpec], axis: str | int | None) -> None:
    """Every tensor's state mesh has the flat axis, else an :class:`OptionError` naming one that lacks it."""
    if axis is None:
        return
    for tensor in tensors:
        try:
            tensor.state().mesh.axis_index(axis)
        except ShardlangError as e:
            raise OptionError(f"--flat-axis {axis}: tensor '{tensor.name}', its state mesh: {e.message}") from None


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
