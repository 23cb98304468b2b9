"""Muon on shards, exact: ``torch.optim.Muon`` for 2-d parameters and ``torch.optim.AdamW`` for
the others (biases, norms, batched tensors), as Muon's users configure it.

Momentum, Nesterov's lookahead, weight decay and the step are elementwise, so they run on the
local shards in the state layout, op for op as torch runs them. The Newton-Schulz iteration
needs the whole matrix; per matrix, the placement (``planner.owners``) says where it runs:

- *gather*: the update's pieces are all-gathered on every rank of the state mesh (the
  planner's cheapest plan to the replicated layout), every rank iterates, and keeps its piece;
- *owner*: the pieces move whole to one owner rank (the planner's plan to a one-rank layout:
  point-to-point, across meshes), the owner iterates and sends the bf16 result back (the plan
  from the one-rank layout to the state layout); owners are balanced by the matrices' flops.

Flat chunks of a whole matrix (flat ZeRO) move as the 1-d chunks they are; flat chunks of a
block that other axes split are first all-gathered over the flat axis into the block. The iteration is
torch's own (``torch.optim._muon``), on the same bits, so the result equals torch's whatever the
layout. Moves run matrix after matrix, in the optimizer's order, on every rank of the mesh.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any, Unpack

import attrs
import torch

# torch's own iteration and learning-rate rule, so that the sharded step equals torch's bit for bit
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr, _zeropower_via_newtonschulz

from planner.owners import (
    DEFAULT_FLOPS_PER_SECOND,
    PLACEMENTS,
    Matrix,
    OwnerPlan,
    gather_plan,
    newton_schulz_flops,
    owner_plans,
    place_matrices,
    replicated,
)
from planner.records import Plan
from planner.step import without_axis
from runtime import stats
from runtime.comm import collective
from runtime.dtypes import dtype_name
from runtime.errors import DistributedError
from runtime.executor import reshard
from runtime.groups import axis_ranks, group_for
from runtime.optim.adamw import ADAMW_STATES, adamw_update
from runtime.optim.base import ShardedOptimizer, Slot, SpecLike, StepOptions, StepTraffic, StepWork, Update, done
from runtime.optim.errors import OptimizerError, OptimizerStepError
from runtime.packing import region
from shardlang.errors import ShardlangError
from shardlang.layout import Layout

MUON_STATES = ("momentum_buffer",)


@attrs.frozen
class MatrixMoves:
    """What one matrix's iteration communicates on this rank: the all-gather joining flat
    chunks (bytes; 0 unless they are joined) and the plans that bring the matrix to where it is
    iterated and its result back (``back`` ``None`` for a gather)."""

    flat_bytes: int
    to: Plan
    back: Plan | None

    @property
    def bytes(self) -> int:
        return self.flat_bytes + self.to.total_bytes + (self.back.total_bytes if self.back is not None else 0)

    @property
    def collectives(self) -> int:
        steps = len(self.to.collectives) + (len(self.back.collectives) if self.back is not None else 0)
        return steps + (self.flat_bytes > 0)


def _pieces(slot: Slot) -> tuple[Layout, tuple[int, ...]]:
    """The layout and shape the matrix's pieces move in: the state layout; for flat chunks of
    a whole matrix (flat ZeRO), their own 1-d layout of the matrix flattened; for flat chunks of
    a block, the block's layout, once the chunks are joined (:meth:`ShardedMuon._join_flat`)."""
    if slot.flat_axis is None:
        return slot.state_layout, slot.shape
    base = without_axis(slot.state_layout, slot.flat_axis)
    if not _joins(slot):
        return Layout(dims=((slot.flat_axis,),), mesh=base.mesh), (math.prod(slot.shape),)
    return base, slot.shape


def _joins(slot: Slot) -> bool:
    """Whether the pieces are flat chunks of a block that other ranks split further."""
    return slot.flat_axis is not None and any(without_axis(slot.state_layout, slot.flat_axis).dims)


