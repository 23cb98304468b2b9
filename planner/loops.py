"""The training loops ``suggest`` chooses layouts for: which (param, grad, state) triples each
can run (README, "Choosing layouts"; docs/reference/planner.md, "Loops").

A tensor's roles (``planner.suggest``): its data-parallel axes ``D``, its compute layout ``C``
(the parameter without ``D``) and ``G0`` (its gradient as backward makes it, pending a mean over
``D``). What the loop gives the optimizer decides what it can hold:

- ``plain``: a plain module, no wrapper. Every rank holds the whole parameter ``C`` and backward
  leaves it the rank's own gradient, pending the mean ``G0`` that the optimizer's step reduces:
  ``(C, G0, s)`` for any state layout ``s`` (DDP-style and ZeRO-2 states).
- ``ddp``: DistributedDataParallel. Backward all-reduces the gradient, so it arrives as ``C``:
  ``(C, C, s)`` (ZeRO-1 states).
- ``fsdp2`` and ``fsdp2-tp``: ``fully_shard`` (over a tensor-parallel module: FSDP2 + TP). The
  parameter, its gradient and the states are the rank's shard of dim 0 over ``D`` (appended
  after the axes that already split dim 0, as FSDP2 splits a tensor-parallel shard):
  ``(X, X, X)``.
- ``any``: every triple ``planner.suggest`` builds (what a custom loop might run).

The spec's own layouts are always a candidate: they are what the user runs now.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardlang.layout import Layout
from shardlang.spec import Layouts

LOOPS = ("plain", "ddp", "fsdp2", "fsdp2-tp", "any")
AUTO = "auto"  # infer the loop from the spec (:func:`infer_loop`)


def fsdp_shard(compute: Layout, axes: Sequence[int]) -> Layout:
    """``compute`` with ``axes`` appended to the splits of dim 0: FSDP2's shard of it."""
    dims = tuple(dim + tuple(axes) if i == 0 else dim for i, dim in enumerate(compute.dims))
    return Layout(dims=dims, mesh=compute.mesh)


def runs_in(loop: str, layouts: Layouts, compute: Layout, g0: Layout, axes: Sequence[int]) -> bool:
    """Whether ``loop`` can run a tensor in ``layouts`` (module doc), given its roles."""
    param, grad, state = layouts.param, layouts.grad, layouts.state()
    if loop == "any" or not axes:
        return True
    if loop == "plain":
        return param == compute and grad == g0
    if loop == "ddp":
        return param == compute and grad == compute
    shard = fsdp_shard(compute, axes)
    return param == grad == state == shard


def infer_loop(roles: Sequence[tuple[Layouts, Layout, Layout, Sequence[int]]]) -> tuple[str, str]:
    """The loop a spec's tensors run in, from their layouts and roles ``(layouts, C, G0, D)``,
    and why; ``any`` where they do not agree on one (say ``--loop``)."""
    found: set[str] = set()
    tensor_parallel = False
    for layouts, compute, g0, axes in roles:
        if not axes:
            continue
        tensor_parallel = tensor_parallel or any(compute.dims)
        fits = [loop for loop in ("plain", "ddp", "fsdp2") if runs_in(loop, layouts, compute, g0, axes)]
        found.add(fits[0] if fits else "any")
    if not found:
        return "plain", "no tensor has a data-parallel axis"
    if len(found) > 1 or "any" in found:
        return "any", "the tensors' layouts fit no one loop"
    loop = found.pop()
    if loop == "fsdp2" and tensor_parallel:
        loop = "fsdp2-tp"
    why = {
        "plain": "every gradient arrives pending its mean over the data-parallel axes",
        "ddp": "every gradient arrives reduced and every parameter whole over the data-parallel axes",
        "fsdp2": "every parameter, gradient and state is its shard of dim 0 over the data-parallel axes",
        "fsdp2-tp": "every parameter, gradient and state is its shard of dim 0 over the data-parallel axes, "
        "beside tensor-parallel splits",
    }[loop]
    return loop, why
