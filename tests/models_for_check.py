"""Small models for ``shardlang check --model`` (tests/test_model_check.py): a two-layer
language model, and the same model as wrappers name its parameters."""

from __future__ import annotations

import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, 16)
        self.h = nn.ModuleList(nn.ModuleDict({"attn": nn.Linear(16, 16), "ln": nn.LayerNorm(16)}) for _ in range(2))
        self.lm_head = nn.Linear(16, 64, bias=False)


class Wrapped(nn.Module):
    """Names as DDP gives them: every parameter under ``module.``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner


def tiny() -> nn.Module:
    return Tiny()


def tiny_bf16() -> nn.Module:
    return Tiny().to(torch.bfloat16)


def tiny_f64() -> nn.Module:
    return Tiny().to(torch.float64)


def tiny_ddp() -> nn.Module:
    return Wrapped(Tiny())


def broken() -> nn.Module:
    raise RuntimeError("the factory failed on purpose")
