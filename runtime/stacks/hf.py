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
"""

from __future__ import annotations

import os
from typing import Any

from transformers import Trainer

from runtime import checkpoint
from runtime.optim import OptimizerError, ShardedOptimizer

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
    """``transformers.Trainer`` whose checkpoints hold a sharded optimizer's pieces (module
    docstring); everything else is the Trainer's."""

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
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
