"""Muon on shards, exact: ``torch.optim.Muon`` for 2-d parameters and ``torch.optim.AdamW`` for
the others (biases, norms, batched tensors), as Muon's users configure it.

Momentum, Nesterov's lookahead, weight decay and the step are elementwise, so they run on the
local shards in the state layout, op for op as torch runs them. The Newton-Schulz iteration
needs the whole matrix; the step plan's matrix part (``planner.matrices``, :meth:`step_plan`)
says, per matrix, where it runs and how it moves, and the step runs exactly that:

- *gather*: the update's pieces are all-gathered on every rank of the state mesh (the
  planner's cheapest plan to the replicated layout), every rank iterates, and keeps its piece;
- *owner*: the pieces move whole to one owner rank (the planner's plan to a one-rank layout:
  point-to-point, across meshes), the owner iterates and sends the bf16 result back (the plan
  from the one-rank layout to the state layout); owners are balanced by the matrices' flops.

Flat chunks of a whole matrix (flat ZeRO) move as the 1-d chunks they are; flat chunks of a
block that other axes split are first all-gathered over the flat axis into the block. The moves
run bucketed (``runtime.optim.matrix_iterations`` over ``runtime.execution.matrix_moves``): the
gathers of one kind and group in one collective, the moves to owners in one exchange, the
results back in another; a wave of matrices at a time (those whose moves share buckets): its
updates made, moved, iterated and dropped before the next, so that a step holds one wave's whole
matrices, not the model's (docs/memory.md). The iteration is torch's own (``torch.optim._muon``),
on the same bits, so the result equals torch's whatever the layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Unpack

import attrs
import torch

# torch's own iteration and learning-rate rule, so that the sharded step equals torch's bit for bit
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr, _zeropower_via_newtonschulz

from planner.owners import PLACEMENTS
from planner.step import StepPlan
from runtime.optim.adamw import ADAMW_STATES, adamw_update
from runtime.optim.base import ShardedOptimizer, StepOptions
from runtime.optim.errors import OptimizerError
from runtime.optim.matrix_iterations import MatrixIterations
from runtime.optim.phases import StepWork, Update, done
from runtime.optim.records import StepTraffic
from runtime.optim.slots import Slot, SpecLike

MUON_STATES = ("momentum_buffer",)


class ShardedMuon(ShardedOptimizer):
    """Muon with every state in its tensor's state layout; equals ``torch.optim.Muon`` on the
    2-d parameters and ``torch.optim.AdamW`` (``adamw_*`` hyperparameters) on the others.

    Arguments as :class:`~runtime.optim.ShardedAdamW`; Muon's hyperparameters as torch's.
    ``placement``: ``"auto"`` (the cheaper per matrix under the cost model and
    ``flops_per_second``), ``"gather"`` or ``"owner"`` (``planner.owners``);
    ``flops_per_second``: the compute rate the choice assumes (default: the cost model's
    measured rate, a hints file's ``flops_per_second``, else
    ``planner.owners.DEFAULT_FLOPS_PER_SECOND``).
    :meth:`step_plan` shows the choice, the moves and the estimate (``StepPlan.matrices``).
    """

    updates_communicate = True  # the matrices' moves run inside the update

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]],
        spec: SpecLike = None,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        placement: str = "auto",
        flops_per_second: float | None = None,
        **options: Unpack[StepOptions],
    ) -> None:
        if (
            not lr >= 0
            or not weight_decay >= 0
            or not momentum >= 0
            or len(tuple(ns_coefficients)) != 3
            or not 0 < ns_steps < 100
            or adjust_lr_fn not in (None, "original", "match_rms_adamw")
            or not adamw_lr >= 0
            or not adamw_weight_decay >= 0
            or not all(0 <= b < 1 for b in adamw_betas)
        ):
            raise OptimizerError(
                f"invalid Muon hyperparameters: lr={lr}, weight_decay={weight_decay}, momentum={momentum}, "
                f"ns_coefficients={ns_coefficients}, ns_steps={ns_steps}, adjust_lr_fn={adjust_lr_fn!r}, "
                f"adamw_lr={adamw_lr}, adamw_betas={adamw_betas}, adamw_weight_decay={adamw_weight_decay}"
            )
        if placement not in PLACEMENTS:
            raise OptimizerError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        if flops_per_second is not None and not flops_per_second > 0:
            raise OptimizerError(f"flops_per_second must be positive, got {flops_per_second!r}")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "adamw_lr": adamw_lr,
            "adamw_betas": tuple(adamw_betas),
            "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
        }
        self.placement = placement
        self.flops_per_second = flops_per_second
        super().__init__(named_params, spec, defaults, **options)
        self._iterations = MatrixIterations(
            rank=self.rank,
            timeout=self.timeout,
            verify=self.verify,
            bucket_bytes=self.bucket_bytes,
            placement=placement,
            flops_per_second=flops_per_second,
        )

    def _state_shapes(self, slot: Slot) -> dict[str, tuple[int, ...]]:
        assert slot.shard is not None
        names = MUON_STATES if len(slot.shape) == 2 else ADAMW_STATES
        return dict.fromkeys(names, slot.shard.local_shape)

    memory_kind = "muon"

    def _memory_extras(self) -> dict[str, Any]:
        """The matrices' bucket buffers (one wave's gathers) and the matrices this rank
        iterates: gathered ones, and those it owns."""
        slots = self._slots.coming()[0]
        iterated = []
        if any(len(s.shape) == 2 for s in slots):
            plan = self._iterations.plan(slots)[0]
            iterated = [m.shape for m in plan.matrices if m.owner is None or m.owner == self.rank]
        return {**super()._memory_extras(), "kept": self._iterations.buffer_bytes, "iterated": iterated}

    # --- where each matrix is iterated: the step plan's matrix part ---------------------
    def step_plan(self) -> StepPlan:
        """The plan of the next step, for the parameters that have gradients now, with the
        matrices' iterations (``StepPlan.matrices``: where each runs, its moves, their buckets
        and the estimate)."""
        return attrs.evolve(super().step_plan(), matrices=self._iterations.plan(self._slots.coming()[0])[0])

    # --- what a step communicates ------------------------------------------------------
    def planned_traffic(self) -> StepTraffic:
        traffic = super().planned_traffic()
        slots, keys = self._slots.coming()
        if not slots or any(key is None for key in keys):
            return traffic
        plan, _ = self._iterations.plan(slots)
        return attrs.evolve(traffic, matrix_bytes=plan.total_bytes, matrix_collectives=plan.collectives)

    def _stage(self, slots: list[Slot], *args: Any, **kwargs: Any) -> Any:
        staged = super()._stage(slots, *args, **kwargs)
        plan, _ = self._iterations.plan(slots)

        def with_moves() -> None:
            staged.commit()
            last = self._transaction.last
            moves = {"matrix_bytes": plan.total_bytes, "matrix_collectives": plan.collectives}
            last.traffic = attrs.evolve(last.traffic, **moves)

        return attrs.evolve(staged, commit=with_moves)

    # --- the math ----------------------------------------------------------------------
    def _updates(self, work: StepWork) -> list[Update]:
        at = {slot.name: i for i, slot in enumerate(work.slots)}
        matrices = []
        for i, slot in enumerate(work.slots):
            if len(slot.shape) == 2:
                matrices.append(slot)
                continue
            group = slot.group
            adamw_update(
                work.params[i],
                work.grads[i].to(slot.dtype),
                work.state(i, "exp_avg"),
                work.state(i, "exp_avg_sq"),
                (work.new_params[i], work.new_state(i, "exp_avg"), work.new_state(i, "exp_avg_sq")),
                slot.step + 1,
                lr=group["adamw_lr"],
                betas=group["adamw_betas"],
                eps=group["adamw_eps"],
                weight_decay=group["adamw_weight_decay"],
            )

        def update(slot: Slot) -> torch.Tensor:
            """The matrix's momentum (written to its new state) and update, made when its
            wave moves, so that a step holds one wave's updates (docs/memory.md)."""
            i, group = at[slot.name], slot.group
            grad, momentum = work.grads[i].to(slot.dtype), group["momentum"]
            buffer = torch.lerp(
                work.state(i, "momentum_buffer"), grad, 1 - momentum, out=work.new_state(i, "momentum_buffer")
            )
            return grad.lerp(buffer, momentum) if group["nesterov"] else buffer

        def use(slot: Slot, orthogonalised: torch.Tensor) -> None:
            i, group = at[slot.name], slot.group
            new_param = work.new_params[i]
            torch.mul(work.params[i], 1 - group["lr"] * group["weight_decay"], out=new_param)
            lr = _adjust_lr(group["lr"], group["adjust_lr_fn"], torch.Size(slot.shape))
            new_param.add_(orthogonalised, alpha=-lr)

        if matrices:
            self._iterations.run(matrices, update, _iterate, use)
        return [done()]


def _iterate(slot: Slot, whole: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """torch's Newton-Schulz iteration on the whole matrix (given in the pieces' shape)."""
    group = slot.group
    ortho = _zeropower_via_newtonschulz(
        whole.reshape(slot.shape), group["ns_coefficients"], group["ns_steps"], group["eps"]
    )
    return ortho.reshape(shape)
