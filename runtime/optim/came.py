"""CAME on local shards, exact: the arithmetic of the authors' ``came_pytorch.CAME``, with every
statistic that spans ranks completed by a sum over the mesh axes the layout says it spans.

Per step, for a tensor ``[*batch, H, W]`` (factored: a batch of matrices):

    U = g^2 + eps1;  r = EMA(mean_W U), c = EMA(mean_H U) with beta2
    u = g * rsqrt(r / mean_H r) * rsqrt(c);  u /= max(1, RMS(u) / clip_threshold)
    m = EMA(u) with beta1;  Res = (u - m)^2 + eps2;  R, C = row/column EMAs of Res with beta3
    p -= lr*wd*p;  p -= lr * m * rsqrt(R / mean_H R) * rsqrt(C)

and for a 1-d tensor ``v = EMA(U)``, ``u = g * rsqrt(v)``, the update being ``m``.

Sharded, the raw sums are completed first and divided by the true global counts (``H``, ``W``,
the tensor's element count) before the EMA, so uneven and empty pieces weigh right. The row
normaliser ``mean_H r`` needs the rows of other ranks when the rows are split; because the
EMA is linear, ``sum_H r_new = beta * sum_H r_old + (1-beta) * sum_HW U / W``, whose two sums
travel with the row and column sums. A step is three phases of sums: second moment, RMS,
instability; :func:`came_sum_specs` lists them, :func:`came_update` computes them.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Iterable, Mapping
from typing import Any, Unpack

import attrs
import torch

from runtime.optim.base import ShardedOptimizer, Slot, SpecLike, StateWhere, StepOptions, StepWork, Update
from runtime.optim.errors import OptimizerError
from runtime.optim.shards import StateShard
from runtime.optim.sums import SumSpec

PHASES = ("the second-moment sums", "the update's RMS", "the instability sums")


@attrs.frozen
class CameHyper:
    lr: float
    eps: tuple[float, float]
    clip_threshold: float
    betas: tuple[float, float, float]
    weight_decay: float


def came_state_shapes(shard: StateShard) -> dict[str, tuple[int, ...]]:
    """The local shape of every state, as ``came_pytorch`` names them, in the rank's part of
    the tensor."""
    if not shard.factored:
        return {"exp_avg": shard.local_shape, "exp_avg_sq": shard.local_shape}
    return {
        "exp_avg": shard.local_shape,
        "exp_avg_sq_row": shard.row_stat_shape,
        "exp_avg_sq_col": shard.col_stat_shape,
        "exp_avg_res_row": shard.row_stat_shape,
        "exp_avg_res_col": shard.col_stat_shape,
    }


def rows_span_ranks(shard: StateShard) -> bool:
    """Whether the row normaliser needs rows other ranks hold."""
    return any(shard.layout.mesh.shape[a] > 1 for a in shard.row_axes)


def came_sum_specs(shard: StateShard, dtype: torch.dtype, owner: str) -> tuple[tuple[SumSpec, ...], ...]:
    """The sums of each phase (see :data:`PHASES`), in the order :func:`came_update` yields them."""
    mesh = shard.layout.mesh

    def spec(axes: frozenset[int], shape: tuple[int, ...], replicated: frozenset[int]) -> SumSpec:
        return SumSpec(mesh=mesh, axes=axes, numel=math.prod(shape), dtype=dtype, owner=owner, replicated=replicated)

    rms = (spec(shard.sum_axes, (1,), shard.replicated),)
    if not shard.factored:
        return (), rms, ()
    moments = [
        spec(shard.row_sum_axes, shard.row_stat_shape, shard.replicated),
        spec(shard.col_sum_axes, shard.col_stat_shape, shard.replicated),
    ]
    if rows_span_ranks(shard):
        batch = shard.block_shape[:-2]
        moments += [
            spec(shard.matrix_sum_axes, batch, shard.replicated),
            # The old row statistics are the same on every rank along the row-sum axes.
            spec(shard.row_axes, batch, shard.replicated | shard.row_sum_axes),
        ]
    return tuple(moments), rms, tuple(moments)


def came_update(
    grad: torch.Tensor,
    param: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    shard: StateShard,
    hyper: CameHyper,
    new_param: torch.Tensor,
    new: Mapping[str, torch.Tensor],
) -> Update:
    """One CAME step on local data, as a generator: it yields the partial sums of each phase
    and is sent them completed; it writes the new parameter into ``new_param`` and the new
    states into ``new`` (of the states' shapes). Nothing passed in is modified."""
    beta1, beta2, beta3 = hyper.betas
    eps1, eps2 = hyper.eps
    second = grad.square().add_(eps1)
    if shard.factored:
        row, col, norm = yield from _factored_ema(
            second,
            state["exp_avg_sq_row"],
            state["exp_avg_sq_col"],
            beta2,
            shard,
            (new["exp_avg_sq_row"], new["exp_avg_sq_col"]),
        )
        update = _approx_rsqrt(row, col, norm, shard).mul_(grad)
    else:
        yield []
        torch.mul(state["exp_avg_sq"], beta2, out=new["exp_avg_sq"]).add_(second, alpha=1.0 - beta2)
        update = new["exp_avg_sq"].rsqrt().mul_(grad)

    (square_sum,) = yield [torch.linalg.vector_norm(update).square().reshape(1)]
    rms = square_sum.sqrt()[0] / math.sqrt(shard.numel)
    update.div_((rms / hyper.clip_threshold).clamp_(min=1.0))

    exp_avg = torch.mul(state["exp_avg"], beta1, out=new["exp_avg"]).add_(update, alpha=1 - beta1)
    if shard.factored:
        instability = torch.sub(update, exp_avg).square_().add_(eps2)
        row, col, norm = yield from _factored_ema(
            instability,
            state["exp_avg_res_row"],
            state["exp_avg_res_col"],
            beta3,
            shard,
            (new["exp_avg_res_row"], new["exp_avg_res_col"]),
        )
        update = _approx_rsqrt(row, col, norm, shard).mul_(exp_avg)
    else:
        yield []
        update = exp_avg

    if hyper.weight_decay != 0:
        torch.add(param, param, alpha=-hyper.weight_decay * hyper.lr, out=new_param)
    else:
        new_param.copy_(param)
    new_param.sub_(update.mul(hyper.lr))


def _factored_ema(
    x: torch.Tensor,
    row: torch.Tensor,
    col: torch.Tensor,
    beta: float,
    shard: StateShard,
    out: tuple[torch.Tensor, torch.Tensor],
) -> Generator[list[torch.Tensor], list[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Row and column EMAs of the means of ``x`` (written to ``out``), and the per-matrix
    mean of the new rows."""
    sums = [shard.row_sums(x), shard.col_sums(x)]
    spans = rows_span_ranks(shard)
    if spans:
        sums += [shard.matrix_sums(x), row.sum(-1)]
    completed = yield sums
    height, width = shard.shape[-2], shard.shape[-1]
    new_row = torch.mul(row, beta, out=out[0]).add_(completed[0] / width, alpha=1.0 - beta)
    new_col = torch.mul(col, beta, out=out[1]).add_(completed[1] / height, alpha=1.0 - beta)
    if spans:  # the rows are split: sum_H of the new rows from the sums (see the module doc)
        return new_row, new_col, (completed[3] * beta + completed[2] / width * (1.0 - beta)) / height
    return new_row, new_col, new_row.mean(dim=-1)


def _approx_rsqrt(row: torch.Tensor, col: torch.Tensor, norm: torch.Tensor, shard: StateShard) -> torch.Tensor:
    """``rsqrt(row / norm) * rsqrt(col)`` spread over the local data."""
    row_factor = (row / shard.matrices(norm)).rsqrt_()
    return shard.rows(row_factor) * shard.cols(col.rsqrt())


class ShardedCAME(ShardedOptimizer):
    """CAME with every state in its tensor's state layout; equals ``came_pytorch.CAME``.

    Arguments as :class:`~runtime.optim.ShardedAdamW`, hyperparameters as ``came_pytorch``
    (``lr`` is required). With ``flat_axis``, each rank keeps the row and column statistics
    of its whole base block and completes their partial sums (built with ``index_add`` over
    its flat range) with one all-reduce of ``h + w`` floats per phase.
    """

    phases = PHASES

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]],
        spec: SpecLike = None,
        *,
        lr: float,
        eps: tuple[float, float] = (1e-30, 1e-16),
        clip_threshold: float = 1.0,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        weight_decay: float = 0.0,
        **options: Unpack[StepOptions],
    ) -> None:
        if not lr > 0 or not clip_threshold > 0 or not weight_decay >= 0 or not all(0 <= b <= 1 for b in betas):
            raise OptimizerError(
                f"invalid CAME hyperparameters: lr={lr}, betas={betas}, clip_threshold={clip_threshold}, "
                f"weight_decay={weight_decay}"
            )
        defaults = {
            "lr": lr,
            "eps": tuple(eps),
            "clip_threshold": clip_threshold,
            "betas": tuple(betas),
            "weight_decay": weight_decay,
        }
        super().__init__(named_params, spec, defaults, **options)

    def _state_shapes(self, slot: Slot) -> dict[str, tuple[int, ...]]:
        assert slot.shard is not None
        return came_state_shapes(slot.shard)

    def _sum_specs(self, slot: Slot) -> tuple[tuple[SumSpec, ...], ...]:
        assert slot.shard is not None
        return came_sum_specs(slot.shard, slot.dtype, slot.name)

    def _where(self, slot: Slot, name: str) -> StateWhere:
        assert slot.shard is not None
        if name in ("exp_avg_sq_row", "exp_avg_res_row"):
            return StateWhere(*slot.shard.row_stat_layout(), None, slot.shard.row_stat_shape)
        if name in ("exp_avg_sq_col", "exp_avg_res_col"):
            return StateWhere(*slot.shard.col_stat_layout(), None, slot.shard.col_stat_shape)
        return super()._where(slot, name)

    def _updates(self, work: StepWork) -> list[Update]:
        updates = []
        for i, slot in enumerate(work.slots):
            assert slot.shard is not None
            group = slot.group
            hyper = CameHyper(
                lr=group["lr"],
                eps=group["eps"],
                clip_threshold=group["clip_threshold"],
                betas=group["betas"],
                weight_decay=group["weight_decay"],
            )
            grad = work.grads[i].to(slot.dtype)
            names = came_state_shapes(slot.shard)
            states = {name: work.state(i, name) for name in names}
            new = {name: work.new_state(i, name) for name in names}
            updates.append(came_update(grad, work.params[i], states, slot.shard, hyper, work.new_params[i], new))
        return updates
