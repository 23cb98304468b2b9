"""What the tests of the training stacks share (tests/test_stack_*.py): the examples imported,
the environment torchrun gives a rank, and what a rank reports back (whole optimizer states,
parameters)."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType
from typing import Any

import torch

from tests.conftest import EXAMPLES


def example(name: str) -> ModuleType:
    """``examples/<name>``, imported."""
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def as_torchrun(rank: int, world_size: int) -> None:
    """The environment torchrun gives a rank, which the stacks read (the group is up already)."""
    os.environ |= {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",
        "TORCHELASTIC_RUN_ID": "test",
    }


def whole_states(optimizer: Any) -> dict[str, torch.Tensor]:
    """The sharded optimizer inside ``optimizer`` (a stack may wrap it: ``.optimizer``), every
    state gathered whole, keyed ``index.state``; every rank calls it."""
    from runtime.optim import ShardedOptimizer

    sharded = getattr(optimizer, "optimizer", optimizer)
    assert isinstance(sharded, ShardedOptimizer), type(sharded).__name__
    full = sharded.full_state_dict()
    return {f"{i}.{k}": v.clone() for i, entry in full["state"].items() for k, v in entry.items()}


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters, whole (a DTensor's gathered: every rank calls it), copied."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
