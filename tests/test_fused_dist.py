"""``ShardedAdamW(fused=True)`` on 2 gloo ranks against ``torch.optim.AdamW(fused=True)`` on the
CPU, where torch has the fused kernel too: the same bits, with ZeRO rows and flat chunks
(``tests/test_cuda.py`` runs the same cases on CUDA)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.optim import OptimizerError, ShardedAdamW
from runtime.testing import run_ranks
from tests.test_cuda import SHAPES, _spec, _train_against_reference


def _cases(rank: int, world_size: int) -> dict[str, Any]:
    return {states: _train_against_reference(world_size, "adamw", states, "fused") for states in ("rows", "flat")}


@pytest.mark.slow
def test_fused_matches_torch_fused_bit_for_bit() -> None:
    for rank, got in enumerate(run_ranks(_cases, 2, timeout=120)):
        for states, result in got.items():
            assert result["devices"] == ["cpu"]
            worst = max(result["diff"].items(), key=lambda item: item[1])
            assert worst[1] == 0.0, f"rank {rank} {states}: {worst[0]} differs by {worst[1]:g}"


def test_fused_refuses_a_transactional_step() -> None:
    params = [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in SHAPES.items()]
    with pytest.raises(OptimizerError, match="fused=True updates the states in place"):
        ShardedAdamW(params, _spec(1, "rows"), fused=True, transactional=True)
