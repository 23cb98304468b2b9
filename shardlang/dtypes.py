"""Element types a spec file or the planner may name, and their sizes in bytes."""

from __future__ import annotations

from shardlang.errors import LayoutError

ITEMSIZE: dict[str, int] = {
    "f64": 8,
    "f32": 4,
    "bf16": 2,
    "f16": 2,
    "i64": 8,
    "i32": 4,
    "i16": 2,
    "i8": 1,
    "u8": 1,
    "bool": 1,
}


def itemsize(dtype: str) -> int:
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise LayoutError(f"unknown dtype '{dtype}' (expected one of {', '.join(ITEMSIZE)})") from None
