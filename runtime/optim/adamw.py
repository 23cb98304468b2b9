"""AdamW on local shards: the arithmetic of ``torch.optim.AdamW``, op for op.

AdamW is elementwise, so on any shard it equals the single-device optimizer bit for bit when
it performs the same floating-point operations in the same order: decoupled weight decay
``p *= 1 - lr*wd``, ``m.lerp_(g, 1-beta1)``, ``v = v*beta2 + (1-beta2) g*g``, and
``p += -lr/(1-beta1^t) * m / (sqrt(v)/sqrt(1-beta2^t) + eps)`` (``_single_tensor_adam``).
Everything is computed out of place so that a failed step can be dropped.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from runtime.optim.base import ShardedOptimizer, Slot, SpecLike, Update, computed
from runtime.optim.errors import OptimizerError

ADAMW_STATES = ("exp_avg", "exp_avg_sq")


def adamw_update(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    states: Sequence[dict[str, torch.Tensor]],
    steps: Sequence[int],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """New parameters and states for one step; ``steps`` are the step numbers being taken
    (1 on the first step). Nothing passed in is modified."""
    if not params:
        return [], []
    beta1, beta2 = betas
    exp_avgs = [s["exp_avg"] for s in states]
    exp_avg_sqs = [s["exp_avg_sq"] for s in states]
    if weight_decay != 0:
        new_params = list(torch._foreach_mul(params, 1 - lr * weight_decay))
    else:
        new_params = [p.clone() for p in params]
    new_exp_avgs = list(torch._foreach_lerp(exp_avgs, grads, 1 - beta1))
    new_exp_avg_sqs = list(torch._foreach_mul(exp_avg_sqs, beta2))
    torch._foreach_addcmul_(new_exp_avg_sqs, grads, grads, 1 - beta2)
    step_sizes = [-(lr / (1 - beta1**t)) for t in steps]
    bias_correction2_sqrts = [(1 - beta2**t) ** 0.5 for t in steps]
    denoms = torch._foreach_sqrt(new_exp_avg_sqs)
    torch._foreach_div_(denoms, bias_correction2_sqrts)
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(new_params, new_exp_avgs, denoms, step_sizes)
    new_states = [{"exp_avg": m, "exp_avg_sq": v} for m, v in zip(new_exp_avgs, new_exp_avg_sqs, strict=True)]
    return new_params, new_states


class ShardedAdamW(ShardedOptimizer):
    """AdamW with every state in its tensor's state layout; equals ``torch.optim.AdamW``
    (decoupled weight decay, bias correction) bit for bit.

    ``named_params``: ``model.named_parameters()`` (or torch-style groups of named
    parameters). ``spec``: a parsed spec file (rules included) or a mapping from tensor name
    to :class:`~shardlang.spec.Layouts`; DTensor parameters may be left out of it.
    ``flat_axis``: keep every state as flat equal chunks over this mesh axis (flat ZeRO).
    ``state_dtype``: of states and math (default fp32, fp64 for fp64 parameters); lower
    precision parameters keep a master shard. ``timeout``: how long any collective may wait
    (seconds or a timedelta; default the runtime's, 5 minutes).
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]],
        spec: SpecLike = None,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        flat_axis: str | int | None = None,
        state_dtype: torch.dtype | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> None:
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0 or not all(0 <= b < 1 for b in betas):
            raise OptimizerError(
                f"invalid AdamW hyperparameters: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}"
            )
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(named_params, spec, defaults, flat_axis=flat_axis, state_dtype=state_dtype, timeout=timeout)

    def _initial_states(self, slot: Slot) -> dict[str, torch.Tensor]:
        assert slot.shard is not None
        device = slot.local_param().device
        return {name: torch.zeros(slot.shard.local_shape, dtype=slot.dtype, device=device) for name in ADAMW_STATES}

    def _updates(
        self,
        slots: Sequence[Slot],
        grads: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
        states: Sequence[dict[str, torch.Tensor]],
    ) -> list[Update]:
        results: list[Update | None] = [None] * len(slots)
        for group in self.param_groups:
            chosen = [i for i, slot in enumerate(slots) if slot.group is group]
            new_params, new_states = adamw_update(
                [params[i] for i in chosen],
                [grads[i] for i in chosen],
                [states[i] for i in chosen],
                [slots[i].step + 1 for i in chosen],
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
            )
            for i, param, state in zip(chosen, new_params, new_states, strict=True):
                results[i] = computed(param, state)
        return [r for r in results if r is not None]