class ShardedMuon(ShardedOptimizer):
    """Muon with every state in its tensor's state layout; equals ``torch.optim.Muon`` on the
    2-d parameters and ``torch.optim.AdamW`` (``adamw_*`` hyperparameters) on the others.

    Arguments as :class:`~runtime.optim.ShardedAdamW`; Muon's hyperparameters as torch's.
    ``placement``: ``"auto"`` (the cheaper per matrix under the cost model and
    ``flops_per_second``), ``"gather"`` or ``"owner"`` (``planner.owners``);
    :meth:`owner_plan` shows the choice.
    """

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
        flops_per_second: float = DEFAULT_FLOPS_PER_SECOND,
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
        if not flops_per_second > 0:
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
        self._owner_plans: dict[tuple, OwnerPlan] = {}
        self._moves = (0, 0)  # bytes and collectives of the matrices' moves in the step being staged
        super().__init__(named_params, spec, defaults, **options)

    def _state_shapes(self, slot: Slot) -> dict[str, tuple[int, ...]]:
        assert slot.shard is not None
        names = MUON_STATES if len(slot.shape) == 2 else ADAMW_STATES
        return dict.fromkeys(names, slot.shard.local_shape)

    # --- where each matrix is iterated -------------------------------------------------
    def _matrix(self, slot: Slot) -> Matrix:
        layout, shape = _pieces(slot)
        flat_seconds = 0.0
        if _joins(slot):  # the busiest rank's block: the mesh's first rank's
            block = layout.rank_piece(slot.shape, layout.mesh.ranks[0]).numel
            chunks = Layout(dims=((slot.flat_axis,),), mesh=layout.mesh)
            flat_seconds = gather_plan(chunks, (block,), dtype_name(slot.dtype), slot.cost).total_seconds
        return Matrix(
            name=slot.name,
            shape=shape,
            layout=layout,
            dtype=dtype_name(slot.dtype),
            flops=newton_schulz_flops((slot.shape[0], slot.shape[1]), slot.group["ns_steps"]),
            flat_seconds=flat_seconds,
            cost=slot.cost,
        )

    def _placed(self, slots: list[Slot]) -> OwnerPlan:
        """The placement of the matrices among ``slots``, per state mesh (every rank of a mesh
        steps the same matrices of it, so all of them choose alike); cached."""
        matrices = [s for s in slots if len(s.shape) == 2]
        key = tuple((s.index, s.group["ns_steps"]) for s in matrices)
        cached = self._owner_plans.get(key)
        if cached is None:
            by_mesh: dict[tuple, list[Matrix]] = {}
            for s in matrices:
                mesh = s.state_layout.mesh
                by_mesh.setdefault((mesh.shape, tuple(mesh.ranks)), []).append(self._matrix(s))
            placed = [place_matrices(ms, self.placement, self.flops_per_second) for ms in by_mesh.values()]
            order = {s.name: i for i, s in enumerate(matrices)}
            cached = OwnerPlan(
                placements=tuple(sorted((p for op in placed for p in op.placements), key=lambda p: order[p.name])),
                loads=tuple(sorted(load for op in placed for load in op.loads)),
                flops_per_second=self.flops_per_second,
            )
            self._owner_plans[key] = cached
        return cached

    def owner_plan(self) -> OwnerPlan:
        """Where the next step iterates each matrix with a gradient now, and its estimate."""
        return self._placed(self._stepped())

    def _moves_of(self, slot: Slot, owner: int | None) -> MatrixMoves:
        (layout, shape), dtype = _pieces(slot), dtype_name(slot.dtype)
        flat_bytes = 0
        if _joins(slot):
            assert slot.shard is not None
            n = slot.state_layout.mesh.shape[slot.flat_axis]
            chunk = -(-math.prod(slot.shard.block_shape) // n)
            flat_bytes = (n - 1) * chunk * slot.dtype.itemsize  # the cost model's all_gather row
        if owner is None or len(slot.state_layout.mesh.ranks) == 1:
            return MatrixMoves(flat_bytes, gather_plan(layout, shape, dtype, slot.cost), None)
        to, back = owner_plans(layout, owner, shape, dtype, slot.cost)
        return MatrixMoves(flat_bytes, to, back)

    # --- what a step communicates ------------------------------------------------------
    def planned_traffic(self) -> StepTraffic:
        traffic = super().planned_traffic()
        slots = [s for s in self._stepped() if len(s.shape) == 2]
        placed = self._placed(self._stepped())
        moves = [self._moves_of(s, placed.of(s.name).owner) for s in slots]
        return attrs.evolve(
            traffic,
            matrix_bytes=sum(m.bytes for m in moves),
            matrix_collectives=sum(m.collectives for m in moves),
        )

    def _stage(self, slots: list[Slot], *args: Any, **kwargs: Any) -> Any:
        self._moves = (0, 0)
        commit = super()._stage(slots, *args, **kwargs)
        moved = self._moves

        def with_moves() -> None:
            commit()
            self.last_traffic = attrs.evolve(self.last_traffic, matrix_bytes=moved[0], matrix_collectives=moved[1])

        return with_moves

    # --- the math ----------------------------------------------------------------------
    def _updates(self, work: StepWork) -> list[Update]:
        placed = self._placed(list(work.slots))
        moved_bytes = moved_collectives = 0
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
            update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
            moves = self._moves_of(slot, placed.of(slot.name).owner)
            ortho = self._orthogonalised(slot, update, moves)
            moved_bytes += moves.bytes
            moved_collectives += moves.collectives
            torch.mul(param, 1 - group["lr"] * group["weight_decay"], out=new_param)
            new_param.add_(ortho, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], torch.Size(slot.shape)))
        self._moves = (moved_bytes, moved_collectives)
        return [done()]

    def _orthogonalised(self, slot: Slot, update: torch.Tensor, moves: MatrixMoves) -> torch.Tensor:
        """This rank's piece (block or flat chunk) of the iteration's result on the whole matrix."""
        assert slot.shard is not None
        shard, group = slot.shard, slot.group
        step_number = slot.step + 1
        layout, shape = _pieces(slot)

        def iterate(whole: torch.Tensor) -> torch.Tensor:
            matrix = whole.reshape(slot.shape)
            ortho = _zeropower_via_newtonschulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])
            return ortho.reshape(shape)

        try:
            local = self._join_flat(slot, update) if _joins(slot) else update
            if moves.back is None:  # gather: every rank iterates the whole matrix
                whole = self._move(local, layout, replicated(layout), moves.to, shape, slot)
                assert whole is not None
                result = region(iterate(whole), layout.rank_piece(shape, self.rank))
            else:
                whole = self._move(local, layout, moves.to.dst, moves.to, shape, slot)
                done_whole = iterate(whole) if whole is not None else None
                result = self._move(done_whole, moves.back.src, layout, moves.back, shape, slot)
                assert result is not None
        except ShardlangError as e:
            raise OptimizerStepError(
                f"step {step_number} failed moving tensor '{slot.name}' for its Newton-Schulz iteration: {e.message}; "
                "parameters and optimizer states are unchanged"
            ) from e
        if _joins(slot):  # the block's flat chunk
            assert shard.flat_range is not None
            lo, hi = shard.flat_range
            return result.reshape(-1)[lo:hi]
        return result

    def _move(
        self, local: torch.Tensor | None, src: Layout, dst: Layout, plan: Plan, shape: tuple[int, ...], slot: Slot
    ) -> torch.Tensor | None:
        if not plan.steps:
            return local
        return reshard(
            local,
            src,
            dst,
            global_shape=shape,
            plan=plan,
            timeout=self.timeout,
            name=slot.name,
            device=slot.local_param().device,
        )

    def _join_flat(self, slot: Slot, chunk: torch.Tensor) -> torch.Tensor:
        """The base block from the flat chunks of the ranks along the flat axis: equal chunks
        but the last (``chunk_bounds``), so the padded all-gather holds the block first."""
        assert slot.shard is not None and slot.flat_axis is not None
        shard, mesh, axis = slot.shard, slot.state_layout.mesh, slot.flat_axis
        n, total = mesh.shape[axis], math.prod(shard.block_shape)
        size = -(-total // n)
        padded = torch.zeros(size, dtype=chunk.dtype, device=chunk.device)
        padded[: chunk.numel()] = chunk.reshape(-1)
        members = axis_ranks(mesh, (axis,), self.rank)
        started = time.perf_counter()
        try:
            group = group_for(mesh, (axis,), members, timeout=self.timeout)
            gathered = collective("all_gather", padded, n, None, group, self.timeout)
        except DistributedError as e:
            raise DistributedError(f"the all-gather of its flat chunks over ranks {list(members)}: {e.message}") from e
        if stats.is_recording():
            sent = (n - 1) * size * chunk.element_size()
            stats.record(
                stats.CommRecord(
                    tensor=slot.name,
                    step=0,
                    op="all_gather",
                    axis=axis,
                    ranks=members,
                    bytes_sent=sent,
                    planned_bytes=sent,
                    seconds=time.perf_counter() - started,
                )
            )
        return gathered[:total].reshape(shard.block_shape)
