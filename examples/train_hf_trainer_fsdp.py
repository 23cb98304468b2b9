"""The Hugging Face Trainer's ``fsdp=`` option (FSDP2) with ShardedAdamW (docs/stacks/huggingface.md).

    torchrun --standalone --nproc-per-node 4 examples/train_hf_trainer_fsdp.py --output-dir out/hf-fsdp --steps 3
    torchrun --standalone --nproc-per-node 2 examples/train_hf_trainer_fsdp.py --output-dir out/hf-fsdp --steps 3 \
        --resume out/hf-fsdp/checkpoint-2

``TrainingArguments(fsdp=True, fsdp_config={"version": 2})``: the Trainer shards the model with
FSDP2 (every parameter a DTensor, its rows split over the ranks; FSDP2 reduce-scatters the
gradients), so the spec is ZeRO-3, written from the sharded parameters. The Trainer refuses
``optimizers=`` under FSDP; ``ShardedTrainer(make_optimizer=...)`` builds the optimizer from the
model once it is sharded. The lr schedule is the Trainer's (linear, 2 warm-up steps).
Checkpoints every 2 steps: the Trainer's FSDP model file and the optimizer's pieces
(``runtime.checkpoint``); ``--resume`` goes on from one on any number of ranks.

On CPU, accelerate takes no FSDP plugin and the Trainer would run DDP without a word;
:class:`FSDPOnCPU` sets what accelerate sets on GPUs, so that the Trainer runs FSDP2 on gloo.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the examples beside this one

from train_accelerate_fsdp2 import take_fsdp_plugin_on_cpu
from train_hf_trainer import Tokens, tiny_gpt2, train
from train_hf_trainer import arguments as hf_trainer_arguments

import shardlang
from runtime.optim import ShardedAdamW
from runtime.stacks.fsdp2 import check_spec
from runtime.stacks.hf import ShardedTrainer

LR = 1e-2


def arguments(output_dir: str, steps: int) -> TrainingArguments:
    """train_hf_trainer.py's, with FSDP2 and the Trainer's own optimizer (the reference) and schedule."""
    return hf_trainer_arguments(
        output_dir,
        steps,
        learning_rate=LR,
        weight_decay=0.0,
        lr_scheduler_type="linear",
        warmup_steps=2,
        optim="adamw_torch",  # the reference: torch.optim.AdamW
        fsdp=True,
        fsdp_config={"version": 2},
    )


def sharded_adamw(model: torch.nn.Module) -> ShardedAdamW:
    """ShardedAdamW over the parameters FSDP2 sharded: ZeRO-3, as FSDP2 splits them."""
    spec = shardlang.spec_for(model.named_parameters(), f"world = [dp={dist.get_world_size()}]", "zero3")
    check_spec(model.named_parameters(), spec)
    return ShardedAdamW(model.named_parameters(), spec, lr=LR, weight_decay=0.0)


class FSDPOnCPU:
    """A Trainer that runs its ``fsdp=`` option on CPU too. accelerate (1.16) takes the FSDP
    plugin only on GPUs and other accelerators; on CPU the Trainer's Accelerator runs DDP and
    ``is_fsdp_enabled`` is false, saying nothing. This sets the type and plugin accelerate sets
    on GPUs (FSDP2 itself runs on gloo); elsewhere it changes nothing."""

    args: TrainingArguments
    is_fsdp_enabled: bool

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        if self.args.fsdp and not self.is_fsdp_enabled:
            take_fsdp_plugin_on_cpu(FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
            self.is_fsdp_enabled = True


class ShardedFSDPTrainer(FSDPOnCPU, ShardedTrainer):
    pass


class TorchFSDPTrainer(FSDPOnCPU, Trainer):
    """The reference: the Trainer's own AdamW under the same FSDP2."""


def sharded_trainer(output_dir: str, steps: int, callbacks: Sequence[Any] = ()) -> ShardedTrainer:
    return ShardedFSDPTrainer(
        model=tiny_gpt2(),
        args=arguments(output_dir, steps),
        train_dataset=Tokens(),
        make_optimizer=sharded_adamw,
        callbacks=list(callbacks),
    )


def torch_trainer(output_dir: str, steps: int) -> Trainer:
    return TorchFSDPTrainer(model=tiny_gpt2(), args=arguments(output_dir, steps), train_dataset=Tokens())


def main(argv: Sequence[str] | None = None, callbacks: Sequence[Any] = ()) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--resume", help="a checkpoint-N folder to go on from")
    args = parser.parse_args(argv)
    return train(lambda: sharded_trainer(args.output_dir, args.steps, callbacks), args.resume)


if __name__ == "__main__":
    main()
