"""A training run in which one step gets a gradient of the wrong shape: that step must raise
:class:`runtime.optim.OptimizerStepError` on every rank and change nothing, and the run goes on
(the optimizers' failure tests share it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def run_with_a_wrong_gradient(
    optimizer: Any,
    params: dict[str, torch.nn.Parameter],
    set_grads: Callable[[int], None],
    name: str,
    wrong_shape: tuple[int, ...],
    *,
    steps: int = 8,
    at: int = 3,
) -> dict[str, Any]:
    """``steps`` steps, each after ``set_grads(step)``; at step ``at`` tensor ``name``'s gradient
    has ``wrong_shape`` for one ``step()``, then the right one for the next: what that step raised
    on this rank (``message``), whether every parameter was as before it (``unchanged``), and the
    parameters at the end."""
    from runtime.optim import OptimizerStepError

    message, unchanged = None, False
    for step in range(steps):
        set_grads(step)
        if step == at:
            good = params[name].grad.clone()
            params[name].grad.data = torch.zeros(wrong_shape)
            before = {n: p.detach().clone() for n, p in params.items()}
            try:
                optimizer.step()
            except OptimizerStepError as e:
                message = str(e)
            unchanged = all(torch.equal(before[n], p) for n, p in params.items())
            params[name].grad = good
        optimizer.step()
    return {"message": message, "unchanged": unchanged, "params": {n: p.detach().clone() for n, p in params.items()}}
