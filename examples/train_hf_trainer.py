"""A tiny GPT-2 trained by the Hugging Face Trainer with ShardedAdamW (docs/stacks/huggingface.md).

    torchrun --standalone --nproc-per-node 4 examples/train_hf_trainer.py --output-dir out/hf --steps 4
    torchrun --standalone --nproc-per-node 2 examples/train_hf_trainer.py --output-dir out/hf --steps 6 --resume

The Trainer wraps the model in DDP, which averages the gradients, so the spec is ZeRO-1: whole
gradients (already reduced), each rank keeping 1/N of every state, and a step all-gathers the
updated parameters. The optimizer is built from the model before the Trainer wraps it, so the
names carry no ``module.``. Checkpoints every 2 steps; ``--resume`` goes on from the last one,
on any number of ranks (``--resume out/hf/checkpoint-2``: from that one).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, get_linear_schedule_with_warmup

import shardlang
from runtime.optim import ShardedAdamW
from runtime.stacks.hf import ShardedTrainer

VOCAB, LENGTH = 64, 8


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same on every rank (the Trainer's sampler splits them)."""

    def __init__(self, count: int = 256) -> None:
        self.ids = torch.randint(0, VOCAB, (count, LENGTH), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=1, n_head=2)
    return GPT2LMHeadModel(config)


def arguments(output_dir: str, steps: int, **more: Any) -> TrainingArguments:
    """The runs' TrainingArguments; ``more``: other fields of them (train_hf_trainer_fsdp.py's)."""
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=4,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **more,
    )


def sharded_trainer(output_dir: str, steps: int, callbacks: Sequence[Any] = ()) -> ShardedTrainer:
    model = tiny_gpt2()
    mesh = f"world = [dp={dist.get_world_size()}]"
    spec = shardlang.spec_for(model.named_parameters(), mesh, "zero1")  # DDP reduces the gradients
    optimizer = ShardedAdamW(model.named_parameters(), spec, lr=1e-2, weight_decay=0.0)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=steps)
    return ShardedTrainer(
        model=model,
        args=arguments(output_dir, steps),
        train_dataset=Tokens(),
        optimizers=(optimizer, scheduler),
        callbacks=list(callbacks),
    )


def torch_trainer(output_dir: str, steps: int) -> Any:
    """The same run with the Trainer's own AdamW (the reference)."""
    from transformers import Trainer

    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=steps)
    return Trainer(
        model=model, args=arguments(output_dir, steps), train_dataset=Tokens(), optimizers=(optimizer, scheduler)
    )


def main(argv: Sequence[str] | None = None, callbacks: Sequence[Any] = ()) -> ShardedTrainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--resume", nargs="?", const=True, default=None, help="go on from the last checkpoint, or from the one given"
    )
    args = parser.parse_args(argv)
    return train(lambda: sharded_trainer(args.output_dir, args.steps, callbacks), args.resume)


def train(make_trainer: Callable[[], Any], resume: str | bool | None) -> Any:
    """Build the Trainer in the process group (torchrun's, or a test's) and train it; rank 0
    prints the losses."""
    started = not dist.is_initialized()
    if started:  # under torchrun (a test may have started the group)
        dist.init_process_group("gloo")
    trainer = make_trainer()
    trainer.train(resume_from_checkpoint=resume)
    if dist.get_rank() == 0:
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step']}: loss {entry['loss']:.4f}")
    if started:
        dist.destroy_process_group()
    return trainer


if __name__ == "__main__":
    main()
