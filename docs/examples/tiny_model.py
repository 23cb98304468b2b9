"""A tiny GPT-2-like module for the docs' `shardlang init --model` examples.

A Hugging Face model works the same way: a factory of no arguments that returns the module,
e.g. ``lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2))``.
"""

from torch import nn


def build() -> nn.Module:
    """Embeddings, two blocks of attention and MLP weights with LayerNorms, as GPT-2 names them."""
    blocks = nn.ModuleList(
        nn.ModuleDict(
            {
                "ln_1": nn.LayerNorm(32),
                "attn": nn.ModuleDict({"c_attn": nn.Linear(32, 96), "c_proj": nn.Linear(32, 32)}),
                "ln_2": nn.LayerNorm(32),
                "mlp": nn.ModuleDict({"c_fc": nn.Linear(32, 128), "c_proj": nn.Linear(128, 32)}),
            }
        )
        for _ in range(2)
    )
    embeddings = {"wte": nn.Embedding(100, 32), "wpe": nn.Embedding(16, 32)}
    return nn.ModuleDict({**embeddings, "h": blocks, "ln_f": nn.LayerNorm(32)})
