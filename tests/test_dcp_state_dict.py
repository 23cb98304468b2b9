"""runtime.optim.dcp.get_optimizer_state_dict / set_optimizer_state_dict: torch's functions of
those names (torch.distributed.checkpoint.state_dict) for sharded optimizers too.

Two gloo ranks train a tiny MLP 2 steps with ShardedAdamW on ZeRO-2 states (its parameters
named as DDP names them, ``module.``), take its state dict with get_optimizer_state_dict
(keyed by the model's names, DTensors) and save it with dcp.save. A ShardedAdamW whose states
are replicated loads it through its own template and set_optimizer_state_dict: its whole states
and step counts must equal the first's, bit for bit, and both then step alike. torch's
optimizers go through to torch's functions (the same dict as theirs); options that ask for
whole or flattened states, a mix of both kinds and parameters the model lacks are errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.testing import run_ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 4))


def _spec(state: str) -> Any:
    import shardlang

    return shardlang.parse_spec(f"""
mesh world = [dp=2]
rule "*.weight" {{ param = R,R over world  grad = R,R | P(dp):avg over world  state = {state},R over world }}
rule "*.bias"   {{ param = R over world    grad = R | P(dp):avg over world    state = {state} over world }}
""")


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optimizer.step()


def _whole(optimizer: Any) -> dict[str, torch.Tensor]:
    full = optimizer.full_state_dict()
    return {f"{i}.{k}": v.clone() for i, entry in full["state"].items() for k, v in entry.items()}


def _on_two(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as torch_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from runtime.optim import ShardedAdamW
    from runtime.optim.dcp import get_optimizer_state_dict, set_optimizer_state_dict
    from runtime.testing import attempt

    model = _model()
    named = [(f"module.{n}", p) for n, p in model.named_parameters()]  # as DDP names them
    saved = ShardedAdamW(named, _spec("S(dp)"), lr=1e-2)
    _train(model, saved, range(2))
    state = get_optimizer_state_dict(model, saved)
    dcp.save({"model": model.state_dict(), "optim": state}, checkpoint_id=f"{folder}/ckpt")

    other = _model()
    loaded = ShardedAdamW(other.named_parameters(), _spec("R"), lr=0.5)  # other layouts, other lr
    template = {"model": other.state_dict(), "optim": get_optimizer_state_dict(other, loaded)}
    dcp.load(template, checkpoint_id=f"{folder}/ckpt")
    other.load_state_dict(template["model"])
    set_optimizer_state_dict(other, loaded, template["optim"])
    out: dict[str, Any] = {
        "keys": sorted(state["state"]),
        "placement": str(state["state"]["0.weight"]["exp_avg"].placements),
        "saved": _whole(saved),
        "loaded": _whole(loaded),
        "lr": loaded.param_groups[0]["lr"],
        "steps": [h.step for h in loaded.held_tensors()],
    }
    _train(model, saved, range(2, 3))
    _train(other, loaded, range(2, 3))
    out["after"] = [
        (a.detach().clone(), b.detach().clone()) for a, b in zip(model.parameters(), other.parameters(), strict=True)
    ]

    reference = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, reference, range(1))
    ours = get_optimizer_state_dict(model, reference)
    theirs = torch_state_dict.get_optimizer_state_dict(model, reference)
    out["torch_same"] = ours["param_groups"] == theirs["param_groups"] and all(
        torch.equal(v, theirs["state"][n][k]) for n, entry in ours["state"].items() for k, v in entry.items()
    )
    set_optimizer_state_dict(model, reference, ours)  # through to torch's

    errors = {
        "full": attempt(lambda: get_optimizer_state_dict(model, saved, options=StateDictOptions(full_state_dict=True))),
        "mixed": attempt(lambda: get_optimizer_state_dict(model, [saved, reference])),
        "names": attempt(lambda: get_optimizer_state_dict(torch.nn.Linear(8, 12), saved)),
    }
    out["errors"] = {k: (name, message) for k, (name, message, _) in errors.items()}
    return out


@pytest.mark.slow
def test_get_and_set_optimizer_state_dict_round_trip_a_sharded_optimizer_through_dcp(tmp_path: Path) -> None:
    for out in run_ranks(_on_two, 2, (str(tmp_path),), timeout=180):
        assert out["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]  # the model's names, no ``module.``
        assert out["placement"] == "(Shard(dim=0),)"
        assert out["saved"].keys() == out["loaded"].keys() and out["saved"]
        for key, want in out["saved"].items():
            assert torch.equal(out["loaded"][key], want), key
        assert out["lr"] == 1e-2 and out["steps"] == [2, 2, 2, 2]
        for a, b in out["after"]:
            assert torch.equal(a, b), "the loaded optimizer steps otherwise than the saved one"
        assert out["torch_same"]
        errors = out["errors"]
        assert errors["full"][0] == "DCPLayoutError" and "full_state_dict()" in errors["full"][1]
        assert errors["mixed"][0] == "OptimizerError" and "not both" in errors["mixed"][1]
        assert errors["names"][0] == "OptimizerError" and "the model has not" in errors["names"][1]


def _torch_function_on_ours(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from runtime.optim import OptimizerError, ShardedAdamW

    model = _model()
    optimizer = ShardedAdamW(model.named_parameters(), _spec("S(dp)"), lr=1e-2)
    _train(model, optimizer, range(2))  # the step frees the gradients: torch would step it now
    before, params = _whole(optimizer), {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        get_optimizer_state_dict(model, optimizer)
        message = None
    except OptimizerError as e:
        message = str(e)
    return {
        "message": message,
        "states_same": all(torch.equal(v, _whole(optimizer)[k]) for k, v in before.items()),
        "params_same": all(torch.equal(params[n], p) for n, p in model.named_parameters()),
    }


@pytest.mark.slow
def test_torch_get_optimizer_state_dict_on_a_sharded_optimizer_is_refused_before_it_steps_it() -> None:
    for result in run_ranks(_torch_function_on_ours, 2, timeout=120):
        assert result["message"] is not None and "runtime.optim.dcp.get_optimizer_state_dict" in result["message"]
        assert result["states_same"] and result["params_same"], result
