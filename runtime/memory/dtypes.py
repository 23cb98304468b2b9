"""Torch element types and the names the language and the planner use for them (the table is
``shardlang.dtypes.DTYPES``)."""

from __future__ import annotations

import torch

from runtime.errors import ReshardError
from shardlang.dtypes import DTYPES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, attribute) for name, (_, attribute) in DTYPES.items()}
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


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``: ``x`` itself when it already is (``Tensor.to`` costs microseconds
    even then, and a step calls it for every tensor), else a converted copy."""
    return x if x.dtype == dtype else x.to(dtype)
