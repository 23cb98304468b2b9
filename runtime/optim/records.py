"""What the sharded optimizers tell the rest of the job: where each state lies, what a rank
holds (for checkpoints), what a step communicates, and the format of their state dicts.

Plain values, no optimizer behind them, so that the checkpoints (``runtime.checkpoint``), the
state dicts in torch's formats (``runtime.optim.full_state``) and DCP (``runtime.optim.dcp``)
read them without importing the optimizer that makes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from shardlang.layout import Layout

STATE_DICT_FORMAT = "shardlang.sharded_optimizer/1"


@attrs.frozen
class StateWhere:
    """Where a state lies: its layout and the global shape that layout divides, the base
    layout when it is a flat chunk of it, and the shape of the rank's piece."""

    layout: Layout
    shape: tuple[int, ...]
    flat_of: Layout | None
    local_shape: tuple[int, ...]

    def record(self) -> dict[str, Any]:
        return {
            "layout": str(self.layout),
            "mesh": self.layout.mesh.describe(),
            "shape": list(self.shape),
            "flat_of": None if self.flat_of is None else str(self.flat_of),
        }


@attrs.frozen(eq=False)
class HeldTensor:
    """One parameter as this rank's optimizer holds it (for checkpoints): its whole shape,
    param layout and local piece (a DTensor's local tensor; not a copy), and, for every
    state the optimizer keeps for it, where that state lies and its current value (none
    before the first step); states are of ``state_dtype``."""

    name: str
    shape: tuple[int, ...]
    param_layout: Layout
    param: torch.Tensor
    step: int
    state_dtype: torch.dtype
    wheres: Mapping[str, StateWhere]
    states: Mapping[str, torch.Tensor]


@attrs.frozen
class StepTraffic:
    """What one step communicates on this rank, as planned: bucket bytes and collectives
    (the step plan), statistics all-reduces and their bytes (``sums.plan_collectives``), and
    the all-reduce of the commit flag (``all_ranks_commit``), and whole matrices moved (Muon)."""

    reshard_bytes: int = 0
    reshard_collectives: int = 0
    sum_bytes: int = 0
    sum_collectives: int = 0
    commit_bytes: int = 0
    commit_collectives: int = 0
    # Whole matrices moved for an iteration over them (Muon's Newton-Schulz; runtime.optim.muon).
    matrix_bytes: int = 0
    matrix_collectives: int = 0

    @property
    def bytes(self) -> int:
        return self.reshard_bytes + self.sum_bytes + self.commit_bytes + self.matrix_bytes

    @property
    def collectives(self) -> int:
        return self.reshard_collectives + self.sum_collectives + self.commit_collectives + self.matrix_collectives
