"""Full state dicts in torch's formats, on 4 gloo ranks: a job moves from our optimizers to
torch.optim.AdamW / came_pytorch.CAME and back, and continues as if it had not moved (AdamW
bit for bit, CAME within 1e-5 relative in fp32), with ZeRO-sharded and flat ZeRO states.

The references (torch's optimizers continuing, and the runs the ranks load) run here, in the
test process, on the whole tensors; gradients are the same whole tensors on every rank.
"""

from __future__ import annotations

import copy
from typing import Any

import came_pytorch
import pytest
import torch

from runtime.testing import run_ranks
from tests.optim_support import ADAMW, CAME, DP4, SHAPES, _dims, _spec, initial_params, step_grads

BEFORE, AFTER = 3, 3  # steps before the move, and after it
SEED = 21
KINDS = [("adamw", None), ("adamw", "dp"), ("came", None), ("came", "dp")]


def _zero(n: int) -> tuple[str, str, str]:
    return _dims(n, {}), _dims(n, {}), _dims(n, {0: "S(dp)"})


def grads(step: int) -> dict[str, torch.Tensor]:
    return {name: grad for name, (grad, _) in step_grads(torch.float32, SEED, step).items()}


def torch_optimizer(kind: str, params: dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    named = list(params.items())
    if kind == "adamw":
        return torch.optim.AdamW(named, foreach=False, **ADAMW)
    return came_pytorch.CAME(named, **CAME)


def torch_run(kind: str, params: dict[str, torch.Tensor], steps: range, state: dict | None = None) -> tuple:
    """The torch optimizer over ``steps`` from ``params`` (and ``state``): its parameters and
    its state dict."""
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in params.items()}
    optimizer = torch_optimizer(kind, ref)
    if state is not None:
        optimizer.load_state_dict(copy.deepcopy(state))  # torch would step the tensors given in place
    for step in steps:
        for name, grad in grads(step).items():
            ref[name].grad = grad.clone()
        optimizer.step()
    return {n: p.detach().clone() for n, p in ref.items()}, optimizer.state_dict()


def _ranks(rank: int, world_size: int, torch_states: dict) -> dict[Any, Any]:
    from runtime.optim import ShardedAdamW, ShardedCAME

    spec = _spec(DP4, _zero)
    out: dict[Any, Any] = {}
    for kind, flat_axis in KINDS:
        cls, hyper = (ShardedAdamW, ADAMW) if kind == "adamw" else (ShardedCAME, CAME)

        def steps(optimizer: Any, params: dict, span: range) -> None:
            for step in span:
                for name, grad in grads(step).items():
                    params[name].grad = grad.clone()
                optimizer.step()

        # Ours, moved out after BEFORE steps: the full state dict, and ours continuing.
        params = {n: torch.nn.Parameter(t) for n, t in initial_params(torch.float32, SEED).items()}
        ours = cls(list(params.items()), spec, flat_axis=flat_axis, **hyper)
        steps(ours, params, range(BEFORE))
        full = ours.full_state_dict()
        moved_params = {n: p.detach().clone() for n, p in params.items()}
        steps(ours, params, range(BEFORE, BEFORE + AFTER))
        # Back in: a fresh optimizer of ours loads it and continues.
        again = {n: torch.nn.Parameter(t.clone()) for n, t in moved_params.items()}
        reloaded = cls(list(again.items()), spec, flat_axis=flat_axis, **hyper)
        reloaded.load_full_state_dict(full)
        steps(reloaded, again, range(BEFORE, BEFORE + AFTER))
        # Torch's state dict, moved in: ours loads it and continues.
        torch_params, torch_state = torch_states[kind]
        moved_in = {n: torch.nn.Parameter(t.clone()) for n, t in torch_params.items()}
        loaded = cls(list(moved_in.items()), spec, flat_axis=flat_axis, **hyper)
        loaded.load_full_state_dict(torch_state)
        steps(loaded, moved_in, range(BEFORE, BEFORE + AFTER))
        out[(kind, flat_axis)] = {
            "full": full,
            "moved_params": moved_params,
            "continued": {n: p.detach().clone() for n, p in params.items()},
            "reloaded": {n: p.detach().clone() for n, p in again.items()},
            "torch_in": {n: p.detach().clone() for n, p in moved_in.items()},
        }
    return out


@pytest.fixture(scope="module")
def torch_states() -> dict[str, tuple]:
    start = initial_params(torch.float32, SEED)
    return {kind: torch_run(kind, start, range(BEFORE)) for kind in ("adamw", "came")}


@pytest.fixture(scope="module")
def ranks(torch_states: dict) -> list[dict[Any, Any]]:
    return run_ranks(_ranks, 4, (torch_states,), timeout=180)


def _assert_same(kind: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    for name in SHAPES:
        if kind == "adamw":
            assert torch.equal(got[name], want[name]), f"{label}, {name}: {(got[name] - want[name]).abs().max()}"
        else:
            error = ((got[name] - want[name]).abs().max() / want[name].abs().max()).item()
            assert error <= 1e-5, f"{label}, {name}: relative error {error:.3g}"


@pytest.mark.parametrize(("kind", "flat_axis"), KINDS)
def test_ours_moved_to_torch_continues_as_ours(ranks: list, kind: str, flat_axis: str | None) -> None:
    for rank in ranks:
        run = rank[(kind, flat_axis)]
        continued, _ = torch_run(kind, run["moved_params"], range(BEFORE, BEFORE + AFTER), run["full"])
        _assert_same(kind, continued, run["continued"], "torch continuing from our full state dict")
        _assert_same("adamw", run["reloaded"], run["continued"], "ours reloading our full state dict")


@pytest.mark.parametrize(("kind", "flat_axis"), KINDS)
def test_torch_moved_to_ours_continues_as_torch(
    ranks: list, torch_states: dict, kind: str, flat_axis: str | None
) -> None:
    torch_params, torch_state = torch_states[kind]
    continued, _ = torch_run(kind, torch_params, range(BEFORE, BEFORE + AFTER), torch_state)
    for rank in ranks:
        _assert_same(kind, rank[(kind, flat_axis)]["torch_in"], continued, "ours continuing from torch's state dict")


def test_the_full_state_dict_is_torchs_own(ranks: list, torch_states: dict) -> None:
    """Ours after 3 steps holds what torch's AdamW holds after the same 3 steps, in its format:
    the same keys, steps and group keys, and (AdamW being exact) the same tensors."""
    _, want = torch_states["adamw"]
    for rank in ranks:
        got = rank[("adamw", "dp")]["full"]
        # The reference asks for foreach=False; ours writes torch's default, None (also the
        # single-tensor loop on CPU).
        assert [g | {"foreach": False} for g in got["param_groups"]] == want["param_groups"]
        assert got["state"].keys() == want["state"].keys()
        for index, entry in want["state"].items():
            assert got["state"][index].keys() == entry.keys()
            for key, value in entry.items():
                assert torch.equal(got["state"][index][key], value), (index, key)
