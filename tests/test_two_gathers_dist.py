"""A parameter leg of two gathers after the update (states ``S(dp),S(tp)`` of ``R,R``
parameters on ``[dp=2,tp=2]``): every bucket's results are written into the parameters as it
lands (the in-place step's write-through), but a leg only once its last gather has run. On 4
gloo ranks, ShardedAdamW equals torch.optim.AdamW bit for bit after 3 steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.testing import run_ranks
from tests.test_dcp_dist import model_at_start, tp_states_spec, train

LR = 1e-2


def _train(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    from runtime.optim import ShardedAdamW

    model = model_at_start()
    optimizer = ShardedAdamW(model.named_parameters(), tp_states_spec(), lr=LR, weight_decay=0.1)
    train(model, optimizer, range(3))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_an_in_place_step_writes_a_leg_of_two_gathers_after_its_last() -> None:
    model = model_at_start()
    train(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1), range(3))
    got: list[dict[str, Any]] = run_ranks(_train, 4, timeout=120)
    for rank, params in enumerate(got):
        for name, p in model.named_parameters():
            assert torch.equal(params[name], p.detach()), f"rank {rank} '{name}'"
