"""A training loop with Hugging Face accelerate and ShardedAdamW (docs/stacks/huggingface.md).

    torchrun --standalone --nproc-per-node 4 examples/train_accelerate.py --steps 4

``accelerator.prepare`` wraps the model in DDP, which averages the gradients: the spec is ZeRO-1
(whole gradients, each rank keeping 1/N of every state). The optimizer is built from the model
before ``prepare`` wraps it (names without ``module.``); ``prepare`` wraps the optimizer too, and
``step()`` goes through to it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from accelerate import Accelerator

import shardlang
from runtime.optim import ShardedAdamW

MakeOptimizer = Callable[[torch.nn.Module], torch.optim.Optimizer]


def sharded_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    spec = shardlang.spec_for(model.named_parameters(), f"world = [dp={dist.get_world_size()}]", "zero1")
    return ShardedAdamW(model.named_parameters(), spec, lr=1e-2)


def train(make_optimizer: MakeOptimizer, steps: int) -> tuple[torch.nn.Module, list[float]]:
    """The model after ``steps`` steps and the losses on this rank."""
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    optimizer = make_optimizer(model)
    inputs = torch.randn(256, 16, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs), batch_size=8)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    losses = []
    for step, (x,) in enumerate(data):
        if step == steps:
            break
        loss = model(x).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return accelerator.unwrap_model(model), losses


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    _, losses = train(sharded_adamw, args.steps)
    if dist.get_rank() == 0:
        print(" ".join(f"{loss:.4f}" for loss in losses))


if __name__ == "__main__":
    main()
