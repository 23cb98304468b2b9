"""accelerate with its FSDP2 plugin and ShardedAdamW over the sharded parameters (docs/stacks/huggingface.md).

    torchrun --standalone --nproc-per-node 4 examples/train_accelerate_fsdp2.py --steps 2 --save out/fsdp2
    torchrun --standalone --nproc-per-node 2 examples/train_accelerate_fsdp2.py --steps 2 --resume out/fsdp2

FSDP2 shards every parameter over the ranks (a DTensor, rows split: ``S(dp),R``) and
reduce-scatters the gradients itself, so the optimizer's spec is ZeRO-3: each rank updates its
rows and keeps their states (``spec_for(..., "zero3")``: the first dim the ranks divide, FSDP2's
too). ``prepare_fsdp2`` prepares the model first, builds the optimizer over the sharded
parameters, then prepares it with the model and the data. The checkpoint is
``torch.distributed.checkpoint``'s: the model's and the optimizer's DTensors, loaded on any
number of ranks (``--resume``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import shardlang
from runtime.optim import ShardedAdamW
from runtime.optim.dcp import OptimizerState
from runtime.stacks.fsdp2 import check_spec, prepare_fsdp2

MakeOptimizer = Callable[[torch.nn.Module], torch.optim.Optimizer]
BATCH = 32  # the global batch: each rank takes BATCH / ranks samples a step (the same samples on 4 or 2)


def fsdp2_accelerator() -> Accelerator:
    """An Accelerator with the FSDP2 plugin. accelerate (1.16) takes the plugin only on GPUs and
    other accelerators; on CPU it sets DistributedType.MULTI_CPU and wraps the model in DDP,
    saying nothing. On CPU (gloo) this sets the type accelerate would have set, so that
    ``prepare`` runs its own FSDP2 path (``fully_shard`` runs on gloo)."""
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(fsdp_plugin=plugin)
    if not accelerator.is_fsdp2:
        take_fsdp_plugin_on_cpu(plugin)
    return accelerator


def take_fsdp_plugin_on_cpu(plugin: FullyShardedDataParallelPlugin) -> None:
    """Set the distributed type and plugin that accelerate sets on GPUs (its state is shared:
    every Accelerator of the process, the Trainer's too, runs FSDP from then on)."""
    from accelerate.state import AcceleratorState, PartialState

    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin


def sharded_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """ShardedAdamW over the FSDP2-sharded (DTensor) parameters, its states where the spec says."""
    spec = shardlang.spec_for(model.named_parameters(), f"world = [dp={dist.get_world_size()}]", "zero3")
    check_spec(model.named_parameters(), spec)
    return ShardedAdamW(model.named_parameters(), spec, lr=1e-2)


def torch_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def train(
    make_optimizer: MakeOptimizer, steps: int, *, save: str | None = None, resume: str | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[float]]:
    """The model and the optimizer after ``steps`` more steps, and this rank's losses; loaded
    from the checkpoint ``resume`` first (going on with the batches after those it saw),
    saved to ``save`` after."""
    accelerator = fsdp2_accelerator()
    inputs = torch.randn(BATCH * 16, 16, generator=torch.Generator().manual_seed(1))
    per_rank = BATCH // accelerator.num_processes
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs), batch_size=per_rank)
    model, optimizer, data = prepare_fsdp2(accelerator, tiny_model(), make_optimizer, data)
    start = 0
    if resume is not None:
        state = {"model": get_model_state_dict(model), "optim": OptimizerState(optimizer.optimizer)}
        dcp.load(state, checkpoint_id=resume)  # into this world size's shards
        set_model_state_dict(model, state["model"])
        start = optimizer.optimizer.held_tensors()[0].step
    losses = []
    for step, (x,) in enumerate(data):
        if step == start + steps:
            break
        if step < start:
            continue
        loss = model(x).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if save is not None:
        dcp.save(
            {"model": get_model_state_dict(model), "optim": OptimizerState(optimizer.optimizer)}, checkpoint_id=save
        )
    return model, optimizer, losses


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="steps to train (after those resumed)")
    parser.add_argument("--save", help="a folder to save model and optimizer to (DCP)")
    parser.add_argument("--resume", help="a folder saved by --save, on any number of ranks")
    args = parser.parse_args(argv)
    _, _, losses = train(sharded_adamw, args.steps, save=args.save, resume=args.resume)
    if dist.get_rank() == 0:
        print(" ".join(f"{loss:.4f}" for loss in losses))


if __name__ == "__main__":
    main()
