"""Adafactor on local shards, exact: the arithmetic of ``torch.optim.Adafactor``, with every
statistic that spans ranks completed by a sum over the mesh axes the layout says it spans.

Per step ``t``, for a tensor ``[*batch, H, W]`` (factored: a batch of matrices), with
``beta_t = t ** beta2_decay``, ``rho_t = min(lr, 1/sqrt(t))`` and ``eps1`` (default: the
parameter dtype's machine epsilon)::

    alpha = max(eps2, RMS(p)) * rho_t            (of the parameter before the decay)
    r = lerp(r, mean_W g^2, beta_t);  c = lerp(c, mean_H g^2, beta_t)
    u = g * rsqrt(max(r c / max(mean_H r, eps1), eps1^2))
    p *= 1 - lr*wd;  p -= alpha / max(1, RMS(u) / d) * u

and for a tensor of fewer dims ``v = lerp(v, g^2, beta_t)``, ``u = g * rsqrt(max(v, eps1^2))``.

Sharded, the raw sums are completed first and divided by the true global counts, as CAME's
are (``runtime.optim.came``): the row normaliser ``mean_H r`` needs the rows of other ranks
when the rows are split, and because the EMA is linear ``sum_H r_new = (1-beta) sum_H r_old +
beta sum_HW g^2 / W``, whose two sums travel with the row and column sums. A step is two
phases of sums: the second moments with the parameter's norm, then the update's RMS;
``planner.statistics.phase_sums`` lists them, :func:`adafactor_update` computes them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Unpack

import attrs
import torch

from runtime.optim.base import ShardedOptimizer, StepOptions
from runtime.optim.errors import OptimizerError
from runtime.optim.phases import StepWork, Update
from runtime.optim.records import StateWhere
from runtime.optim.shards import StateShard
from runtime.optim.slots import Slot, SpecLike
from runtime.optim.states import statistic_where
from runtime.optim.sums import SumSpec, phase_sum_specs

PHASES = ("the second-moment sums and the parameter's norm", "the update's RMS")


@attrs.frozen
class AdafactorHyper:
    lr: float
    beta2_decay: float
    eps1: float
    eps2: float
    d: float
    weight_decay: float


def adafactor_state_shapes(shard: StateShard) -> dict[str, tuple[int, ...]]:
    """The local shape of every state, as ``torch.optim.Adafactor`` names them (the row and
    column statistics without torch's kept size-1 dim)."""
    if not shard.factored:
        return {"variance": shard.local_shape}
    return {"row_var": shard.row_stat_shape, "col_var": shard.col_stat_shape}


def adafactor_update(
    grad: torch.Tensor,
    param: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    shard: StateShard,
    hyper: AdafactorHyper,
    step: int,
    new_param: torch.Tensor,
    new: Mapping[str, torch.Tensor],
) -> Update:
    """Step ``step`` (1 on the first) on local data, as a generator: it yields the partial sums
    of each phase and is sent them completed; it writes the new parameter into ``new_param``
    and the new states into ``new``. Nothing passed in is modified."""
    beta = step**hyper.beta2_decay
    rho = min(hyper.lr, 1 / step**0.5)
    square = grad.square()
    param_square = torch.linalg.vector_norm(param).square().reshape(1)
    if shard.factored:
        row, col = state["row_var"], state["col_var"]
        sums = [param_square, shard.row_sums(square), shard.col_sums(square)]
        spans = shard.rows_span_ranks
        if spans:
            sums += [shard.matrix_sums(square), row.sum(-1)]
        completed = yield sums
        height, width = shard.shape[-2], shard.shape[-1]
        new_row = torch.lerp(row, completed[1] / width, beta, out=new["row_var"])
        new_col = torch.lerp(col, completed[2] / height, beta, out=new["col_var"])
        # Rows split: sum_H of the new rows from the sums (see the module doc).
        split = (completed[4] * (1.0 - beta) + completed[3] / width * beta) / height if spans else None
        norm = new_row.mean(dim=-1) if split is None else split
        factor = new_row / shard.matrices(norm.clamp(min=hyper.eps1))
        estimate = shard.rows(factor) * shard.cols(new_col)
    else:
        completed = yield [param_square]
        estimate = torch.lerp(state["variance"], square, beta, out=new["variance"]).clone()
    update = estimate.clamp_(min=hyper.eps1 * hyper.eps1).rsqrt_().mul_(grad)
    alpha = (completed[0].sqrt()[0] / math.sqrt(shard.numel)).clamp(min=hyper.eps2) * rho

    (update_square,) = yield [torch.linalg.vector_norm(update).square().reshape(1)]
    denom = (update_square.sqrt()[0] / (math.sqrt(shard.numel) * hyper.d)).clamp(min=1.0)
    if hyper.weight_decay != 0:
        torch.mul(param, 1 - hyper.lr * hyper.weight_decay, out=new_param)
    else:
        new_param.copy_(param)
    new_param.sub_(update.mul_(alpha / denom))


class ShardedAdafactor(ShardedOptimizer):
    """Adafactor with every state in its tensor's state layout; equals ``torch.optim.Adafactor``.

    Arguments as :class:`~runtime.optim.ShardedAdamW`, hyperparameters as
    ``torch.optim.Adafactor`` (``eps[0]`` ``None``: the parameter dtype's epsilon). With
    ``flat_axis``, each rank keeps the row and column statistics of its whole base block, as
    :class:`~runtime.optim.ShardedCAME` does.
    """

    phases = PHASES

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]],
        spec: SpecLike = None,
        *,
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        **options: Unpack[StepOptions],
    ) -> None:
        eps1, eps2 = eps
        if (
            not lr >= 0
            or not beta2_decay <= 0
            or not (eps1 is None or eps1 >= 0)
            or not eps2 >= 0
            or not d >= 1
            or not weight_decay >= 0
        ):
            raise OptimizerError(
                f"invalid Adafactor hyperparameters: lr={lr}, beta2_decay={beta2_decay}, eps={eps}, d={d}, "
                f"weight_decay={weight_decay}"
            )
        defaults = {"lr": lr, "beta2_decay": beta2_decay, "eps": (eps1, eps2), "d": d, "weight_decay": weight_decay}
        super().__init__(named_params, spec, defaults, **options)

    memory_kind = "adafactor"

    def _state_shapes(self, slot: Slot) -> dict[str, tuple[int, ...]]:
        assert slot.shard is not None
        return adafactor_state_shapes(slot.shard)

    def _sum_specs(self, slot: Slot) -> tuple[tuple[SumSpec, ...], ...]:
        assert slot.shard is not None
        return phase_sum_specs(slot.shard, "adafactor", slot.dtype, slot.name)

    def _state_where(self, slot: Slot, name: str) -> StateWhere:
        where = statistic_where(slot, name, ("row_var",), ("col_var",))
        return where if where is not None else super()._state_where(slot, name)

    def _updates(self, work: StepWork) -> list[Update]:
        updates = []
        for i, slot in enumerate(work.slots):
            assert slot.shard is not None
            group = slot.group
            eps1, eps2 = group["eps"]
            hyper = AdafactorHyper(
                lr=group["lr"],
                beta2_decay=group["beta2_decay"],
                # torch takes the default from the parameter's dtype, not the math's
                eps1=torch.finfo(slot.param.dtype).eps if eps1 is None else eps1,
                eps2=eps2,
                d=group["d"],
                weight_decay=group["weight_decay"],
            )
            grad = work.grads[i].to(slot.dtype)
            names = adafactor_state_shapes(slot.shard)
            states = {name: work.state(i, name) for name in names}
            new = {name: work.new_state(i, name) for name in names}
            updates.append(
                adafactor_update(
                    grad, work.params[i], states, slot.shard, hyper, slot.step + 1, work.new_params[i], new
                )
            )
        return updates
