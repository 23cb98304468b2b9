"""Element types a spec file or the planner may name: the one table of them, with their sizes
in bytes and the torch dtype each stands for (by name: the language core does not import
torch; ``runtime.memory.dtypes`` maps the names to torch dtypes from this table)."""

from __future__ import annotations

from shardlang.errors import LayoutError

# name: (bytes per element, torch dtype attribute)
DTYPES: dict[str, tuple[int, str]] = {
    "f64": (8, "float64"),
    "f32": (4, "float32"),
    "bf16": (2, "bfloat16"),
    "f16": (2, "float16"),
    "c128": (16, "complex128"),
    "c64": (8, "complex64"),
    "i64": (8, "int64"),
    "i32": (4, "int32"),
    "i16": (2, "int16"),
    "i8": (1, "int8"),
    "u8": (1, "uint8"),
    "bool": (1, "bool"),
}
ITEMSIZE: dict[str, int] = {name: size for name, (size, _) in DTYPES.items()}
# Complex values have no order: a max or min partial of them means nothing.
COMPLEX = frozenset({"c64", "c128"})


def itemsize(dtype: str) -> int:
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise LayoutError(f"unknown dtype '{dtype}' (expected one of {', '.join(ITEMSIZE)})") from None
