"""A training run in which one step gets a gradient of the wrong shape: that step must raise
:class:`runtime.optim.OptimizerStepError` on every rank naming the step and the tensor, change
no parameter or state, and the run goes on as if it had not been attempted. The sharded
optimizers' failure tests (AdamW, CAME, Adafactor, Muon) share the run and its checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tests.optim_support import CONFIGS, _spec, check_pieces, local_params, set_local_grads


def snapshot(optimizer: Any, params: dict[str, torch.nn.Parameter]) -> tuple[dict, dict]:
    """Copies of the parameters, and of every tensor's step and states, to compare with later."""
    states = {
        name: (entry["step"], {s: record["tensor"].clone() for s, record in entry["states"].items()})
        for name, entry in optimizer.state_dict()["tensors"].items()
    }
    return {n: p.detach().clone() for n, p in params.items()}, states


def unchanged_since(saved: tuple[dict, dict], optimizer: Any, params: dict[str, torch.nn.Parameter]) -> bool:
    """Whether the parameters, steps and states are those ``saved`` by :func:`snapshot`."""
    now = snapshot(optimizer, params)
    if saved[0].keys() != now[0].keys() or saved[1].keys() != now[1].keys():
        return False
    if not all(torch.equal(saved[0][n], now[0][n]) for n in saved[0]):
        return False
    for name, (step, states) in saved[1].items():
        now_step, now_states = now[1][name]
        if step != now_step or states.keys() != now_states.keys():
            return False
        if not all(torch.equal(t, now_states[s]) for s, t in states.items()):
            return False
    return True


def run_failed_step(
    rank: int,
    build: Callable[[list, dict], Any],
    seed: int,
    name: str,
    wrong_shape: tuple[int, ...],
    *,
    config: str = "nested_tp_dp",
    steps: int = 8,
    at: int = 3,
) -> dict[str, Any]:
    """``steps`` steps of the optimizer ``build(named_params, spec)`` makes on this rank's pieces
    of ``CONFIGS[config]`` (``seed``'s data, f32); at step ``at`` tensor ``name``'s gradient has
    ``wrong_shape`` for one ``step()`` (as a faulty gradient hook might leave it), then the right
    one for the next: what that step raised on this rank (``message``), whether every parameter
    and state was as before it (``unchanged``), and the parameters at the end."""
    from runtime.optim import OptimizerStepError

    spec = _spec(*CONFIGS[config][:2])
    coordinate = next(iter(spec.values())).param.mesh.coordinate(rank)
    params = local_params(spec, coordinate, torch.float32, seed)
    optimizer = build(list(params.items()), spec)
    message, unchanged = None, False
    for step in range(steps):
        set_local_grads(params, spec, coordinate, torch.float32, seed, step)
        if step == at:
            good = params[name].grad.clone()
            params[name].grad.data = torch.zeros(wrong_shape)
            saved = snapshot(optimizer, params)
            try:
                optimizer.step()
            except OptimizerStepError as e:
                message = str(e)
            unchanged = unchanged_since(saved, optimizer, params)
            params[name].grad = good
        optimizer.step()
    return {
        "message": message,
        "unchanged": unchanged,
        "coordinate": coordinate,
        "params": {n: p.detach().clone() for n, p in params.items()},
    }


def check_failed_step(
    ranks: list[dict[str, Any]],
    key: str,
    want: dict,
    name: str,
    against: str,
    *,
    config: str = "nested_tp_dp",
    at: int = 3,
) -> None:
    """Every rank's ``result[key]`` of :func:`run_failed_step`: the step raised naming itself and
    tensor ``name``, changed nothing, and the run ended where the reference ``want`` (the
    optimizer ``against``, full tensors, run without the failed step) ends."""
    spec = _spec(*CONFIGS[config][:2])
    for rank, result in enumerate(ranks):
        case = result[key]
        message = case["message"]
        assert message is not None and f"step {at + 1}" in message and f"'{name}'" in message, message
        assert case["unchanged"], f"rank {rank}: the failed step changed parameters or states"
        check_pieces(case, spec, want, torch.float32, f"after the failed step, rank {rank}", against)
