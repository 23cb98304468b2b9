"""An lr scheduler's and a data loader's state in runtime.checkpoint (runtime/checkpoint/objects.py).

Four gloo ranks train a tiny MLP for 3 steps with ShardedAdamW, a warm-up LambdaLR and a data
loader that counts the batches it gave, and save them all; two ranks load them into fresh
objects and train 2 more steps: the parameters equal torch.optim.AdamW with the same scheduler
trained 5 steps without a break, bit for bit (the lr and the data position both resumed). A
state that differs by rank loads on as many ranks, each its own, and is refused on two.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.checkpoint import CheckpointError
from runtime.checkpoint.fields import Fields
from runtime.checkpoint.objects import decode, encode
from runtime.testing import run_ranks
from tests.test_dcp_dist import model_at_start, state_of, zero_spec

BEFORE, AFTER = 3, 2
LR = 1e-2


class Batches:
    """The same batch on every rank, from a position it keeps (a loader's state)."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            self.position += 1  # counts the batches handed out
            yield torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 + self.position))

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class RankShare:
    """A state that differs by rank: a sampler's position in its rank's share."""

    def __init__(self, rank: int) -> None:
        self.state: dict[str, Any] = {"rank": rank, "offsets": (rank, 2 * rank)}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def warmup(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, data: Batches, steps: int) -> None:
    batches = iter(data)
    for _ in range(steps):
        optimizer.zero_grad()
        model(next(batches)).square().mean().backward()
        optimizer.step()
        scheduler.step()


def _save_on_four(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from runtime import checkpoint
    from runtime.optim import ShardedAdamW

    model = model_at_start()
    optimizer = ShardedAdamW(model.named_parameters(), zero_spec(4), lr=LR)
    scheduler, data = warmup(optimizer), Batches()
    train(model, optimizer, scheduler, data, BEFORE)
    objects = {"scheduler": scheduler, "data": data, "share": RankShare(rank)}
    checkpoint.save(folder, optimizer=optimizer, objects=objects)
    share = RankShare(-1)
    checkpoint.load(folder, objects={"share": share})
    return {"share": share.state, "metadata": checkpoint.read_metadata(Path(folder))[0].objects}


def _load_on_two(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from runtime import checkpoint
    from runtime.optim import ShardedAdamW

    model = torch.nn.Sequential(torch.nn.Linear(16, 30), torch.nn.Tanh(), torch.nn.Linear(30, 4))
    optimizer = ShardedAdamW(model.named_parameters(), zero_spec(2), lr=LR)
    scheduler, data = warmup(optimizer), Batches()
    try:
        checkpoint.load(folder, optimizer=optimizer, objects={"data": data, "share": RankShare(rank)})
        refused = ""
    except CheckpointError as e:
        refused = str(e)
    unchanged = data.position == 0 and scheduler.last_epoch == 0
    checkpoint.load(folder, optimizer=optimizer, objects={"scheduler": scheduler, "data": data})
    resumed = {"position": data.position, "last_epoch": scheduler.last_epoch, "lr": optimizer.param_groups[0]["lr"]}
    train(model, optimizer, scheduler, data, AFTER)
    return {"refused": refused, "unchanged": unchanged, "resumed": resumed, "params": state_of(model)}


@pytest.mark.slow
def test_scheduler_and_data_loader_resume_on_two_ranks(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpt")
    saved = run_ranks(_save_on_four, 4, (folder,), timeout=120)
    assert [out["share"]["rank"] for out in saved] == [0, 1, 2, 3]  # each rank its own
    assert saved[0]["share"]["offsets"] == (0, 0) and saved[3]["share"]["offsets"] == (3, 6)  # a tuple still
    stored = saved[0]["metadata"]
    assert {name: set(entry) for name, entry in stored.items()} == {
        "scheduler": {"same"},
        "data": {"same"},
        "share": {"ranks"},
    }
    loaded = run_ranks(_load_on_two, 2, (folder,), timeout=120)

    model = model_at_start()
    reference = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler, data = warmup(reference), Batches()
    train(model, reference, scheduler, data, BEFORE + AFTER)
    want = state_of(model)
    for out in loaded:
        assert "saved with a state per rank" in out["refused"] and "on 4 ranks" in out["refused"]
        assert out["unchanged"]  # the refused load changed nothing
        assert out["resumed"] == {"position": BEFORE, "last_epoch": BEFORE, "lr": LR}
        for name, tensor in want.items():
            assert torch.equal(out["params"][name], tensor), name


def test_states_encode_exactly() -> None:
    value = {"a": [1, 2.5, None], 3: (True, "x"), "nested": {"inf": math.inf, "t": ()}, (1, 2): []}
    text = encode(value, "objects['x']")
    assert decode(text, Fields("test"), "objects") == value
    assert decode(encode(math.nan, "x"), Fields("test"), "x") != decode(encode(math.nan, "x"), Fields("test"), "x")


def test_states_of_other_kinds_are_refused() -> None:
    with pytest.raises(CheckpointError, match=r"objects\['s'\]\.w is a Tensor"):
        encode({"w": torch.zeros(2)}, "objects['s']")
    with pytest.raises(CheckpointError, match="must have one key"):
        decode({"list": [], "dict": []}, Fields("metadata.json"), "objects.s")
