"""Train a small character model with FSDP2 over TP on 4 CPU ranks, with the sharded CAME.

    torchrun --standalone --nproc-per-node 4 examples/train_fsdp_tp.py [--steps 40]

The ranks form a [dp=2, tp=2] DeviceMesh. The model's MLP is tensor parallel over tp
(``ColwiseParallel`` then ``RowwiseParallel``), and ``fully_shard`` then shards every
parameter over dp as well: the MLP's weights become DTensors on both axes, the first one
placed ``(_StridedShard(dim=0, sf=2), Shard(dim=0))``, which shardlang reads as the nesting
order tp-then-dp (``S(tp,dp),R``). ShardedCAME takes the parameters as they are, with no spec:
FSDP2 has already reduced the gradients, so its step is CAME's math on the local shards plus
the all-reduces that complete CAME's row and column statistics. Each dp pair of ranks trains
on its own micro-batch. Rank 0 prints per step the loss (mean over dp), the bytes it sent in
the optimizer step as measured, the bytes planned, and the collectives that ran (all of them
statistics all-reduces here).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import runtime
from runtime.optim import ShardedCAME
from shardlang.interop import from_dtensor

VOCAB, CONTEXT, WIDTH = 97, 16, 32
TEXT = """\
FSDP2 shards every parameter over the data parallel ranks; tensor parallelism has already
split the MLP's weights over the tensor parallel ranks. Each weight then lies on both mesh
axes, split first over tp and then, inside each tp piece, over dp: a nesting order that
DTensor writes with a strided shard placement and shardlang writes as S(tp,dp).
"""


def encode(text: str) -> torch.Tensor:
    """Printable ASCII to 0..94, newline to 95, anything else to 96."""
    return torch.tensor([ord(c) - 32 if " " <= c <= "~" else 95 if c == "\n" else 96 for c in text])


class CharMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(WIDTH, 4 * WIDTH), "c_proj": nn.Linear(4 * WIDTH, WIDTH)})
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        x = x + self.mlp["c_proj"](functional.gelu(self.mlp["c_fc"](x)))
        return self.head(x)


def micro_batch(data: torch.Tensor, step: int, dp_rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    starts = torch.randint(0, len(data) - CONTEXT - 1, (size,), generator=gen)
    windows = torch.stack([data[s : s + CONTEXT + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="sequences per dp rank and step")
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same initial model on every rank
    model = CharMLP()
    parallelize_module(model, mesh["tp"], {"mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = ShardedCAME(model.named_parameters(), None, lr=args.lr)
    data = encode(TEXT)
    dp_rank = mesh.get_local_rank("dp")
    if rank == 0:
        weight = model.mlp["c_fc"].weight
        print(f"mlp.c_fc.weight: {weight.placements} -> {from_dtensor(weight)}")
        print(f"{'step':>4} {'loss':>7} {'sent (B)':>10} {'planned (B)':>12} {'collectives':>11}")
    for step in range(1, args.steps + 1):
        tokens, targets = micro_batch(data, step, dp_rank, args.batch)
        optimizer.zero_grad()
        loss = functional.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        planned = optimizer.planned_traffic()
        with runtime.recording() as log:
            optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= dist.get_world_size()  # the tp ranks of a dp rank hold the same loss
        if not math.isfinite(mean_loss.item()):
            raise SystemExit(f"the loss is {mean_loss.item()} at step {step}")
        if rank == 0:
            sent, collectives = f"{log.total_bytes:>10,}", f"{len(log.records):>11}"
            print(f"{step:>4} {mean_loss.item():>7.3f} {sent} {planned.bytes:>12,} {collectives}", flush=True)
    if rank == 0:
        print(f"optimizer state on rank 0: {optimizer.state_bytes():,} bytes")


if __name__ == "__main__":
    main()  # an error on a rank propagates (torchrun then stops the others)
    runtime.shutdown()
