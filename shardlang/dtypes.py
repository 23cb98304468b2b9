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


# Other names of these types (torch's, numpy's, C's) that a spec may be written with by mistake.
ALIASES: dict[str, str] = {attr: name for name, (_, attr) in DTYPES.items()} | {
    "float": "f32", "double": "f64", "half": "f16", "long": "i64", "int": "i32", "short": "i16",
    "cfloat": "c64", "cdouble": "c128", "fp32": "f32", "fp16": "f16", "fp64": "f64",
}  # fmt: skip


def spelled_as(name: str) -> str | None:
    """The dtype ``name`` (``float32``, ``torch.bfloat16``, ``np.int64``) stands for, if another
    framework's name of one."""
    return ALIASES.get(name.rsplit(".", 1)[-1])


def itemsize(dtype: str) -> int:
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        ours = spelled_as(dtype)
        hint = f": did you mean '{ours}'?" if ours is not None and ours in ITEMSIZE else ""
        raise LayoutError(f"unknown dtype '{dtype}' (expected one of {', '.join(ITEMSIZE)}){hint}") from None
