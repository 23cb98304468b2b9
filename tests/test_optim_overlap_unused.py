"""``overlap=True`` with parameters the model does not use: the buckets started during backward
were planned for every parameter that requires a gradient, so the step reduces the gradients
again without them. It must say so, naming the parameters, once, and step as without overlap."""

from __future__ import annotations

import warnings

import torch

import shardlang
from runtime.optim import ShardedAdamW

SPEC = shardlang.parse_spec("""
mesh world = [dp=1]
rule "*" {
  param = R,R over world
  grad  = R,R | P(dp):avg over world
  state = S(dp),R over world
}""")


def _run(overlap: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({name: torch.nn.Linear(8, 8, bias=False) for name in ("used", "unused", "idle")})
    optimizer = ShardedAdamW(model.named_parameters(), SPEC, overlap=overlap)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for step in range(3):
            torch.manual_seed(step)
            model["used"](torch.randn(4, 8)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, [str(w.message) for w in warned]


def test_unused_parameters_under_overlap_are_named_once_and_the_step_is_unchanged() -> None:
    plain, said_plain = _run(overlap=False)
    overlapped, said = _run(overlap=True)
    assert not said_plain
    assert len(said) == 1, said
    assert "'unused.weight' and 1 more got no gradient" in said[0], said[0]
    assert "without overlap" in said[0] and "requires_grad=False" in said[0], said[0]
    for name, param in plain.items():
        assert torch.equal(param, overlapped[name]), name
