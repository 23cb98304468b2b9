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
of all matrices run bucketed (``runtime.matrix_moves``): the gathers of one kind and group in
one collective, the moves to owners in one exchange, the results back in another. The
iteration is torch's own (``torch.optim._muon``), on the same bits, so the result equals
torch's whatever the layout.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, Unpack

import attrs
import torch
import torch.distributed as dist

# torch's own iteration and learning-rate rule, so that the sharded step equals torch's bit for bit
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr, _zeropower_via_newtonschulz

from planner.legs import DEFAULT_BUCKET_BYTES, StepTensor
from planner.matrices import BACK, TO, MatrixPlan, joins, pieces, plan_matrices
from planner.owners import PLACEMENTS
from planner.step import StepPlan
from runtime.buffers import Scratch
from runtime.comm import collective
from runtime.dtypes import dtype_name
from runtime.errors import DistributedError, PlanMismatchError
from runtime.executor import fingerprint
from runtime.groups import ranks_group
from runtime.matrix_moves import MatrixProgram, compile_matrices, run_matrix_stage
from runtime.optim.adamw import ADAMW_STATES, adamw_update
from runtime.optim.base import ShardedOptimizer, Slot, SpecLike, StepOptions, StepTraffic, StepWork, Update, done
from runtime.optim.errors import OptimizerError, OptimizerStepError
from runtime.packing import region
from shardlang.errors import ShardlangError
from shardlang.layout import Layout

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
        self._matrix_plans: dict[tuple, tuple[MatrixPlan, MatrixProgram]] = {}
        self._matrix_buffers = Scratch()  # the matrices' bucket buffers, kept between steps
        self._agreed: set[int] = set()  # ids of the matrix plans the ranks have agreed on
        super().__init__(named_params, spec, defaults, **options)

    def _state_shapes(self, slot: Slot) -> dict[str, tuple[int, ...]]:
        assert slot.shard is not None
        names = MUON_STATES if len(slot.shape) == 2 else ADAMW_STATES
        return dict.fromkeys(names, slot.shard.local_shape)

    # --- where each matrix is iterated: the step plan's matrix part ---------------------
    def _matrices(self, slots: list[Slot]) -> tuple[MatrixPlan, MatrixProgram]:
        """The matrix plan of the 2-d tensors among ``slots`` and this rank's program of it;
        built once per set of slots."""
        matrices = [s for s in slots if len(s.shape) == 2]
        key = tuple((s.index, s.group["ns_steps"]) for s in matrices)
        cached = self._matrix_plans.get(key)
        if cached is None:
            tensors = [_tensor_view(s) for s in matrices]
            try:
                plan = plan_matrices(
                    tensors,
                    self.rank,
                    ns_steps={s.name: s.group["ns_steps"] for s in matrices},
                    placement=self.placement,
                    flops_per_second=self.flops_per_second,
                    bucket_bytes=DEFAULT_BUCKET_BYTES if self.bucket_bytes is None else self.bucket_bytes,
                )
                cached = self._matrix_plans[key] = (plan, compile_matrices(plan, self.rank))
            except ShardlangError as e:
                raise OptimizerError(e.message) from None
        return cached

    def step_plan(self) -> StepPlan:
        """The plan of the next step, for the parameters that have gradients now, with the
        matrices' iterations (``StepPlan.matrices``: where each runs, its moves, their buckets
        and the estimate)."""
        return attrs.evolve(super().step_plan(), matrices=self._matrices(self._stepped())[0])

    # --- what a step communicates ------------------------------------------------------
    def planned_traffic(self) -> StepTraffic:
        traffic = super().planned_traffic()
        plan, _ = self._matrices(self._stepped())
        return attrs.evolve(traffic, matrix_bytes=plan.total_bytes, matrix_collectives=plan.collectives)

    def _stage(self, slots: list[Slot], *args: Any, **kwargs: Any) -> Any:
        staged = super()._stage(slots, *args, **kwargs)
        plan, _ = self._matrices(slots)

        def with_moves() -> None:
            staged.commit()
            self.last_traffic = attrs.evolve(
                self.last_traffic, matrix_bytes=plan.total_bytes, matrix_collectives=plan.collectives
            )

        return attrs.evolve(staged, commit=with_moves)

    # --- the math ----------------------------------------------------------------------
    def _updates(self, work: StepWork) -> list[Update]:
        updates: dict[str, torch.Tensor] = {}
        for i, slot in enumerate(work.slots):
            group = slot.group
            grad, param, new_param = work.grads[i].to(slot.dtype), work.params[i], work.new_params[i]
            if len(slot.shape) != 2:
                adamw_update(
                    param,
                    grad,
                    work.state(i, "exp_avg"),
                    work.state(i, "exp_avg_sq"),
                    (new_param, work.new_state(i, "exp_avg"), work.new_state(i, "exp_avg_sq")),
                    slot.step + 1,
                    lr=group["adamw_lr"],
                    betas=group["adamw_betas"],
                    eps=group["adamw_eps"],
                    weight_decay=group["adamw_weight_decay"],
                )
                continue
            momentum = group["momentum"]
            buffer = torch.lerp(
                work.state(i, "momentum_buffer"), grad, 1 - momentum, out=work.new_state(i, "momentum_buffer")
            )
            updates[slot.name] = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
        if updates:
            orthogonalised = self._orthogonalised([s for s in work.slots if s.name in updates], updates)
            for i, slot in enumerate(work.slots):
                if slot.name in updates:
                    group, new_param = slot.group, work.new_params[i]
                    torch.mul(work.params[i], 1 - group["lr"] * group["weight_decay"], out=new_param)
                    lr = _adjust_lr(group["lr"], group["adjust_lr_fn"], torch.Size(slot.shape))
                    new_param.add_(orthogonalised[slot.name], alpha=-lr)
        return [done()]

    def _orthogonalised(self, slots: list[Slot], updates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's piece (block or flat chunk) of every matrix's iteration result, the
        matrices moved and iterated as the step plan's matrix part says."""
        plan, program = self._matrices(slots)
        by_name = {s.name: s for s in slots}
        if self.verify and id(plan) not in self._agreed:
            self._agree_on_matrices(plan, by_name)
            self._agreed.add(id(plan))
        device = slots[0].local_param().device
        run = functools.partial(
            run_matrix_stage,
            program,
            device=device,
            device_meshes={s.name: s.device_mesh for s in slots},
            timeout=self.timeout,
            buffers=self._matrix_buffers,
        )
        step_number = slots[0].step + 1
        try:
            arrived = run(TO, updates)
            results: dict[str, torch.Tensor | None] = {}
            for matrix in plan.matrices:
                slot, whole = by_name[matrix.name], arrived[matrix.name]
                layout, shape = _pieces_of(slot)
                if matrix.owner is None:  # gathered: every rank iterates and keeps its piece
                    assert whole is not None
                    results[matrix.name] = region(_iterate(slot, whole, shape), layout.rank_piece(shape, self.rank))
                else:  # the owner iterates; the others receive their pieces
                    results[matrix.name] = None if whole is None else _iterate(slot, whole, shape)
            owned = {m.name: results[m.name] for m in plan.matrices if m.owner is not None}
            if owned:
                results |= run(BACK, owned)
        except ShardlangError as e:
            names = ", ".join(f"'{m.name}'" for m in plan.matrices)
            raise OptimizerStepError(
                f"step {step_number} failed moving tensors {names} for their Newton-Schulz iteration: {e.message}; "
                "parameters and optimizer states are unchanged"
            ) from e
        out = {}
        for name, result in results.items():
            assert result is not None
            slot = by_name[name]
            if slot.shard is not None and slot.shard.flat_range is not None and joins(_tensor_view(slot)):
                lo, hi = slot.shard.flat_range  # the block's flat chunk
                result = result.reshape(-1)[lo:hi]
            out[name] = result
        return out

    def _agree_on_matrices(self, plan: MatrixPlan, slots: dict[str, Slot]) -> None:
        """Every rank of a state mesh holds the same placements and buckets of its matrices: a
        digest per mesh, all-gathered once per plan (as the step plan's buckets are checked), so
        that ranks configured apart (``placement``, ``flops_per_second``, ``ns_steps``) fail
        here, naming the ranks, instead of waiting on messages no peer sends."""
        records: dict[tuple, list[Any]] = {}
        for m in plan.matrices:
            mesh = slots[m.name].state_layout.mesh
            records.setdefault((mesh.shape, tuple(mesh.ranks)), []).append([m.name, m.owner, m.flops])
        for b in plan.buckets:  # rank-free: the members, not their (per-rank) sizes
            members = [[plan.legs[m.leg].tensor, plan.legs[m.leg].what] for m in b.members]
            records.setdefault((b.mesh.shape, tuple(b.mesh.ranks)), []).append(
                [b.stage, b.op, b.axis, b.dtype, members]
            )
        device = next(iter(slots.values())).local_param().device
        for (_, ranks), record in sorted(records.items()):
            if len(ranks) < 2 or not dist.is_initialized():
                continue
            mine = fingerprint(record)
            try:
                gathered = collective(
                    "all_gather",
                    torch.tensor([mine], dtype=torch.int64, device=device),
                    len(ranks),
                    None,
                    ranks_group(ranks, timeout=self.timeout),
                    self.timeout,
                )
            except DistributedError as e:
                raise OptimizerStepError(
                    f"checking the matrices' plan on ranks {list(ranks)} failed: {e.message}"
                ) from e
            differ = [r for r, p in zip(ranks, gathered.tolist(), strict=True) if p != mine]
            if differ:
                raise PlanMismatchError(
                    f"the ranks {list(ranks)} disagree on where the matrices' Newton-Schulz iterations run: rank "
                    f"{self.rank}'s placements and buckets differ from those of ranks {differ}; every rank must give "
                    "ShardedMuon the same placement, flops_per_second, ns_steps and cost model"
                )


def _tensor_view(slot: Slot) -> StepTensor:
    """What ``planner.matrices`` reads of a slot: its shape and state layout, flat axis, dtype."""
    return StepTensor(
        name=slot.name,
        shape=slot.shape,
        param=slot.param_layout,
        grad=slot.state_layout,  # not moved here: the step plan brings the gradient
        state=slot.state_layout,
        state_dtype=dtype_name(slot.dtype),
        flat_axis=slot.flat_axis,
        cost=slot.cost,
    )


def _pieces_of(slot: Slot) -> tuple[Layout, tuple[int, ...]]:
    return pieces(_tensor_view(slot))


def _iterate(slot: Slot, whole: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """torch's Newton-Schulz iteration on the whole matrix (given in the pieces' shape)."""
    group = slot.group
    ortho = _zeropower_via_newtonschulz(
        whole.reshape(slot.shape), group["ns_coefficients"], group["ns_steps"], group["eps"]
    )
    return ortho.reshape(shape)
