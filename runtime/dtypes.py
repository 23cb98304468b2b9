"""Torch element types and the names the language and the planner use for them."""

from __future__ import annotations

import torch

from runtime.errors import ReshardError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "f64": torch.float64,
    "f32": torch.float32,
    "bf16": torch.bfloat16,
    "f16": torch.float16,
    "i64": torch.int64,
    "i32": torch.int32,
    "i16": torch.int16,
    "i8": torch.int8,
    "u8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The language's name of a torch dtype (``torch.bfloat16`` -> ``"bf16"``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ReshardError(f"tensors of {dtype} are not supported (supported: {', '.join(TORCH_DTYPES)})") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a language dtype name (``"bf16"`` -> ``torch.bfloat16``)."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ReshardError(f"unknown dtype '{name}' (expected one of {', '.join(TORCH_DTYPES)})") from None
