"""Tiny GPT-2-like and LLaMA-like modules built from torch.nn (no downloads), with their
parameter names as Hugging Face writes them, for ``shardlang init --model`` in the tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

VOCAB, CONTEXT, WIDTH, LAYERS = 13, 6, 8, 2


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class GPT2Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.ModuleDict({"c_attn": nn.Linear(WIDTH, 3 * WIDTH), "c_proj": nn.Linear(WIDTH, WIDTH)})
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(WIDTH, 4 * WIDTH), "c_proj": nn.Linear(4 * WIDTH, WIDTH)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn["c_attn"](self.ln_1(x)).split(WIDTH, dim=-1)
        x = x + self.attn["c_proj"](_attend(q, k, v))
        return x + self.mlp["c_proj"](functional.gelu(self.mlp["c_fc"](self.ln_2(x))))


class GPT2Like(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.h = nn.ModuleList(GPT2Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[-1]))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T  # tied output head


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
    return GPT2Like()


def llama_like() -> nn.Module:
    torch.manual_seed(0)
    return LlamaLike()


def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over a batch of token rows."""
    logits = model(tokens[:, :-1])
    return functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
