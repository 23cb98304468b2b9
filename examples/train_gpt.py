"""Train a tiny GPT data-parallel on CPU ranks, its optimizer states laid out by a spec file.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py [--steps 40]
        [--optimizer came|adamw] [--flat-axis dp] [--spec examples/tiny_gpt_dp4.shard]

Every rank trains on its own micro-batch of characters of a short text. The sharded
optimizer reshards each gradient (a pending mean over dp) into its state layout, updates its
shards, and reshards the parameter back, as the spec says. Rank 0 prints per step the loss
(mean over ranks), the bytes it sent in the optimizer step as measured by the runtime, the
bytes the planner predicted, and how many collectives ran (of which statistics all-reduces).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import runtime
import shardlang
from runtime.optim import ShardedAdamW, ShardedCAME

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 97, 30, 36, 3, 2
TEXT = """\
A layout says how a tensor lies on a mesh of devices: which mesh axes split which of its
dimensions, and over which axes it is still a pending sum. The planner finds the cheapest
collectives that take a tensor from one layout to another, and the runtime runs them. An
optimizer step is three such moves and some arithmetic: the gradient goes from its layout to
the layout of the optimizer states, the states are updated where they lie, and the new
parameter goes back to its own layout. Split the states over the data parallel ranks and
each rank keeps a quarter of them; the gradient arrives with one reduce-scatter and the
parameter leaves with one all-gather, the same bytes a plain all-reduce would have sent.
"""


def encode(text: str) -> torch.Tensor:
    """Printable ASCII to 0..94, newline to 95, anything else to 96."""
    return torch.tensor([ord(c) - 32 if " " <= c <= "~" else 95 if c == "\n" else 96 for c in text])


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.ModuleDict({"c_attn": nn.Linear(width, 3 * width), "c_proj": nn.Linear(width, width)})
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(width, 4 * width), "c_proj": nn.Linear(4 * width, width)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.attn["c_attn"](self.ln_1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn["c_proj"](y.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp["c_proj"](functional.gelu(self.mlp["c_fc"](self.ln_2(x))))


class TinyGPT(nn.Module):
    """GPT-2's modules and parameter names (``h.0.attn.c_attn.weight``, ...), at a tiny size."""

    def __init__(
        self, vocab: int = VOCAB, context: int = CONTEXT, width: int = WIDTH, heads: int = HEADS, layers: int = LAYERS
    ) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T  # the output head is tied to the embedding


def micro_batch(data: torch.Tensor, step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    starts = torch.randint(0, len(data) - CONTEXT - 1, (size,), generator=gen)
    windows = torch.stack([data[s : s + CONTEXT + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--optimizer", choices=("came", "adamw"), default="came")
    parser.add_argument("--flat-axis", default=None, help="keep states as flat chunks over this mesh axis")
    parser.add_argument("--spec", default=str(Path(__file__).with_name("tiny_gpt_dp4.shard")))
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: 1e-3 for came, 3e-3 for adamw)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    model = TinyGPT()
    spec = shardlang.load_spec(args.spec)
    lr = args.lr if args.lr is not None else 1e-3 if args.optimizer == "came" else 3e-3
    if args.optimizer == "came":
        optimizer = ShardedCAME(model.named_parameters(), spec, lr=lr, flat_axis=args.flat_axis)
    else:
        optimizer = ShardedAdamW(model.named_parameters(), spec, lr=lr, weight_decay=0.0, flat_axis=args.flat_axis)
    data = encode(TEXT)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"tiny GPT: {params:,} parameters on {world} ranks, {args.optimizer}, spec {Path(args.spec).name}")
        print(f"{'step':>4} {'loss':>7} {'sent (B)':>10} {'planned (B)':>12} {'collectives':>11} {'of them sums':>12}")
    for step in range(1, args.steps + 1):
        tokens, targets = micro_batch(data, step, rank, args.batch)
        optimizer.zero_grad()
        loss = functional.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        planned = optimizer.planned_traffic()
        with runtime.recording() as log:
            optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        if not math.isfinite(mean_loss.item()):
            raise SystemExit(f"the loss is {mean_loss.item()} at step {step}")
        if rank == 0:
            print(
                f"{step:>4} {mean_loss.item():>7.3f} {log.total_bytes:>10,} {planned.bytes:>12,} "
                f"{len(log.records):>11} {optimizer.last_traffic.sum_collectives:>12}",
                flush=True,
            )
    if rank == 0:
        print(f"optimizer state on rank 0: {optimizer.state_bytes():,} bytes")


if __name__ == "__main__":
    main()  # an error on a rank propagates (torchrun then stops the others)
    runtime.shutdown()
