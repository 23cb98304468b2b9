"""The optimizers check their spec against the parameters they are given when built, on every
rank (shardlang.model_check, the check of ``shardlang check --model``): a DDP-wrapped model's
``module.`` prefix and a misspelled declaration end in an OptimizerError naming them, on 2
gloo ranks, before anything is built; a rank's pieces of a sharded plain tensor are accepted."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.testing import run_ranks

ZERO2 = """mesh w = [dp=2]
tensor weight : f32[4, 4] { param = R,R over w  grad = R,R | P(dp):avg over w  state = S(dp),R over w }
tensor bias : f32[4] { param = R over w  grad = R | P(dp):avg over w  state = S(dp) over w }
"""


def _build(rank: int, world_size: int, case: str) -> Any:
    from runtime.optim import ShardedAdamW
    from runtime.optim.errors import OptimizerError
    from shardlang import parse_spec

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    spec, named = ZERO2, list(model.named_parameters())
    if case == "ddp":
        named = list(torch.nn.parallel.DistributedDataParallel(model).named_parameters())
    elif case == "typo":
        spec = ZERO2.replace("tensor weight", "tensor weigth")
    elif case == "pieces":  # ZeRO-3's plain pieces: each rank its rows
        spec = ZERO2.replace("param = R,R over w  grad = R,R | P(dp):avg", "param = S(dp),R over w  grad = S(dp),R")
        named = [("weight", torch.nn.Parameter(model.weight.detach()[2 * rank : 2 * rank + 2].clone()))]
        named.append(("bias", model.bias))
    try:
        ShardedAdamW(named, parse_spec(spec, "zero2.shard"), lr=1e-3)
    except OptimizerError as e:
        return str(e)
    return "built"


@pytest.mark.parametrize(
    ("case", "words"),
    [
        (
            "ddp",
            "the names carry the prefix 'module.' (DDP or DataParallel): 2 parameters of the model,"
            " e.g. 'module.weight' is 'weight' in the spec",
        ),
        ("typo", "zero2.shard:2:1: parameter 'weight' f32[4, 4] has no layouts: did you mean 'weigth'?"),
        ("pieces", None),
    ],
)  # fmt: skip
def test_the_spec_is_checked_against_the_parameters_when_built(case: str, words: str | None) -> None:
    got = run_ranks(_build, 2, (case,), timeout=120)
    if words is None:
        assert got == ["built", "built"]
    else:
        lead = "ShardedAdamW: the spec does not fit the model"
        assert all(text.startswith(lead) and words in text for text in got), got
