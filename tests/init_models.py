"""Tiny GPT-2-like and LLaMA-like modules built from torch.nn (no downloads), with their
parameter names as Hugging Face writes them, for ``shardlang init --model`` in the tests. The
GPT-2-like one is examples/train_gpt.py's model, smaller."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from tests.stack_support import example

VOCAB, CONTEXT, WIDTH, LAYERS = 13, 6, 8, 2


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class LlamaLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(WIDTH), nn.RMSNorm(WIDTH)
        self.self_attn = nn.ModuleDict(
            {p: nn.Linear(WIDTH, WIDTH, bias=False) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
        )
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(WIDTH, 3 * WIDTH, bias=False),
                "up_proj": nn.Linear(WIDTH, 3 * WIDTH, bias=False),
                "down_proj": nn.Linear(3 * WIDTH, WIDTH, bias=False),
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, h = self.self_attn, self.input_layernorm(x)
        x = x + a["o_proj"](_attend(a["q_proj"](h), a["k_proj"](h), a["v_proj"](h)))
        m, h = self.mlp, self.post_attention_layernorm(x)
        return x + m["down_proj"](functional.silu(m["gate_proj"](h)) * m["up_proj"](h))


class LlamaLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(VOCAB, WIDTH)
        self.model.layers = nn.ModuleList(LlamaLayer() for _ in range(LAYERS))
        self.model.norm = nn.RMSNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def gpt2_like() -> nn.Module:
    torch.manual_seed(0)
    return example("train_gpt.py").TinyGPT(VOCAB, CONTEXT, WIDTH, heads=2, layers=LAYERS)


def llama_like() -> nn.Module:
    torch.manual_seed(0)
    return LlamaLike()


def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over a batch of token rows."""
    logits = model(tokens[:, :-1])
    return functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
