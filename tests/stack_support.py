"""What the tests of the training stacks share (tests/test_stack_*.py): the examples imported,
the environment torchrun gives a rank, what a rank reports back (whole optimizer states,
parameters), and the Trainer callback that records them."""

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


def trainer_recorder(saved: dict[int, Any], begun: dict[str, Any]) -> Any:
    """A Hugging Face ``TrainerCallback`` that records at each save (into ``saved[global step]``)
    and at the start of training (into ``begun``): the optimizer's whole states (``states``),
    their step counts (``steps``), the learning rates (``lr``), the model's parameters whole
    (``parameters``) and the global step; every rank records."""
    from transformers import TrainerCallback

    def record(state: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        optimizer = kwargs["optimizer"]
        return {
            "states": whole_states(optimizer),
            "steps": [h.step for h in getattr(optimizer, "optimizer", optimizer).held_tensors()],
            "lr": kwargs["lr_scheduler"].get_last_lr(),
            "parameters": parameters(kwargs["model"]),
            "global_step": state.global_step,
        }

    class Recorder(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            saved[state.global_step] = record(state, kwargs)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            begun.update(record(state, kwargs))

    return Recorder()
