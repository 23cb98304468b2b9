"""A sharded optimizer inside the Hugging Face ``Trainer`` (docs/stacks/huggingface.md).

    optimizer = ShardedAdamW(model.named_parameters(), spec, lr=3e-4)
    trainer = ShardedTrainer(model=model, args=args, train_dataset=data,
                             optimizers=(optimizer, get_linear_schedule_with_warmup(optimizer, 10, 100)))

``Trainer`` saves ``optimizer.state_dict()`` from process 0 alone, which for a sharded
optimizer holds only rank 0's pieces (another rank loading them would take rank 0's). So
:class:`ShardedTrainer` saves the optimizer, its parameters and the lr scheduler with
``runtime.checkpoint`` (every rank its pieces, in ``checkpoint-N/shardlang``) and loads them
from there when resuming, on any number of ranks; the rest of the checkpoint (model weights,
trainer state) is the Trainer's own.

With the Trainer's ``fsdp=`` option (FSDP2: ``fsdp_config={"version": 2}``) the Trainer refuses
``optimizers=`` and builds its optimizer before accelerate shards the model; a sharded optimizer
places its parameters when it is built, so it must see the sharded (DTensor) ones. Give
``make_optimizer`` instead: :meth:`ShardedTrainer.create_optimizer` shards the model first
(accelerate's own ``prepare``, as ``runtime.stacks.fsdp2.prepare_fsdp2`` does) and builds the
optimizer from it; the Trainer's ``prepare`` of model and optimizer then finds the model sharded
and keeps its parameters. The lr scheduler is the Trainer's (``lr_scheduler_type``,
``warmup_steps``). Checkpoints keep the Trainer's FSDP model file, which it writes beside the
optimizer and reads when resuming.

    trainer = ShardedTrainer(model=model, args=TrainingArguments(..., fsdp=True, fsdp_config={"version": 2}),
                             train_dataset=data, make_optimizer=lambda m: ShardedAdamW(m.named_parameters(), spec))
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer

from runtime import checkpoint
from runtime.optim import OptimizerError, ShardedOptimizer
from runtime.stacks.fsdp2 import check_placed

FOLDER = "shardlang"  # inside the Trainer's checkpoint-N folder


def sharded_optimizer(optimizer: Any) -> ShardedOptimizer:
    """The sharded optimizer inside ``optimizer`` (accelerate wraps it)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, ShardedOptimizer):
        raise OptimizerError(
            f"ShardedTrainer needs a sharded optimizer in optimizers=(optimizer, scheduler), got {type(inner).__name__}"
        )
    return inner


class ShardedTrainer(Trainer):
    """``transformers.Trainer`` whose checkpoints hold a sharded optimizer's pieces, and which
    builds one over the model FSDP2 sharded with ``make_optimizer`` (module docstring);
    everything else is the Trainer's."""

    def __init__(
        self,
        *args: Any,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
        **kwargs: Any,
    ) -> None:
        self.make_optimizer = make_optimizer
        super().__init__(*args, **kwargs)
        if make_optimizer is not None and self.optimizer is not None:
            raise OptimizerError("give ShardedTrainer make_optimizer or optimizers=(optimizer, scheduler), not both")

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """With ``make_optimizer``: the optimizer it builds from the model, sharded first under
        FSDP2; otherwise the Trainer's."""
        if self.optimizer is None and self.make_optimizer is not None:
            target = self.model if model is None else model
            if self.is_fsdp_enabled:
                version = getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1)
                if version != 2:
                    raise OptimizerError(
                        f"ShardedTrainer takes fsdp_config version 2 (FSDP2: DTensor parameters), got version "
                        f"{version}, whose flat parameters no spec describes"
                    )
                target = self.accelerator.prepare(target)  # fully_shard now, in place: the Trainer's prepare keeps it
            self.optimizer = self.make_optimizer(target)
            sharded_optimizer(self.optimizer)
            check_placed(self.optimizer, target)
        return super().create_optimizer(model)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.is_fsdp_enabled:  # the Trainer saves an FSDP model for resuming here, with its optimizer
            from accelerate.utils import save_fsdp_model
            from transformers.distributed.fsdp import get_fsdp_ckpt_kwargs

            plugin = self.accelerator.state.fsdp_plugin
            save_fsdp_model(plugin, self.accelerator, self.model, output_dir, **get_fsdp_ckpt_kwargs())
        checkpoint.save(
            os.path.join(output_dir, FOLDER),
            optimizer=sharded_optimizer(self.optimizer),
            objects={"scheduler": self.lr_scheduler},
        )

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            return
        checkpoint.load(
            os.path.join(checkpoint_dir, FOLDER),
            optimizer=sharded_optimizer(self.optimizer),
            objects={"scheduler": self.lr_scheduler},
        )
