"""Full state dicts in one process: a round trip through torch.optim.AdamW's state dict, and
every malformed dict refused with our error, changing nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from runtime.optim import OptimizerError, ShardedAdamW
from shardlang import parse_layout
from shardlang.spec import Layouts

HYPER = {"lr": 1e-2, "weight_decay": 0.1}


def _model() -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(5)
    return {
        "w": torch.nn.Parameter(torch.randn(4, 3, generator=gen)),
        "b": torch.nn.Parameter(torch.randn(3, generator=gen)),
    }


def _spec() -> dict[str, Layouts]:
    def lay(n: int) -> Layouts:
        layout = parse_layout(",".join("R" * n) + " over mesh[1]")
        return Layouts(param=layout, grad=layout, states=(("", layout),))

    return {"w": lay(2), "b": lay(1)}


def _step(params: dict, optimizer: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=gen)
    optimizer.step()


def test_a_round_trip_through_torch_continues_bit_for_bit() -> None:
    ours_params, ref_params = _model(), _model()
    ours = ShardedAdamW(list(ours_params.items()), _spec(), **HYPER)
    ref = torch.optim.AdamW(list(ref_params.items()), foreach=False, **HYPER)
    for step in range(3):
        _step(ours_params, ours, step)
        _step(ref_params, ref, step)
    moved = torch.optim.AdamW(list(ours_params.items()), foreach=False, **HYPER)
    moved.load_state_dict(copy.deepcopy(ours.full_state_dict()))
    back = ShardedAdamW(list(ref_params.items()), _spec(), **HYPER)
    back.load_full_state_dict(ref.state_dict())
    for step in range(3, 6):
        _step(ours_params, moved, step)  # ours' parameters, now under torch
        _step(ref_params, back, step)  # torch's parameters, now under ours
    for name in ours_params:
        assert torch.equal(ours_params[name], ref_params[name]), name


def _loaded_states(optimizer: ShardedAdamW) -> dict:
    return {n: {k: v.clone() for k, v in h.states.items()} for n, h in ((h.name, h) for h in optimizer.held_tensors())}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda sd: sd.pop("state"), "must have exactly the keys 'state' and 'param_groups'"),
        (lambda sd: sd["param_groups"][0]["params"].pop(), "has groups of [1] parameters, this optimizer [2]"),
        (lambda sd: sd["param_groups"][0].update(amsgrad=True), "has amsgrad=True; ShardedAdamW needs False"),
        (lambda sd: sd["param_groups"][0].update(param_names=["b", "w"]), "names the parameters ['b', 'w']"),
        (
            lambda sd: sd["state"][0].pop("exp_avg"),
            "tensor 'w', state 'exp_avg': the torch.optim.AdamW state dict holds None",
        ),
        (lambda sd: sd["state"][1].update(exp_avg_sq=torch.zeros(4)), "tensor 'b', state 'exp_avg_sq'"),
    ],
)
def test_what_load_full_state_dict_refuses(change, words: str) -> None:
    params = _model()
    optimizer = ShardedAdamW(list(params.items()), _spec(), **HYPER)
    _step(params, optimizer, 0)
    saved = optimizer.full_state_dict()
    before = _loaded_states(optimizer)
    change(saved)
    with pytest.raises(OptimizerError) as caught:
        optimizer.load_full_state_dict(saved)
    assert words in caught.value.message
    after = _loaded_states(optimizer)
    assert all(torch.equal(before[n][k], after[n][k]) for n in before for k in before[n])
