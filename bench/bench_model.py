"""The benchmarks' language model, its data and its ZeRO specs (``bench_step.py``,
``bench_memory.py``): an embedding, causal ``nn.TransformerEncoderLayer`` blocks and a linear
head, built from ``torch.nn`` (no downloads), random tokens seeded per rank and step, and the
optimizers' hyperparameters every variant shares."""

from __future__ import annotations

import torch
from torch import nn

from shardlang import parse_layout
from shardlang.spec import Layouts

VOCAB, BATCH, SEQ, HEADS = 512, 4, 64, 4
MODELS = {"small": (128, 4, 512), "medium": (256, 8, 1024)}  # width, layers, feed-forward
ADAMW = {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}
CAME = {"lr": 1e-3, "weight_decay": 0.01}


class LanguageModel(nn.Module):
    """Embedding, causal ``nn.TransformerEncoderLayer`` blocks, a linear head (no bias)."""

    def __init__(self, width: int, layers: int, feed_forward: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, HEADS, feed_forward, dropout=0.0, batch_first=True) for _ in range(layers)
        )
        self.head = nn.Linear(width, VOCAB, bias=False)
        # A plain attribute, not a buffer: DDP would broadcast a buffer every forward.
        self.mask = nn.Transformer.generate_square_subsequent_mask(SEQ)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, src_mask=self.mask, is_causal=True)
        return self.head(x)


def build_model(name: str) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(*MODELS[name])


def tokens_for(step: int, rank: int) -> torch.Tensor:
    """This rank's batch at ``step``: inputs are ``[:, :-1]``, targets ``[:, 1:]``."""
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step * 1000 + rank))


def spec_for(model: nn.Module, world: int, matrix_state: str, vector_state: str) -> dict[str, Layouts]:
    """Replicated parameters, gradients pending a mean over dp, the given state layouts."""
    mesh = f"mesh[dp={world}]"
    spec = {}
    for name, p in model.named_parameters():
        dims, state = ("R,R", matrix_state) if p.dim() == 2 else ("R", vector_state)
        spec[name] = Layouts(
            param=parse_layout(f"{dims} over {mesh}"),
            grad=parse_layout(f"{dims} | P(dp):avg over {mesh}"),
            states=(("", parse_layout(f"{state} over {mesh}")),),
        )
    return spec
