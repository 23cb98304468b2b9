"""Iterations over whole matrices whose pieces lie on many ranks (Muon's Newton-Schulz).

The step plan's matrix part (``planner.matrices``) says, per matrix, where it is iterated and
how its pieces move there and back; :class:`MatrixIterations` plans it once per set of slots,
compiles this rank's program of it (``runtime.execution.matrix_moves``), checks once per plan that the
ranks of every state mesh agree on it, and runs the moves around the optimizer's iteration.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from planner.legs import DEFAULT_BUCKET_BYTES, StepTensor
from planner.matrices import MatrixPlan, joins, pieces, plan_matrices
from runtime.comm.groups import ranks_group
from runtime.errors import DistributedError, PlanMismatchError
from runtime.execution.agreement import differing_ranks
from runtime.execution.matrix_moves import MatrixProgram, MatrixRun, compile_matrices
from runtime.memory.buffers import Scratch
from runtime.memory.dtypes import dtype_name
from runtime.memory.packing import region
from runtime.optim.errors import OptimizerError, OptimizerStepError
from runtime.optim.slots import Slot
from shardlang.errors import ShardlangError
from shardlang.layout import Layout

# The iteration of one matrix: the slot, the whole matrix in its pieces' shape, and that shape.
Iterate = Callable[[Slot, torch.Tensor, tuple[int, ...]], torch.Tensor]
# A matrix's update, this rank's piece of it (made when its wave moves).
Update = Callable[[Slot], torch.Tensor]
# What takes this rank's piece of a matrix's iteration result.
Use = Callable[[Slot, torch.Tensor], None]


class MatrixIterations:
    """The matrix plans of a rank and their programs, per set of 2-d slots (``ns_steps`` from
    each slot's group); ``placement`` and ``flops_per_second`` as ``ShardedMuon`` takes them."""

    def __init__(
        self,
        *,
        rank: int,
        timeout: datetime.timedelta,
        verify: bool,
        bucket_bytes: int | None,
        placement: str,
        flops_per_second: float | None,
    ) -> None:
        self.rank, self.timeout, self._verify = rank, timeout, verify
        self._bucket_bytes = DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self._placement, self._flops_per_second = placement, flops_per_second
        self._plans: dict[tuple, tuple[MatrixPlan, MatrixProgram]] = {}
        self._buffers = Scratch()  # the matrices' bucket buffers, kept between steps
        self._agreed: set[int] = set()  # ids of the matrix plans the ranks have agreed on

    @property
    def buffer_bytes(self) -> int:
        """The bucket buffers kept between steps: the largest wave's gathers (none for owners)."""
        return self._buffers.nbytes

    def plan(self, slots: list[Slot]) -> tuple[MatrixPlan, MatrixProgram]:
        """The matrix plan of the 2-d tensors among ``slots`` and this rank's program of it;
        built once per set of slots."""
        matrices = [s for s in slots if len(s.shape) == 2]
        key = tuple((s.index, s.group["ns_steps"]) for s in matrices)
        cached = self._plans.get(key)
        if cached is None:
            tensors = [tensor_view(s) for s in matrices]
            try:
                plan = plan_matrices(
                    tensors,
                    self.rank,
                    ns_steps={s.name: s.group["ns_steps"] for s in matrices},
                    placement=self._placement,
                    flops_per_second=self._flops_per_second,
                    bucket_bytes=self._bucket_bytes,
                )
                cached = self._plans[key] = (plan, compile_matrices(plan, self.rank))
            except ShardlangError as e:
                raise OptimizerError(e.message) from None
        return cached

    def run(self, slots: list[Slot], update: Update, iterate: Iterate, use: Use) -> None:
        """Every matrix's iteration, moved as the step plan's matrix part says, one wave of
        matrices at a time (``runtime.execution.matrix_moves``): each wave's updates made
        (``update``, this rank's piece), moved, iterated, and its whole matrices dropped before
        the next, so that a rank holds one wave's, not the model's; ``use`` is given this rank's
        piece (block or flat chunk) of every result: a gathered matrix's as soon as it is
        iterated, an owned one's once it is back."""
        plan, program = self.plan(slots)
        by_name = {s.name: s for s in slots}
        if self._verify and id(plan) not in self._agreed:
            self._agree(plan, by_name)
            self._agreed.add(id(plan))
        moves = MatrixRun(
            program,
            device=slots[0].local_param().device,
            device_meshes={s.name: s.device_mesh for s in slots},
            timeout=self.timeout,
            buffers=self._buffers,
        )
        step_number = slots[0].step + 1
        try:
            for wave in program.waves:
                arrived = moves.to_iteration(wave, {name: update(by_name[name]) for name in wave.names})
                results: dict[str, torch.Tensor | None] = {}
                for name in wave.names:
                    slot, whole = by_name[name], arrived.pop(name)
                    layout, shape = _pieces_of(slot)
                    if plan.of(name).owner is None:  # gathered: every rank iterates and keeps its piece
                        assert whole is not None
                        mine = layout.rank_piece(shape, self.rank)
                        use(slot, _piece(slot, region(iterate(slot, whole, shape), mine)))
                    else:  # the owner iterates; the others receive their pieces
                        results[name] = None if whole is None else iterate(slot, whole, shape)
                    del whole
                if results:
                    moves.back(results)
            for name, result in moves.finish().items():
                assert result is not None
                use(by_name[name], _piece(by_name[name], result))
        except ShardlangError as e:
            moves.drain()
            names = ", ".join(f"'{m.name}'" for m in plan.matrices)
            raise OptimizerStepError(
                f"step {step_number} failed moving tensors {names} for their Newton-Schulz iteration: {e.message}; "
                "parameters and optimizer states are unchanged"
            ) from e

    def _agree(self, plan: MatrixPlan, slots: dict[str, Slot]) -> None:
        """Every rank of a state mesh holds the same placements and buckets of its matrices: a
        digest per mesh, all-gathered once per plan (as the step plan's buckets are checked), so
        that ranks configured apart (``placement``, ``flops_per_second``, ``ns_steps``) fail
        here, naming the ranks, instead of waiting on messages no peer sends."""
        # Keyed by the meshes' ranks objects (a run of ranks is a few numbers, hashed in O(1)),
        # not by a tuple of every rank built per matrix.
        records: dict[tuple, list[object]] = {}
        for m in plan.matrices:
            mesh = slots[m.name].state_layout.mesh
            records.setdefault(mesh.geometry, []).append([m.name, m.owner, m.flops])
        for b in plan.buckets:  # rank-free: the members, not their (per-rank) sizes
            members = [[plan.legs[m.leg].tensor, plan.legs[m.leg].what] for m in b.members]
            records.setdefault(b.mesh.geometry, []).append([b.stage, b.op, b.axis, b.dtype, members])
        device = next(iter(slots.values())).local_param().device
        # Ordered by shape, then as the tuples of the ranks (runs order as tuples do), alike on every rank.
        for (_, ranks), record in sorted(records.items(), key=lambda item: item[0]):
            if len(ranks) < 2 or not dist.is_initialized():
                continue
            try:
                group = ranks_group(ranks, timeout=self.timeout)
                differ = differing_ranks(record, ranks, group, device, self.timeout)
            except DistributedError as e:
                raise OptimizerStepError(
                    f"checking the matrices' plan on ranks {list(ranks)} failed: {e.message}"
                ) from e
            if differ:
                raise PlanMismatchError(
                    f"the ranks {list(ranks)} disagree on where the matrices' Newton-Schulz iterations run: rank "
                    f"{self.rank}'s placements and buckets differ from those of ranks {differ}; every rank must give "
                    "ShardedMuon the same placement, flops_per_second, ns_steps and cost model"
                )


def tensor_view(slot: Slot) -> StepTensor:
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
    return pieces(tensor_view(slot))


def _piece(slot: Slot, result: torch.Tensor) -> torch.Tensor:
    """This rank's part of its piece of a result: a flat chunk of a joined block is a slice of it."""
    if slot.shard is not None and slot.shard.flat_range is not None and joins(tensor_view(slot)):
        lo, hi = slot.shard.flat_range
        return result.reshape(-1)[lo:hi]
    return result
