"""What both sharded optimizers share: placing every parameter, and the step.

Every parameter gets its layouts (param, grad, state, and any state kept in a layout of its
own) from the spec, or from its DTensor placements, and this rank's part of its state
(:class:`StateShard`). A step runs one step plan (``planner.step``), built once for the
gradients' layouts and cached:

1. before the update, one collective per bucket: every gradient into the state layout, every
   parameter's state-layout shard (while it has no fp32 master; usually a slice), every
   state kept in its own layout into the state layout (``runtime.buckets``);
2. the optimizer math on the local shards, whole flat buffers at a time
   (``runtime.optim.flat``); the partial sums it needs (CAME) are completed phase by phase,
   all tensors' sums of a phase batched (``sums.plan_collectives``);
3. after it, one collective per bucket again: every updated parameter into its param layout,
   every own-layout state back into its layout.

The math writes new state buffers and never the ones it reads; only when all of that
succeeded are the parameters written and the new buffers swapped in. An error in any
collective or reduction (a bad layout, a peer that died) raises :class:`OptimizerStepError`
naming the bucket or tensor, and leaves this rank's parameters and states as they were. (A
rank whose peers failed after it had finished cannot know; ranks that raise are consistent
with each other.)

Parameters in a lower precision than the states (bf16) keep an fp32 master shard in the
state layout (state ``master``); otherwise the parameter's state-layout shard is taken from
the parameter each step.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from planner.cost import CostModel
from planner.legs import AFTER, BEFORE, DEFAULT_OVERLAP_BUCKET_BYTES, StepTensor, without_axis
from planner.step import StepPlan, plan_step
from runtime import stats
from runtime.buckets import StageRun
from runtime.buffers import KeptViews, Scratch
from runtime.comm import collective, default_device, timeout_of
from runtime.dtypes import as_dtype, dtype_name
from runtime.errors import DistributedError, PlanMismatchError, ReshardError
from runtime.executor import fingerprint
from runtime.groups import axis_ranks, group_for, ranks_group
from runtime.optim import full_state
from runtime.optim.dtensors import dtensor_grad_layout, dtensor_param_layouts
from runtime.optim.errors import OptimizerError, OptimizerStepError
from runtime.optim.flat import FlatStates
from runtime.optim.memory import MemoryReport
from runtime.optim.shards import StateShard
from runtime.optim.sums import SumReducer, SumSpec, plan_collectives
from runtime.step_program import StepProgram, compile_step
from shardlang.dtypes import ITEMSIZE
from shardlang.errors import ShardlangError
from shardlang.interop import is_dtensor
from shardlang.layout import Layout
from shardlang.mesh import Mesh
from shardlang.spec import STATE_DEFAULT, Layouts, Spec, TensorSpec

STATE_DICT_FORMAT = "shardlang.sharded_optimizer/1"
# How long a rank whose step failed waits to tell the others (see ShardedOptimizer._agree).
FAILURE_NOTICE = datetime.timedelta(seconds=2)

SpecLike = Spec | Mapping[str, Layouts | TensorSpec] | None
# The math of the step's tensors: yields the partial sums of each phase, is sent them
# completed; it writes its results into the destinations it was given.
Update = Generator[list[torch.Tensor], list[torch.Tensor], None]


class StepOptions(TypedDict, total=False):
    """The options both sharded optimizers take besides their hyperparameters (see
    :class:`~runtime.optim.ShardedAdamW` for what each does)."""

    flat_axis: str | int | None
    state_dtype: torch.dtype | None
    timeout: float | datetime.timedelta | None
    bucket_bytes: int | None
    verify: bool
    max_grad_norm: float | None
    skip_nonfinite: bool
    idle_ranks: bool
    all_ranks_commit: bool
    overlap: bool
    reduce_dtype: torch.dtype | None
    cost: CostModel | None
    transactional: bool
    free_grads: bool


@attrs.define(eq=False)
class Slot:
    """One parameter as this rank's optimizer sees it."""

    index: int  # in the optimizer's order (the step plan's and the flat buffers')
    name: str
    param: torch.Tensor
    shape: tuple[int, ...]  # the whole tensor's
    group: dict[str, Any]
    param_layout: Layout
    grad_layout: Layout | None  # None: read from the gradient (DTensor)
    state_layout: Layout
    own_layouts: dict[str, Layout]  # states kept in a layout of their own
    shard: StateShard | None  # None: this rank is outside the tensor's mesh
    flat_axis: int | None
    device_mesh: DeviceMesh | None
    dtype: torch.dtype  # of the states and the math
    cost: CostModel  # the reshards are planned under
    own_states: dict[str, torch.Tensor] = attrs.field(factory=dict)  # pieces in their own layouts
    step: int = 0
    # A DTensor's gradient layout and dtype at its last step: what overlap plans the next for.
    seen_grad: tuple[Layout, torch.dtype] | None = None
    # free_grads: the gradient a bucket packed and that was then freed: an empty tensor of its
    # dtype standing in for it until the step, and its layout (None: the parameter's .grad).
    taken: tuple[torch.Tensor, Layout] | None = None
    # local_param's alias, and the address, dtype, shape and strides it was made for.
    _local: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)
    _local_of: tuple[object, ...] = attrs.field(default=(), init=False, repr=False)

    @property
    def needs_master(self) -> bool:
        return self.param.dtype != self.dtype

    def local_param(self) -> torch.Tensor:
        """The rank's piece of the parameter: a DTensor's local tensor, else the parameter
        detached, the same tensor from call to call while the parameter keeps its memory, so
        that a step's views of it are made once (``runtime.buckets``, stable legs)."""
        param = self.param
        if is_dtensor(param):
            return param.to_local()
        # While the alias lives its memory cannot be reused, so an equal address is the same
        # memory; ``param.data = ...`` gives the parameter new memory or a new geometry.
        now = (param.data_ptr(), param.dtype, param.shape, param.stride())
        if self._local is None or now != self._local_of:
            self._local, self._local_of = param.detach(), now
        return self._local

    def local_grad(self) -> tuple[torch.Tensor, Layout]:
        if self.taken is not None:
            return self.taken
        grad = self.param.grad
        assert grad is not None
        if is_dtensor(grad):
            return grad.to_local(), dtensor_grad_layout(self.name, grad, self.grad_layout)
        if self.grad_layout is None:
            raise OptimizerError(f"tensor '{self.name}' is a DTensor but its gradient is a plain tensor")
        return grad, self.grad_layout

    def own_piece_shape(self, state: str, rank: int) -> tuple[int, ...]:
        """The shape of ``rank``'s piece of a state kept in its own layout."""
        return self.own_layouts[state].rank_piece(self.shape, rank).shape


@attrs.frozen
class StateWhere:
    """Where a state lies: its layout and the global shape that layout divides, the base
    layout when it is a flat chunk of it, and the shape of the rank's piece."""

    layout: Layout
    shape: tuple[int, ...]
    flat_of: Layout | None
    local_shape: tuple[int, ...]

    def record(self) -> dict[str, Any]:
        return {
            "layout": str(self.layout),
            "mesh": self.layout.mesh.describe(),
            "shape": list(self.shape),
            "flat_of": None if self.flat_of is None else str(self.flat_of),
        }


@attrs.frozen(eq=False)
class HeldTensor:
    """One parameter as this rank's optimizer holds it (for checkpoints): its whole shape,
    param layout and local piece (a DTensor's local tensor; not a copy), and, for every
    state the optimizer keeps for it, where that state lies and its current value (none
    before the first step); states are of ``state_dtype``."""

    name: str
    shape: tuple[int, ...]
    param_layout: Layout
    param: torch.Tensor
    step: int
    state_dtype: torch.dtype
    wheres: Mapping[str, StateWhere]
    states: Mapping[str, torch.Tensor]


@attrs.frozen
class StepTraffic:
    """What one step communicates on this rank, as planned: bucket bytes and collectives
    (the step plan), statistics all-reduces and their bytes (``sums.plan_collectives``), and
    the all-reduce of the commit flag (``all_ranks_commit``), and whole matrices moved (Muon)."""

    reshard_bytes: int = 0
    reshard_collectives: int = 0
    sum_bytes: int = 0
    sum_collectives: int = 0
    commit_bytes: int = 0
    commit_collectives: int = 0
    # Whole matrices moved for an iteration over them (Muon's Newton-Schulz; runtime.optim.muon).
    matrix_bytes: int = 0
    matrix_collectives: int = 0

    @property
    def bytes(self) -> int:
        return self.reshard_bytes + self.sum_bytes + self.commit_bytes + self.matrix_bytes

    @property
    def collectives(self) -> int:
        return self.reshard_collectives + self.sum_collectives + self.commit_collectives + self.matrix_collectives


class StepWork:
    """What the math of one step gets, per stepped slot ``i`` (in the optimizer's order): the
    gradient and parameter in the state layout (``grads[i]``, ``params[i]``: possibly views),
    the states as they are (:meth:`state`), and where to write the new parameter
    (``new_params[i]``) and states (:meth:`new_state`). :meth:`states_of` gives the states of
    consecutive slots as one range of their flat buffer, for whole-buffer math."""

    def __init__(
        self,
        slots: Sequence[Slot],
        grads: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
        new_params: Sequence[torch.Tensor],
        flat: FlatStates,
        new_buffers: Mapping[Any, torch.Tensor],
        own: Mapping[tuple[int, str], torch.Tensor],
    ) -> None:
        self.slots, self.grads, self.params, self.new_params = tuple(slots), tuple(grads), tuple(params), new_params
        self._flat, self._new_buffers, self._own = flat, new_buffers, own
        # In place (new_params are params, new_buffers the states' own): nothing is allocated.
        self.in_place = new_params is params
        self.own_new = (
            dict(own)
            if self.in_place
            else {key: torch.empty_like(value, dtype=slots[key[0]].dtype) for key, value in own.items()}
        )

    @classmethod
    def in_place_of(
        cls,
        slots: Sequence[Slot],
        grads: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
        flat: FlatStates,
        own: Mapping[tuple[int, str], torch.Tensor],
    ) -> StepWork:
        """The work of an update in place: ``params`` and the states are read and written."""
        return cls(slots, grads, params, params, flat, flat.buffers, own)

    def state(self, i: int, name: str) -> torch.Tensor:
        own = self._own.get((i, name))
        return own if own is not None else self._flat.view(self.slots[i].index, name)

    def new_state(self, i: int, name: str) -> torch.Tensor:
        own = self.own_new.get((i, name))
        return own if own is not None else self._flat.view(self.slots[i].index, name, self._new_buffers)

    def runs(self) -> list[list[int]]:
        """Indices of ``slots`` in runs of consecutive slots sharing param group, step count,
        dtype and device: what one whole-buffer update covers."""
        runs: list[list[int]] = []
        last: tuple | None = None
        for i, slot in enumerate(self.slots):
            key = (id(slot.group), slot.step, slot.dtype, self.grads[i].device)
            if key != last:
                runs.append([])
                last = key
            runs[-1].append(i)
        return runs

    def states_of(self, run: Sequence[int], name: str, *, new: bool = False) -> torch.Tensor | None:
        """State ``name`` (new: its destination) of the slots ``run`` as one flat range, when
        they lie one after another in its buffer; else ``None``."""
        if any((i, name) in self._own for i in run):
            return None
        return self._flat.run([self.slots[i].index for i in run], name, self._new_buffers if new else None)


@attrs.frozen(eq=False)
class _Compiled:
    """A step plan, this rank's program of it, per (tensor, leg) the leg's index in it, and
    the legs whose input is the same tensor every step (a parameter's piece, a new parameter's
    place in a kept buffer: ``StageRun``'s ``stable``)."""

    plan: StepPlan
    program: StepProgram
    legs: Mapping[tuple[str, str], int]
    stable: frozenset[int]


@attrs.define(eq=False)
class _Backward:
    """The buckets before the update of the coming step, started during backward (``overlap``):
    the slots and plan they were started for (``run`` is None when the plan is not known yet:
    a DTensor whose gradient has not been seen), the first error met (raised in ``step()``,
    after every bucket has run, so that no peer waits for this rank), whether a gradient
    arrived in another layout than planned (then ``step()`` waits the buckets out and runs
    without them), and each gradient given to them as it was then (``fed``: per slot index
    its memory and version, :func:`_memory_and_version`)."""

    slots: list[Slot]
    compiled: _Compiled | None
    run: StageRun | None
    error: ShardlangError | None = None
    stale: bool = False
    fed: dict[int, tuple[int, int]] = attrs.field(factory=dict)
    # free_grads: the gradient legs by their index, and those whose packed gradient was freed.
    grad_legs: dict[int, Slot] | None = None
    freed: set[int] = attrs.field(factory=set)


@attrs.frozen(eq=False)
class _Reduced:
    """The gradients brought into their state layout and their norm by ``clip_grad_norm_``,
    for the ``step()`` that follows: valid while the gradients are the same tensors, unchanged
    (``grads``: their data pointers and versions)."""

    compiled: _Compiled
    slots: list[Slot]
    grads: tuple[tuple[int, int], ...]
    arrived: dict[int, torch.Tensor]
    waited: float
    norm: torch.Tensor
    norm_traffic: tuple[int, int]
    max_norm: float


@attrs.define(eq=False)
class _Gathers:
    """The gathers after a committed step (``prefetch_params``): which legs bring each slot's
    parameter, and the slots not yet written."""

    run: StageRun
    legs: Mapping[int, int]  # slot index -> its "state -> param" leg
    waiting: dict[int, Slot]
    step: int
    # Per slot index, its parameter's memory and version at the commit: a parameter written
    # since (``model.load_state_dict``) is not overwritten by its gather.
    written: Mapping[int, tuple[int, int]]


@attrs.frozen(eq=False)
class _Staged:
    """A step run on this rank without changing anything (:meth:`ShardedOptimizer._stage`):
    ``commit`` makes it take effect; ``abandon``, when another rank failed it, waits out the
    collectives it left in flight (``prefetch_params``' gathers), whose buffers the next step
    reuses."""

    commit: Callable[[], None]
    abandon: Callable[[], None] = lambda: None


def done() -> Update:
    """The update of math that needs no sums (it has already written its results)."""
    return
    yield  # a generator that yields nothing


class ShardedOptimizer(torch.optim.Optimizer):
    """Base of :class:`ShardedAdamW` and :class:`ShardedCAME`; subclasses give the states,
    the math and its phases of sums."""

    phases: tuple[str, ...] = ()
    # Whether an update runs collectives besides its phases' sums (a failed one is not joined:
    # :meth:`_join_after`).
    updates_communicate = False
    # Whether the math can update states and parameters in place (``StepWork.in_place``): then,
    # unless ``transactional``, a step commits before its math (docs/memory.md).
    updates_in_place = False

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]],
        spec: SpecLike,
        defaults: dict[str, Any],
        *,
        flat_axis: str | int | None = None,
        state_dtype: torch.dtype | None = None,
        timeout: float | datetime.timedelta | None = None,
        bucket_bytes: int | None = None,
        verify: bool = True,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = False,
        idle_ranks: bool = False,
        all_ranks_commit: bool = True,
        overlap: bool = False,
        reduce_dtype: torch.dtype | None = None,
        cost: CostModel | None = None,
        transactional: bool = False,
        free_grads: bool = False,
    ) -> None:
        named = list(named_params)
        if not named:
            raise OptimizerError(f"{type(self).__name__} got no parameters")
        try:
            super().__init__(named, defaults)
        except (TypeError, ValueError) as e:
            raise OptimizerError(f"{type(self).__name__}: {e}") from None
        if any("param_names" not in g for g in self.param_groups):
            raise OptimizerError(
                f"{type(self).__name__} needs named parameters: pass model.named_parameters(), not model.parameters()"
            )
        if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes < 1):
            raise OptimizerError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise OptimizerError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")
        self.timeout = timeout_of(timeout, OptimizerError)
        self.bucket_bytes = DEFAULT_OVERLAP_BUCKET_BYTES if bucket_bytes is None and overlap else bucket_bytes
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.skip_nonfinite = skip_nonfinite
        # The global norm of the last step's reduced gradients (with max_grad_norm or
        # skip_nonfinite), and whether that step was skipped for a NaN or inf in them.
        self.last_grad_norm: torch.Tensor | None = None
        self.last_step_skipped = False
        self.verify = verify
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self._reducer = SumReducer(self.rank, self.timeout)
        self.idle_ranks = idle_ranks
        self.all_ranks_commit = all_ranks_commit
        # In place behind an early commit point, or the whole step on spare buffers, swapped in
        # when every rank finished it (docs/memory.md, "The commit point").
        self.transactional = bool(transactional) or not self.updates_in_place
        # ZeRO-2 proper: each gradient freed once its bucket packed it, during backward with
        # overlap, in step() without (docs/memory.md).
        self.free_grads = bool(free_grads)
        if reduce_dtype is not None and reduce_dtype not in (torch.float32, torch.float64):
            raise OptimizerError(f"reduce_dtype must be torch.float32 or torch.float64, got {reduce_dtype!r}")
        # Gradients in a lower precision are reduced in this one (FSDP2's MixedPrecisionPolicy).
        self.reduce_dtype = reduce_dtype
        self._placing = (spec, flat_axis, state_dtype)  # how add_param_group places parameters
        if cost is not None and not isinstance(cost, CostModel):
            raise OptimizerError(f"cost must be a planner.CostModel, got {type(cost).__name__}")
        # One model for choosing and for running the plans (``shardlang plan --costs``); by
        # default the spec's hints for each state mesh.
        self._cost = cost
        self._slots: list[Slot] = []
        for group in self.param_groups:
            self._slots += self._place_group(group)
        self._flat: FlatStates | None = None  # allocated at the first step
        self._scratch = Scratch()  # the step's working buffers, kept between steps
        self._views = KeptViews()  # the math's views of kept buffers (runtime.buffers)
        # _fresh_params' views per set of slots stepped, with the buffers they are views of.
        self._fresh_views: dict[tuple[int, ...], tuple[dict[int, torch.Tensor], list[tuple[Any, int, int]]]] = {}
        self._bucket_buffers = Scratch()  # the buckets' buffers (``runtime.buckets``)
        self._plans: dict[tuple, _Compiled] = {}
        self._last_plan: tuple[tuple, _Compiled] | None = None  # the one the last step ran
        self._members_of: dict[tuple[int, ...], tuple[int, ...]] = {}  # per set of slots stepped
        self._flag: torch.Tensor | None = None  # the commit flag, reduced in place
        self.last_traffic = StepTraffic()
        # Overlap (README, "Overlap"): buckets started during backward, gathers after the step.
        self.overlap = bool(overlap)
        self._sync = True  # False inside no_sync()
        self._backward: _Backward | None = None
        self._overlap_lost = False  # whether a step has said that it reduced gradients again
        self._prefetch = False
        self._gathers: _Gathers | None = None
        self._gather_failure: str | None = None
        self._reduced: _Reduced | None = None  # clip_grad_norm_'s, for the next step
        self._hooks: list[Any] = []
        # Seconds the last step spent blocked waiting for its buckets' collectives.
        self.last_wait_seconds = 0.0
        if self.overlap:
            self._hook_grads(self._slots)

    # --- what subclasses give ----------------------------------------------------------
    def _state_shapes(self, slot: Slot) -> dict[str, tuple[int, ...]]:
        """The local shape of every state the slot keeps in its state layout (master excluded)."""
        raise NotImplementedError

    def _updates(self, work: StepWork) -> list[Update]:
        """The math of the step: generators (see :data:`Update`), each yielding once per
        phase the sums of its slots in :meth:`_sum_specs` order; their slots, in order, are
        ``work.slots``."""
        raise NotImplementedError

    def _sum_specs(self, slot: Slot) -> tuple[tuple[SumSpec, ...], ...]:
        """Per phase, the sums the slot's math yields, in order."""
        return tuple(() for _ in self.phases)

    def _where(self, slot: Slot, name: str) -> StateWhere:
        """Where state ``name`` lies; by default it has the parameter's shape."""
        assert slot.shard is not None
        if name in slot.own_layouts:
            layout = slot.own_layouts[name]
            return StateWhere(layout, slot.shape, None, slot.own_piece_shape(name, self.rank))
        layout, shape = slot.shard.data_layout()
        flat_of = slot.shard.layout if slot.flat_axis is not None else None
        return StateWhere(layout, shape, flat_of, slot.shard.local_shape)

    # --- placing parameters ------------------------------------------------------------
    def _place_group(self, group: dict[str, Any]) -> list[Slot]:
        spec, flat_axis, state_dtype = self._placing
        start = len(self._slots)
        return [
            self._place(start + k, name, p, group, spec, flat_axis, state_dtype)
            for k, (name, p) in enumerate(zip(group["param_names"], group["params"], strict=True))
        ]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of named parameters (``{"params": list(module.named_parameters()),
        "lr": ...}``), placed from the spec like the first ones; nothing changes unless every
        one of them is placed."""
        if not hasattr(self, "_slots"):  # torch.optim.Optimizer.__init__ adds the first groups
            super().add_param_group(param_group)
            return
        try:
            super().add_param_group(param_group)
        except (TypeError, ValueError) as e:
            raise OptimizerError(f"{type(self).__name__}.add_param_group: {e}") from None
        group = self.param_groups[-1]
        try:
            if "param_names" not in group:
                raise OptimizerError(
                    f"{type(self).__name__}.add_param_group needs named parameters: "
                    "{'params': list(module.named_parameters()), ...}"
                )
            placed = self._place_group(group)
        except OptimizerError:
            self.param_groups.pop()
            raise
        self._slots += placed
        if self.overlap:
            self._hook_grads(placed)
        if self._flat is not None:  # the flat buffers grow; the states kept so far move along
            old, self._flat = self._flat, None
            grown = self._flat_states()
            for slot in self._slots[: len(self._slots) - len(placed)]:
                for name in self._state_names(slot):
                    if old.has(slot.index, name):
                        grown.view(slot.index, name).copy_(old.view(slot.index, name))

    def _place(
        self,
        index: int,
        name: str,
        param: torch.Tensor,
        group: dict[str, Any],
        spec: SpecLike,
        flat_axis: str | int | None,
        state_dtype: torch.dtype | None,
    ) -> Slot:
        try:
            shape, param_layout, grad_layout, state_layout, own, device_mesh = _layouts(name, param, spec)
            # A spec file's cost hints for the state mesh (bandwidth, latency) steer the plans.
            if self._cost is not None:
                cost = self._cost
            elif isinstance(spec, Spec):
                cost = CostModel.from_hints(spec.hints(state_layout.mesh))
            else:
                cost = CostModel()
            for layout in (param_layout, grad_layout, state_layout, *own.values()):
                if layout is not None:
                    layout.check_shape(shape)
            if param_layout.is_partial or state_layout.is_partial or any(lay.is_partial for lay in own.values()):
                raise OptimizerError("its param and state layouts must not be partial")
            for layout in (param_layout, grad_layout, *own.values()):
                if layout is not None and not layout.mesh.same_geometry(state_layout.mesh):
                    raise OptimizerError(
                        f"its layouts lie on different meshes ({layout.mesh.describe()} and "
                        f"{state_layout.mesh.describe()}); an optimizer step moves tensors within one mesh"
                    )
            axis = None if flat_axis is None else state_layout.mesh.axis_index(flat_axis)
            block = state_layout if axis is None else without_axis(state_layout, axis)
            inside = self.rank in state_layout.mesh.ranks
            if not inside and not self.idle_ranks:
                mesh = state_layout.mesh
                raise OptimizerError(
                    f"rank {self.rank} holds it, but its state mesh {mesh.describe()} is ranks "
                    f"{_ranks_text(mesh.ranks)}: this rank would never update it; give the spec a mesh "
                    "over every rank that holds the tensor, or pass idle_ranks=True where a rank holds "
                    "tensors it does not step (a pipeline stage)"
                )
            shard = StateShard.of(shape, block, self.rank, axis) if inside else None
            if inside and not is_dtensor(param):
                piece = param_layout.rank_piece(shape, self.rank).shape
                if piece != tuple(param.shape):
                    raise OptimizerError(
                        f"rank {self.rank} holds a piece of shape {list(param.shape)}, but its param layout "
                        f"'{param_layout}' gives it {list(piece)} of {list(shape)}"
                    )
        except ShardlangError as e:
            raise OptimizerError(f"tensor '{name}': {e.message}") from None
        dtype = state_dtype or (param.dtype if param.dtype in (torch.float32, torch.float64) else torch.float32)
        slot = Slot(
            index=index,
            name=name,
            param=param,
            shape=shape,
            group=group,
            param_layout=param_layout,
            grad_layout=grad_layout,
            state_layout=state_layout,
            own_layouts=own,
            shard=shard,
            flat_axis=axis,
            device_mesh=device_mesh,
            dtype=dtype,
            cost=cost,
        )
        if shard is not None:
            self._check_own_layouts(slot)
        return slot

    def _check_own_layouts(self, slot: Slot) -> None:
        """Only a state of the parameter's shape can be kept in a layout of its own."""
        shapes = self._state_shapes(slot)
        assert slot.shard is not None
        for state in slot.own_layouts:
            if state not in shapes:
                raise OptimizerError(
                    f"tensor '{slot.name}': the spec gives state.{state} a layout, but {type(self).__name__} keeps "
                    f"no state '{state}' for it (it keeps {', '.join(sorted(shapes))})"
                )
            if shapes[state] != slot.shard.local_shape:
                raise OptimizerError(
                    f"tensor '{slot.name}': state.{state} does not have the parameter's shape "
                    f"({type(self).__name__} derives it from the state layout), so it cannot have a layout of its own"
                )

    # --- the step plan -----------------------------------------------------------------
    def _stepped(self) -> list[Slot]:
        return [s for s in self._slots if s.shard is not None and (s.param.grad is not None or s.taken is not None)]

    def _compiled(self, slots: Sequence[Slot], grads: Sequence[tuple[Layout, torch.dtype]]) -> _Compiled:
        """The step plan for these slots and their gradients' layouts and dtypes, built once
        per combination."""
        key = tuple(
            (slot.index, layout, self._wire_dtype(dtype), slot.needs_master and slot.step > 0)
            for slot, (layout, dtype) in zip(slots, grads, strict=True)
        )
        # Most steps run the plan of the last one: an equality test of the key, whose layouts
        # are then the same objects, costs less than hashing it.
        if self._last_plan is not None and self._last_plan[0] == key:
            return self._last_plan[1]
        compiled = self._plans.get(key)
        if compiled is None:
            tensors = [
                StepTensor(
                    name=slot.name,
                    shape=slot.shape,
                    param=slot.param_layout,
                    grad=layout,
                    state=slot.state_layout,
                    param_dtype=dtype_name(slot.param.dtype),
                    grad_dtype=dtype_name(self._wire_dtype(dtype)),
                    state_dtype=dtype_name(slot.dtype),
                    own_states=tuple(sorted(slot.own_layouts.items())),
                    flat_axis=slot.flat_axis,
                    fetch_param=not (slot.needs_master and slot.step > 0),
                    cost=slot.cost,
                )
                for slot, (layout, dtype) in zip(slots, grads, strict=True)
            ]
            try:
                plan = plan_step(
                    tensors, self.rank, bucket_bytes=self.bucket_bytes, overlap=self.overlap, prefetch=self._prefetch
                )
            except ShardlangError as e:
                raise OptimizerError(e.message) from None
            legs = {(leg.tensor, leg.what): i for i, leg in enumerate(plan.legs)}
            try:
                program = compile_step(plan, self.rank, write_through=not self.transactional)
            except ShardlangError as e:
                raise OptimizerError(e.message) from None
            if self.verify:
                self._verify(plan)
            stable = frozenset(
                legs[(slot.name, what)]
                for slot in slots
                for what in ("param -> state", "state -> param")
                if (slot.name, what) in legs and not (what == "state -> param" and slot.needs_master)
            )
            compiled = self._plans[key] = _Compiled(plan, program, legs, stable)
        self._last_plan = (key, compiled)
        return compiled

    def step_plan(self) -> StepPlan:
        """The plan of the next step, for the parameters that have gradients now."""
        slots = self._stepped()
        return self._compiled(slots, [_grad_key(s) for s in slots]).plan

    def _verify(self, plan: StepPlan) -> None:
        """Every rank of every group a bucket runs on holds the same buckets for it (in order,
        with the same members and sizes): a digest per group, all-gathered once per plan."""
        groups: dict[tuple, tuple[Mesh, list[dict[str, Any]]]] = {}
        for bucket in plan.buckets:
            if bucket.axis is None:
                continue
            record = bucket.to_json() | {
                "members": [(plan.legs[m.leg].tensor, plan.legs[m.leg].what, m.hop, m.step) for m in bucket.members]
            }
            key = (bucket.mesh.shape, bucket.mesh.ranks, bucket.axis)
            groups.setdefault(key, (bucket.mesh, []))[1].append(record)
        for (_, _, axis), (mesh, records) in sorted(groups.items(), key=lambda item: item[0]):
            members = axis_ranks(mesh, (axis,), self.rank)
            mine = fingerprint(records)
            device = next(iter(self._slots)).local_param().device
            try:
                group = group_for(mesh, (axis,), members, timeout=self.timeout)
                gathered = collective(
                    "all_gather",
                    torch.tensor([mine], dtype=torch.int64, device=device),
                    len(members),
                    None,
                    group,
                    self.timeout,
                )
            except DistributedError as e:
                raise OptimizerStepError(f"checking the step plan on ranks {list(members)} failed: {e.message}") from e
            prints = gathered.tolist()
            if any(p != mine for p in prints):
                differ = [r for r, p in zip(members, prints, strict=True) if p != mine]
                raise PlanMismatchError(
                    f"the ranks of {mesh.describe()} along axis {mesh.axis_label(axis)} disagree on the step plan: "
                    f"rank {self.rank}'s buckets ({len(records)} on this axis) differ from those of ranks {differ}; "
                    "every rank must give the optimizer the same parameters, layouts and gradients"
                )

    # --- the step ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait_params()
        if self._gather_failure is not None:
            raise OptimizerStepError(self._gather_failure)
        backward, self._backward = self._backward, None
        slots = self._stepped()
        if not slots:
            if backward is not None and backward.run is not None:
                backward.run.drain()
            return loss
        members = self._members(slots)
        try:
            try:
                staged = self._stage(slots, backward)
            except Exception:
                self._agree(members, ok=False)  # the others must not commit either
                raise
            if not self._agree(members, ok=True):
                staged.abandon()
                raise OptimizerStepError(
                    f"step {min(s.step for s in slots) + 1} failed on another rank of {_ranks_text(members)}; "
                    "parameters and optimizer states are unchanged on every rank"
                )
            staged.commit()
            if self.free_grads:  # those no bucket packed, which the math read where they were
                for slot in slots:
                    slot.param.grad = None
        finally:
            for slot in slots:  # freed gradients are used once, by this step, whatever it did
                slot.taken = None
        return loss

    def _members(self, slots: Sequence[Slot]) -> tuple[int, ...]:
        """The ranks that must agree on a step of ``slots``: those of their state meshes."""
        key = tuple(slot.index for slot in slots)
        members = self._members_of.get(key)
        if members is None:
            members = self._members_of[key] = tuple(sorted({r for s in slots for r in s.state_layout.mesh.ranks}))
        return members

    def _flag_traffic(self, slots: Sequence[Slot]) -> tuple[int, int]:
        """Bytes and collectives of the commit flag's all-reduce (the cost model's all_reduce
        row for one int32: ``2 (n-1)`` elements sent)."""
        n = len(self._members(slots))
        if not self.all_ranks_commit or n < 2 or not dist.is_initialized():
            return 0, 0
        flags = 1 if self.transactional else 2  # in place: before the math and after it (_staged_in_place)
        return flags * 2 * (n - 1) * 4, flags

    def _agree(self, members: tuple[int, ...], *, ok: bool) -> bool:
        """Whether every rank of ``members`` (the ranks of the meshes of the tensors stepped)
        finished its step: one bounded all-reduce of a flag, so that a step commits on all of
        them or on none. A rank that cannot reach the others counts as failed. A rank that failed
        only tells the others, and waits for them briefly (:data:`FAILURE_NOTICE`): whether it
        reaches them or not, none of them commits, since success needs every rank's flag."""
        if not self.all_ranks_commit or len(members) < 2 or not dist.is_initialized():
            return ok
        if self._flag is None:
            self._flag = torch.empty(1, dtype=torch.int32, device=default_device())
        flag = self._flag.fill_(1 if ok else 0)
        wait = self.timeout if ok else min(self.timeout, FAILURE_NOTICE)
        started = time.perf_counter()
        try:
            group = ranks_group(members, timeout=self.timeout)
            agreed = collective("all_reduce", flag, len(members), "min", group, wait)
        except DistributedError:
            return False
        if stats.is_recording():
            n = len(members)
            stats.record(
                stats.CommRecord(
                    tensor=None,
                    step=0,
                    op="all_reduce",
                    axis=None,
                    ranks=members,
                    bytes_sent=2 * (n - 1) * 4,
                    planned_bytes=2 * (n - 1) * 4,
                    seconds=time.perf_counter() - started,
                )
            )
        return bool(agreed.item() == 1)

    def _flat_states(self) -> FlatStates:
        if self._flat is None:
            entries = []
            for slot in self._slots:
                if slot.shard is None:
                    continue
                shapes = {k: v for k, v in self._state_shapes(slot).items() if k not in slot.own_layouts}
                if slot.needs_master:
                    shapes["master"] = slot.shard.local_shape
                entries.append((slot.index, shapes, slot.dtype, slot.local_param().device))
            self._flat = FlatStates(entries)
        return self._flat

    def _stage(self, slots: list[Slot], backward: _Backward | None = None) -> _Staged:
        """Run the step's communication and math without changing anything; returns what
        commits it. ``backward``: the buckets already started during backward."""
        again = [s.name for s in slots if s.taken is not None and s.param.grad is not None]
        if again:
            if backward is not None and backward.run is not None:
                backward.run.drain()
            raise OptimizerError(
                f"the gradient of {_names_text(again)} was accumulated again after its bucket had taken and "
                "freed it (free_grads=True): accumulate micro-batches inside optimizer.no_sync(), or pass "
                "free_grads=False"
            )
        grads = [slot.local_grad() for slot in slots]
        compiled = self._compiled(slots, [(layout, grad.dtype) for grad, layout in grads])
        for slot, (grad, layout) in zip(slots, grads, strict=True):
            if is_dtensor(slot.param):
                slot.seen_grad = (layout, grad.dtype)
        step_number = min(s.step for s in slots) + 1
        reduced, self._reduced = self._reduced, None
        if reduced is not None and (
            reduced.compiled is not compiled or reduced.slots != slots or reduced.grads != _grad_versions(grads)
        ):
            reduced = None  # the gradients changed since clip_grad_norm_: reduce them again
        before = self._started(backward, compiled, slots, grads, step_number)
        try:
            return self._staged(slots, grads, compiled, step_number, before, backward, reduced)
        except Exception:
            if before is not None:
                before.drain()
            raise

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients the coming ``step()`` applies to the global 2-norm ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does on one device, and return their norm before
        clipping (the same on every rank). The norm is taken where it is exact, on the reduced
        gradients in their state layout: this brings them there (the step's buckets before the
        update) and keeps them for the ``step()`` that must follow, which then does not reduce
        them again. Call it on every rank, after backward, right before ``step()``."""
        if norm_type != 2.0:
            raise OptimizerError(f"clip_grad_norm_ takes the 2-norm only (norm_type=2.0), got norm_type={norm_type!r}")
        if not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise OptimizerError(f"max_norm must be a positive number, got {max_norm!r}")
        self.wait_params()
        slots = self._stepped()
        backward, self._backward = self._backward, None
        if not slots:
            return torch.zeros((), device=default_device())
        grads = [slot.local_grad() for slot in slots]
        compiled = self._compiled(slots, [(layout, grad.dtype) for grad, layout in grads])
        step_number = min(s.step for s in slots) + 1
        before = self._started(backward, compiled, slots, grads, step_number)
        try:
            arrived, waited = self._reduce_before(slots, grads, compiled, step_number, before, backward)
            reduced = [arrived[compiled.legs[(s.name, "grad -> state")]] for s in slots]
            norm, norm_bytes, norm_collectives = self._grad_norm(slots, reduced, step_number)
        except Exception:
            if before is not None:
                before.drain()
            raise
        grads = [slot.local_grad() for slot in slots]  # with free_grads, the stand-ins of those freed
        self._reduced = _Reduced(
            compiled, slots, _grad_versions(grads), arrived, waited, norm, (norm_bytes, norm_collectives), max_norm
        )
        return norm

    def _reduce_before(
        self,
        slots: list[Slot],
        grads: list[tuple[torch.Tensor, Layout]],
        compiled: _Compiled,
        step_number: int,
        before: StageRun | None,
        backward: _Backward | None,
    ) -> tuple[dict[int, torch.Tensor], float]:
        """The buckets before the update not started during backward, then all waited on: every
        leg's piece in the state layout, and the seconds spent waiting."""
        legs = compiled.legs
        inputs: dict[int, torch.Tensor] = {}
        for slot, (grad, _) in zip(slots, grads, strict=True):
            inputs[legs[(slot.name, "grad -> state")]] = as_dtype(grad, self._wire_dtype(grad.dtype))
            inputs |= self._before_inputs(compiled, slot, grad.device)
        if before is None:
            before = self._stage_run(compiled, BEFORE, slots)
        try:
            before.feed({i: x for i, x in inputs.items() if i not in before.legs})
            arrived = before.finish()
        except ShardlangError as e:
            raise _failed(step_number, BEFORE, e) from e
        if self.free_grads:
            for slot, (_, layout) in zip(slots, grads, strict=True):
                taken = slot.taken is not None  # during backward already (overlap)
                if not taken and legs[(slot.name, "grad -> state")] in before.packed:
                    _take_grad(slot, layout)
        if backward is not None and backward.error is not None:
            raise _failed(step_number, BEFORE, backward.error) from backward.error
        return arrived, before.waited

    def _stage_run(
        self,
        compiled: _Compiled,
        stage: str,
        slots: Sequence[Slot],
        deliver: frozenset[int] = frozenset(),
        write_to: Mapping[int, torch.Tensor] | None = None,
    ) -> StageRun:
        return StageRun(
            compiled.program,
            stage,
            device_meshes={s.name: s.device_mesh for s in slots},
            timeout=self.timeout,
            buffers=self._bucket_buffers,
            deliver=deliver,
            stable=compiled.stable,
            write_to=write_to,
        )

    def _before_inputs(self, compiled: _Compiled, slot: Slot, device: torch.device) -> dict[int, torch.Tensor]:
        """The inputs of a slot's legs before the update other than its gradient's."""
        legs, inputs = compiled.legs, {}
        fetch = legs.get((slot.name, "param -> state"))
        if fetch is not None:
            inputs[fetch] = slot.local_param()
        for state in slot.own_layouts:
            held = slot.own_states.get(state)
            if held is None:
                held = torch.zeros(slot.own_piece_shape(state, self.rank), dtype=slot.dtype, device=device)
            inputs[legs[(slot.name, f"state.{state} -> state")]] = held
        return inputs

    def _staged(
        self,
        slots: list[Slot],
        grads: list[tuple[torch.Tensor, Layout]],
        compiled: _Compiled,
        step_number: int,
        before: StageRun | None,
        backward: _Backward | None,
        clipped: _Reduced | None = None,
    ) -> _Staged:
        plan, legs = compiled.plan, compiled.legs
        flat = self._flat_states()

        # 1. Before the update (unless clip_grad_norm_ did it): the gradients into the state layout.
        if clipped is None:
            arrived, waited = self._reduce_before(slots, grads, compiled, step_number, before, backward)
        else:
            arrived, waited = clipped.arrived, clipped.waited
        reduced = [arrived[legs[(s.name, "grad -> state")]] for s in slots]
        norm_bytes = norm_collectives = 0
        max_norm = self.max_grad_norm if clipped is None else clipped.max_norm
        if clipped is not None or self.max_grad_norm is not None or self.skip_nonfinite:
            if clipped is None:
                norm, norm_bytes, norm_collectives = self._grad_norm(slots, reduced, step_number)
            else:
                norm, (norm_bytes, norm_collectives) = clipped.norm, clipped.norm_traffic
            if self.skip_nonfinite and not bool(torch.isfinite(norm)):
                return self._skip(norm, step_number)
            if max_norm is not None:
                coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
                # As torch.nn.utils.clip_grad_norm_ scales them. On the CPU, asking whether to
                # saves a copy; on CUDA the question would be a host sync, and a product with
                # 1.0 leaves the bits as they are (docs/gpu.md).
                if coefficient.is_cuda or bool(coefficient < 1):
                    reduced = [g * coefficient.to(g.dtype) for g in reduced]
        else:
            norm = None
        if not self.transactional:
            return self._staged_in_place(
                slots, compiled, arrived, reduced, norm, step_number, waited, (norm_bytes, norm_collectives)
            )

        # 2. The math, into new buffers; new parameters where their gathers send them from.
        param_legs = {s.index: legs[(s.name, "state -> param")] for s in slots}
        after = self._stage_run(compiled, AFTER, slots, deliver=frozenset(param_legs.values()))
        new_buffers = flat.fresh(s.index for s in slots)
        fresh_params = self._fresh_params(slots, after, param_legs)
        params, new_params, own = [], [], {}
        for i, slot in enumerate(slots):
            fetch = legs.get((slot.name, "param -> state"))
            params.append(
                as_dtype(arrived[fetch], slot.dtype) if fetch is not None else flat.view(slot.index, "master")
            )
            new_params.append(
                flat.view(slot.index, "master", new_buffers) if slot.needs_master else fresh_params[slot.index]
            )
            for state in slot.own_layouts:
                own[(i, state)] = arrived[legs[(slot.name, f"state.{state} -> state")]]
        work = StepWork(
            slots,
            reduced,
            params,
            new_params,
            flat,
            new_buffers,
            own,
        )
        try:
            sum_bytes, sum_collectives = self._exchange(work, step_number)
        except _UpdateFailed as failed:
            self._join_after(after, compiled, slots)
            where = "every rank" if self.all_ranks_commit else "this rank"
            raise OptimizerStepError(
                f"step {step_number} failed in the update on rank {self.rank}: {_first_line(failed.error)}; "
                f"parameters and optimizer states are unchanged on {where}"
            ) from failed.error

        # 3. After the update; with prefetch_params the parameters' gathers are waited on later.
        inputs = {}
        for i, (slot, param) in enumerate(zip(slots, new_params, strict=True)):
            inputs[legs[(slot.name, "state -> param")]] = as_dtype(param, slot.param.dtype)
            for state in slot.own_layouts:
                inputs[legs[(slot.name, f"state -> state.{state}")]] = work.own_new[(i, state)]
        own_legs = [legs[(s.name, f"state -> state.{state}")] for s in slots for state in s.own_layouts]
        try:
            after.feed(inputs)
            back = after.wait_for(own_legs) if self._prefetch else after.finish()
        except ShardlangError as e:
            after.drain()
            raise _failed(step_number, AFTER, e) from e
        self.last_wait_seconds = waited + after.waited
        flag_bytes, flag_collectives = self._flag_traffic(slots)
        traffic = StepTraffic(
            plan.total_bytes,
            plan.collectives,
            sum_bytes + norm_bytes,
            sum_collectives + norm_collectives,
            flag_bytes,
            flag_collectives,
        )

        def commit() -> None:
            for slot in slots:
                for state in slot.own_layouts:
                    slot.own_states[state] = back[legs[(slot.name, f"state -> state.{state}")]].clone()
                slot.step += 1
            if self._prefetch:
                written = {s.index: _memory_and_version(s.local_param()) for s in slots}
                self._gathers = _Gathers(after, param_legs, {s.index: s for s in slots}, step_number, written)
            else:
                after.write({param_legs[s.index]: s.local_param() for s in slots})
            flat.replace(new_buffers)
            self.last_traffic = traffic
            self.last_grad_norm, self.last_step_skipped = norm, False

        return _Staged(commit, after.drain)

    def _staged_in_place(
        self,
        slots: list[Slot],
        compiled: _Compiled,
        arrived: Mapping[int, torch.Tensor],
        reduced: Sequence[torch.Tensor],
        norm: torch.Tensor | None,
        step_number: int,
        waited: float,
        norm_traffic: tuple[int, int],
    ) -> _Staged:
        """A step whose every check passed (the buckets before the update, the norm, the
        nonfinite test) and that has written nothing: its ``commit``, run once the ranks agreed,
        updates states and parameter shards in place and gathers the parameters
        (docs/memory.md, "The commit point")."""
        legs, flat = compiled.legs, self._flat_states()
        params: list[torch.Tensor] = []
        first_masters: list[tuple[torch.Tensor, torch.Tensor]] = []  # (master, parameter shard)
        own: dict[tuple[int, str], torch.Tensor] = {}
        for i, slot in enumerate(slots):
            fetch = legs.get((slot.name, "param -> state"))
            if slot.needs_master:
                params.append(flat.view(slot.index, "master"))
                if fetch is not None:  # its first step: the master starts as the parameter
                    first_masters.append((params[-1], arrived[fetch]))
            else:
                assert fetch is not None
                params.append(arrived[fetch])  # a view of the parameter where its layout allows
            for state in slot.own_layouts:
                own[(i, state)] = arrived[legs[(slot.name, f"state.{state} -> state")]]
                if state not in slot.own_states:  # where the stage after the update writes it
                    slot.own_states[state] = torch.zeros(
                        slot.own_piece_shape(state, self.rank), dtype=slot.dtype, device=params[-1].device
                    )
        param_legs = {s.index: legs[(s.name, "state -> param")] for s in slots}
        members = self._members(slots)

        def commit() -> None:
            failure: Exception | None = None
            try:
                for master, shard in first_masters:
                    master.copy_(shard)
                sums = self._exchange(StepWork.in_place_of(slots, reduced, params, flat, own), step_number)
            except _UpdateFailed as e:  # after the commit point: joined below, then raised everywhere
                failure, sums = e.error, (0, 0)
            except Exception as e:
                failure, sums = e, (0, 0)
            inputs = {}
            for i, slot in enumerate(slots):
                inputs[param_legs[slot.index]] = as_dtype(params[i], slot.param.dtype)
                for state in slot.own_layouts:
                    inputs[legs[(slot.name, f"state -> state.{state}")]] = own[(i, state)]
            if self._prefetch:
                after = self._stage_run(compiled, AFTER, slots, deliver=frozenset(param_legs.values()))
                write_to = {}
            else:
                write_to = {param_legs[s.index]: s.local_param() for s in slots}
                for slot in slots:
                    for state in slot.own_layouts:
                        write_to[legs[(slot.name, f"state -> state.{state}")]] = slot.own_states[state]
                after = self._stage_run(compiled, AFTER, slots, write_to=write_to)
            try:
                after.feed(inputs)
                if self._prefetch:
                    back = after.wait_for([leg for leg in inputs if leg not in param_legs.values()])
                    for slot in slots:
                        for state in slot.own_layouts:
                            slot.own_states[state].copy_(back[legs[(slot.name, f"state -> state.{state}")]])
                else:
                    after.finish()
            except Exception as e:
                after.drain()
                failure = failure or e
            if not self._agree(members, ok=failure is None) or failure is not None:
                if self._prefetch:
                    after.drain()
                where = (
                    f"rank {self.rank}: {_first_line(failure)}"
                    if failure is not None
                    else f"another rank of {_ranks_text(members)}"
                )
                self._gather_failure = (
                    f"step {step_number} failed after its commit point on {where}; the optimizer states and "
                    "parameters may hold this step in part on every rank: load a checkpoint to go on"
                )
                raise OptimizerStepError(self._gather_failure) from failure
            for slot in slots:
                slot.step += 1
            if self._prefetch:
                written = {s.index: _memory_and_version(s.local_param()) for s in slots}
                self._gathers = _Gathers(after, param_legs, {s.index: s for s in slots}, step_number, written)
            self.last_wait_seconds = waited + after.waited
            plan = compiled.plan
            self.last_traffic = StepTraffic(
                plan.total_bytes,
                plan.collectives,
                sums[0] + norm_traffic[0],
                sums[1] + norm_traffic[1],
                *self._flag_traffic(slots),
            )
            self.last_grad_norm, self.last_step_skipped = norm, False

        return _Staged(commit)

    def _joinable(self, error: Exception) -> Exception:
        """``error``, raised by this rank's math, if the rest of the step can be joined despite
        it (:meth:`_join_after`); raises it otherwise: our own errors (raised where they are
        meant to be, often on every rank alike) and any error of an update that communicates."""
        if isinstance(error, ShardlangError) or self.updates_communicate:
            raise error
        return error

    def _join_after(self, after: StageRun, compiled: _Compiled, slots: Sequence[Slot]) -> None:
        """After this rank's update failed: the stage after the update runs anyway, on zeros,
        so that the ranks it shares buckets with finish their step and learn of the failure
        from the commit flag, instead of waiting out the timeout (and leaving their groups
        broken) for collectives this rank never joins. Only where nobody commits without this
        rank (``all_ranks_commit``; updates that run collectives of their own are never joined:
        :meth:`_joinable`)."""
        if not self.all_ranks_commit or len(self._members(slots)) < 2:
            return
        device, program = slots[0].local_param().device, compiled.program
        inputs = {
            i: torch.zeros(after.source_shape(i), dtype=program.legs[i].dtype, device=device)
            for i, leg in enumerate(compiled.plan.legs)
            if leg.stage == AFTER and i not in after.legs
        }
        try:
            after.feed(inputs)
            after.finish()
        except ShardlangError:  # the step fails anyway; what it raised is the failure to report
            after.drain()

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of ``dtype`` is reduced in: ``reduce_dtype`` when it is wider."""
        wider = (
            self.reduce_dtype is not None and dtype.is_floating_point and dtype.itemsize < self.reduce_dtype.itemsize
        )
        return self.reduce_dtype if wider else dtype  # type: ignore[return-value]

    # --- overlap -----------------------------------------------------------------------
    def _hook_grads(self, slots: Sequence[Slot]) -> None:
        for slot in slots:
            if slot.shard is not None and slot.param.requires_grad:
                hook = slot.param.register_post_accumulate_grad_hook(lambda _, slot=slot: self._grad_ready(slot))
                self._hooks.append(hook)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without starting any bucket (micro-batches
        of gradient accumulation, as ``DistributedDataParallel.no_sync``); the backward after it
        starts them, and ``step()`` reduces what was accumulated once."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _grad_ready(self, slot: Slot) -> None:
        """A gradient hook (``overlap``): put the slot's gradient into the buckets before the
        update, starting each as soon as every tensor it packs is ready."""
        if not self._sync or slot.shard is None:
            return
        self.wait_params()  # the gathers' buffers are reused by these buckets
        backward = self._backward
        if backward is None:
            backward = self._backward = self._begin_backward()
        if backward.run is None or backward.stale or slot not in backward.slots:
            return
        assert backward.compiled is not None
        grad, layout = slot.local_grad()
        if (layout, grad.dtype) != _expected_grad(slot):
            backward.stale = True
            return
        leg = backward.compiled.legs[(slot.name, "grad -> state")]
        if leg in backward.run.legs or (backward.error is not None and not isinstance(backward.error, ReshardError)):
            return
        try:
            backward.run.feed({leg: as_dtype(grad, self._wire_dtype(grad.dtype))})
            backward.fed[slot.index] = _memory_and_version(grad)
            if self.free_grads:
                self._free_packed(backward)
        except ReshardError as e:  # a piece of the wrong shape: sent as zeros, raised in step()
            backward.error = backward.error or e
            if leg not in backward.run.legs:
                shape, dtype = backward.run.source_shape(leg), self._wire_dtype(grad.dtype)
                backward.run.feed({leg: torch.zeros(shape, dtype=dtype, device=grad.device)})
        except ShardlangError as e:  # a collective failed to start: raised in step()
            backward.error = backward.error or e

    def _free_packed(self, backward: _Backward) -> None:
        """Free the gradients whose buckets have packed them (``free_grads``): each parameter's
        ``.grad`` becomes ``None`` and an empty stand-in keeps its dtype and layout for the step."""
        assert backward.compiled is not None and backward.run is not None
        if backward.grad_legs is None:
            legs = backward.compiled.legs
            backward.grad_legs = {legs[(s.name, "grad -> state")]: s for s in backward.slots}
        for leg in backward.run.packed - backward.freed:
            slot = backward.grad_legs.get(leg)
            backward.freed.add(leg)
            if slot is not None and slot.param.grad is not None:
                _take_grad(slot, slot.local_grad()[1])
                backward.fed[slot.index] = _memory_and_version(slot.local_grad()[0])

    def _started(
        self,
        backward: _Backward | None,
        compiled: _Compiled,
        slots: Sequence[Slot],
        grads: Sequence[tuple[torch.Tensor, Layout]],
        step_number: int,
    ) -> StageRun | None:
        """The buckets started during backward, if they were planned for these gradients and
        were given them as they are now; else ``None``, after waiting out any that were not (the
        step then reduces the gradients as they are). A gradient changes after its bucket took it
        when a second backward accumulates into it outside :meth:`no_sync`, or when it is changed
        in place after backward (``GradScaler.unscale_``): the step then runs without overlap,
        and says so (once)."""
        if backward is None or backward.run is None:
            return None
        if backward.stale or backward.compiled is not compiled or backward.slots != list(slots):
            backward.run.drain()
            return None
        changed = [
            slot.name
            for slot, key in zip(slots, _grad_versions(grads), strict=True)
            if backward.fed.get(slot.index, key) != key
        ]
        if changed:
            backward.run.drain()
            if self._overlap_lost:
                return None
            self._overlap_lost = True
            warnings.warn(
                f"{type(self).__name__}: step {step_number}: the gradients of {_names_text(changed)} changed"
                " after backward had started reducing them, so the step reduced the gradients again, without"
                " overlap; accumulate micro-batches inside no_sync() and clip with the optimizer's"
                " clip_grad_norm_ to keep the overlap (said once)",
                stacklevel=2,
            )
            return None
        return backward.run

    def _begin_backward(self) -> _Backward:
        """The buckets of the coming step, for every slot this rank steps, with its non-gradient
        inputs given at once (they do not change during backward)."""
        slots = [s for s in self._slots if s.shard is not None and s.param.requires_grad]
        keys = [_expected_grad(slot) for slot in slots]
        if any(key is None for key in keys):  # a DTensor's gradient layout shows at its first step
            return _Backward(slots, None, None)
        compiled = self._compiled(slots, keys)  # type: ignore[arg-type]
        run = self._stage_run(compiled, BEFORE, slots)
        backward = _Backward(slots, compiled, run)
        try:
            for slot in slots:
                run.feed(self._before_inputs(compiled, slot, slot.local_param().device))
        except ShardlangError as e:
            backward.error = e
        return backward

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; a backward whose step will not come is dropped
        too: its buckets waited out, the stand-ins of the gradients it freed (``free_grads``)
        forgotten, so that the next backward starts afresh."""
        super().zero_grad(set_to_none)
        backward, self._backward = self._backward, None
        if backward is not None and backward.run is not None:
            backward.run.drain()
        for slot in self._slots:
            slot.taken = None

    @property
    def buckets_started(self) -> int:
        """Buckets of the coming step already started during backward (``overlap``)."""
        backward = self._backward
        return 0 if backward is None or backward.run is None else backward.run.started

    def prefetch_params(self, *units: torch.nn.Module) -> None:
        """Gather the parameters after each step in the background: ``step()`` commits the
        states and starts the gathers, and the forward pre-hook of each unit waits for the
        parameters under it and writes them, so forward starts before every gather finished (the
        units of FSDP2's ``fully_shard``). A parameter belongs to the first unit given that holds
        it (give inner units first, e.g. ``model.embed, *model.layers, model.head``); every
        parameter this optimizer steps must belong to one and be read only inside its unit's
        forward. The next ``step()``, backward, checkpoints and :meth:`wait_params` wait for
        whatever is left. The gathers run in parameter order, so units should come in that
        order too (a unit waits for the gathers before its own)."""
        slots = {id(s.param): s for s in self._slots if s.shard is not None}
        taken: set[int] = set()
        owned = []
        for unit in units:
            mine = [slots[id(p)] for p in unit.parameters() if id(p) in slots and id(p) not in taken]
            taken |= {id(s.param) for s in mine}
            if mine:
                owned.append((unit, mine))
        missing = [s.name for s in slots.values() if id(s.param) not in taken]
        if missing:  # before any hook is registered: a refused call changes nothing
            raise OptimizerError(f"prefetch_params: no unit given holds tensor {_names_text(missing)}")
        for unit, mine in owned:
            hook = unit.register_forward_pre_hook(lambda *_, mine=mine: self._gather_for(mine))
            self._hooks.append(hook)
        self.wait_params()
        self._prefetch = True
        self._plans.clear()  # the buckets after the update now start after the step
        self._last_plan = None

    def _gather_for(self, slots: Sequence[Slot]) -> None:
        """Wait for the gathers of ``slots``' parameters (and those started before them) and
        write the parameters; raises ``OptimizerError`` for parameters written since the step
        (keeping what was written there), after writing the others."""
        gathers = self._gathers
        if gathers is None:
            return
        waiting = [s for s in slots if s.index in gathers.waiting]
        if not waiting:
            return
        written = [s for s in waiting if _memory_and_version(s.local_param()) != gathers.written[s.index]]
        try:
            gathers.run.write({gathers.legs[s.index]: s.local_param() for s in waiting if s not in written})
        except ShardlangError as e:
            self._fail_gathers(e)
        for slot in waiting:
            del gathers.waiting[slot.index]
        if not gathers.waiting:
            gathers.run.drain()  # the gathers of written parameters: the next step reuses their buffers
            self._gathers = None
        if written:
            raise OptimizerError(
                f"parameter {_names_text([s.name for s in written])}"
                f" written while the gather of step {gathers.step}'s value was in flight (prefetch_params): "
                "what was written is kept, not the step's value; call optimizer.wait_params() before "
                "writing parameters (model.load_state_dict)"
            )

    def wait_params(self) -> None:
        """Wait for every gather of the last step and write the parameters (with
        :meth:`prefetch_params`; forward does it module by module, the next step, backward and
        checkpoints at once): call it before reading parameters outside forward."""
        if self._gathers is not None:
            self._gather_for(list(self._gathers.waiting.values()))

    def _fail_gathers(self, error: ShardlangError) -> None:
        gathers = self._gathers
        assert gathers is not None
        gathers.run.drain()
        self._gathers = None
        names = sorted(s.name for s in gathers.waiting.values())
        self._gather_failure = (
            f"step {gathers.step}: gathering the updated parameters failed: {error.message}; the optimizer "
            f"states hold step {gathers.step}, but {len(names)} parameters (first '{names[0]}') still hold "
            f"step {gathers.step - 1}'s values: load a checkpoint to go on"
        )
        raise OptimizerStepError(self._gather_failure) from error

    def _norm_specs(self, slots: Sequence[Slot]) -> list[SumSpec]:
        """Each slot's sum of squared gradient elements, partial over the axes its state layout
        splits (as CAME's RMS), so that one all-reduce per group completes all of them."""
        specs = []
        for slot in slots:
            assert slot.shard is not None
            shard = slot.shard
            specs.append(
                SumSpec(
                    mesh=shard.layout.mesh,
                    axes=shard.sum_axes,
                    numel=1,
                    dtype=slot.dtype,
                    owner=slot.name,
                    replicated=shard.replicated,
                )
            )
        return specs

    def _grad_norm(
        self, slots: Sequence[Slot], grads: Sequence[torch.Tensor], step_number: int
    ) -> tuple[torch.Tensor, int, int]:
        """The 2-norm of all the reduced gradients (every rank gets the same), and the bytes and
        all-reduces it took."""
        squares = [g.to(slot.dtype).square().sum().reshape(1) for slot, g in zip(slots, grads, strict=True)]
        try:
            completed, collectives = self._reducer.reduce(self._norm_specs(slots), squares, "the gradient norm")
        except DistributedError as e:
            raise OptimizerStepError(
                f"step {step_number} failed reducing the gradient norm: {e.message}; "
                "parameters and optimizer states are unchanged"
            ) from e
        total = torch.stack([c.reshape(()).to(torch.float64) for c in completed]).sum().sqrt()
        return total.to(slots[0].dtype), sum(c.bytes for c in collectives), len(collectives)

    def _skip(self, norm: torch.Tensor, step_number: int) -> _Staged:
        """What commits a step skipped for a gradient that is NaN or inf (on every rank: the
        norm is the same everywhere): nothing changes but the record of it."""

        def commit() -> None:
            self.last_grad_norm, self.last_step_skipped = norm, True
            warnings.warn(
                f"{type(self).__name__}: step {step_number} skipped: the gradients' norm is {float(norm)}",
                stacklevel=3,
            )

        return _Staged(commit)

    def _fresh_params(self, slots: Sequence[Slot], after: StageRun, legs: Mapping[int, int]) -> dict[int, torch.Tensor]:
        """Where the new state-layout shard of every parameter without a master goes (``legs``:
        per slot its "state -> param" leg): where its gather sends it from when it has such a
        place (``StageRun.places``: one copy less), else a view of one flat buffer per (dtype,
        device), in the slots' order, kept between steps (and so are the views, while the
        buffers are the same)."""
        plain = [s for s in slots if not s.needs_master]
        devices = {s.local_param().device for s in plain}
        places = after.places([legs[s.index] for s in plain], devices.pop()) if len(devices) == 1 else {}
        if len(places) == len(plain):
            return {s.index: places[legs[s.index]] for s in plain}
        rest = self._fresh_flat([s for s in plain if legs[s.index] not in places])
        return rest | {s.index: places[legs[s.index]] for s in plain if legs[s.index] in places}

    def _fresh_flat(self, slots: Sequence[Slot]) -> dict[int, torch.Tensor]:
        """The flat buffers' views of :meth:`_fresh_params` for ``slots`` (none with a master)."""
        cached = self._fresh_views.get(tuple(s.index for s in slots))
        if cached is not None and all(
            self._scratch.take("new params", n, *key).data_ptr() == at for key, n, at in cached[1]
        ):
            return cached[0]
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        for slot in slots:
            assert slot.shard is not None
            key = (slot.dtype, slot.local_param().device)
            sizes[key] = sizes.get(key, 0) + math.prod(slot.shard.local_shape)
        buffers = {key: self._scratch.take("new params", n, *key) for key, n in sizes.items()}
        out, offsets = {}, dict.fromkeys(sizes, 0)
        for slot in slots:
            assert slot.shard is not None
            key = (slot.dtype, slot.local_param().device)
            n = math.prod(slot.shard.local_shape)
            out[slot.index] = buffers[key][offsets[key] : offsets[key] + n].view(slot.shard.local_shape)
            offsets[key] += n
        held = [(key, n, buffers[key].data_ptr()) for key, n in sizes.items()]
        self._fresh_views[tuple(s.index for s in slots)] = (out, held)
        return out

    def _exchange(self, work: StepWork, step_number: int) -> tuple[int, int]:
        """Drive the math in lockstep, one batch of reductions per phase; the bytes and
        all-reduces the reductions took. An update (one per slot, or one per run of slots)
        yields, per phase, the partial sums of its slots in slot order (those of the slots'
        :meth:`_sum_specs`) and is sent back as many, completed."""
        specs = [self._sum_specs(slot) for slot in work.slots]
        pending: list[Update] = []
        sent: list[list[torch.Tensor]] = []
        failure: Exception | None = None
        try:
            for update in self._updates(work):
                try:
                    sent.append(next(update))
                    pending.append(update)
                except StopIteration:  # no phases: the math is local
                    pass
        except Exception as e:  # this rank's math failed: its sums are still joined, below
            failure = self._joinable(e)
        total_bytes = total_collectives = 0
        if not pending and failure is None:
            return 0, 0
        for k, phase in enumerate(self.phases):
            phase_specs = [spec for slot_specs in specs for spec in slot_specs[k]]
            if failure is None:
                values = [v for slot_values in sent for v in slot_values]
                if len(values) != len(phase_specs):
                    raise AssertionError(f"{len(values)} sums yielded for {phase}, {len(phase_specs)} specified")
            else:  # zeros, so that the peers' sums complete (the step commits nowhere)
                device = work.grads[0].device
                values = [torch.zeros(spec.numel, dtype=spec.dtype, device=device) for spec in phase_specs]
            try:
                completed, collectives = self._reducer.reduce(phase_specs, values, phase)
            except DistributedError as e:
                raise OptimizerStepError(
                    f"step {step_number} failed reducing {phase}: {e.message}; "
                    "parameters and optimizer states are unchanged"
                ) from e
            total_bytes += sum(c.bytes for c in collectives)
            total_collectives += len(collectives)
            offset = 0
            for i, update in enumerate(pending if failure is None else ()):
                n = len(sent[i])
                try:
                    sent[i] = update.send(completed[offset : offset + n])
                except StopIteration:
                    sent[i] = []
                except Exception as e:  # as above: the later phases are joined with zeros
                    failure = self._joinable(e)
                    break
                offset += n
        if failure is not None:
            raise _UpdateFailed(failure)
        return total_bytes, total_collectives

    # --- what a step communicates ------------------------------------------------------
    def planned_traffic(self) -> StepTraffic:
        """What the next step will communicate on this rank, from its step plan and the
        statistics all-reduces, for the parameters that have gradients now."""
        slots = self._stepped()
        if not slots:
            return StepTraffic()
        plan = self._compiled(slots, [_grad_key(s) for s in slots]).plan
        specs = [self._sum_specs(slot) for slot in slots]
        sum_bytes = sum_collectives = 0
        phases = [[spec for s in specs for spec in s[k]] for k in range(len(self.phases))]
        if self.max_grad_norm is not None or self.skip_nonfinite:
            phases.append(self._norm_specs(slots))
        for phase in phases:
            collectives = plan_collectives(phase, self.rank)
            sum_bytes += sum(c.bytes for c in collectives)
            sum_collectives += len(collectives)
        return StepTraffic(plan.total_bytes, plan.collectives, sum_bytes, sum_collectives, *self._flag_traffic(slots))

    @property
    def bucket_buffer_bytes(self) -> int:
        """Bytes of the buffers the buckets' collectives keep between steps on this rank."""
        return self._bucket_buffers.nbytes

    @property
    def work_bytes(self) -> int:
        """Bytes of what a step keeps besides the states: the spare state buffers it writes
        (for the all-or-nothing swap), its working buffers and the bucket buffers."""
        spare = 0 if self._flat is None else self._flat.spare_bytes
        return spare + self._scratch.nbytes + self._bucket_buffers.nbytes

    # --- memory and checkpoints --------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """What this rank holds for the parameters it steps, by kind (``runtime.optim.memory``),
        predicted from their layouts and the step plan of the gradients they have (before the
        first backward, of the gradients their layouts declare)."""
        slots = [s for s in self._slots if s.shard is not None]
        stepped = self._stepped()
        keys: list[tuple[Layout, torch.dtype] | None] = (
            [_grad_key(s) for s in stepped] if stepped else [_expected_grad(s) for s in slots]
        )
        buffers = self._bucket_buffers.nbytes
        if (stepped or slots) and all(key is not None for key in keys):
            program = self._compiled(stepped or slots, keys).program  # type: ignore[arg-type]
            numels = (program.kept_numel, program.send_numel)
            buffers = sum(n * ITEMSIZE[dtype] for kind in numels for dtype, n in kind.items())
        params = grads = flat = own = masters = 0
        for slot in slots:
            assert slot.shard is not None
            local = slot.local_param()
            params += local.numel() * local.element_size()
            grads += local.numel() * local.element_size() if slot.param.requires_grad and not self.free_grads else 0
            for name, shape in self._state_shapes(slot).items():
                if name in slot.own_layouts:
                    own += math.prod(slot.own_piece_shape(name, self.rank)) * slot.dtype.itemsize
                else:
                    flat += math.prod(shape) * slot.dtype.itemsize
            masters += math.prod(slot.shard.local_shape) * slot.dtype.itemsize if slot.needs_master else 0
        states = flat + own
        spare = flat + masters if self.transactional else 0  # the flat buffers' second set
        return MemoryReport(params, grads, states, masters, buffers, spare, self._scratch_bytes(slots))

    def _scratch_bytes(self, slots: Sequence[Slot]) -> int:
        """The math's working buffers for a step of ``slots``: by default those it holds now
        (they grow to their size at the first step)."""
        return self._scratch.nbytes

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (master shards included)."""
        flat = 0 if self._flat is None else self._flat.nbytes
        return flat + sum(t.numel() * t.element_size() for slot in self._slots for t in slot.own_states.values())

    def _states(self, slot: Slot) -> dict[str, torch.Tensor]:
        """The slot's states (views), none before its first step."""
        if slot.step == 0 or self._flat is None:
            return {}
        out = {
            name: self._flat.view(slot.index, name)
            for name in self._state_names(slot)
            if self._flat.has(slot.index, name)
        }
        return out | dict(slot.own_states)

    def held_tensors(self) -> list[HeldTensor]:
        """Every parameter whose states this rank keeps, with where each state lies."""
        self.wait_params()
        return [
            HeldTensor(
                name=slot.name,
                shape=slot.shape,
                param_layout=slot.param_layout,
                param=slot.local_param(),
                step=slot.step,
                state_dtype=slot.dtype,
                wheres={name: self._where(slot, name) for name in sorted(self._state_names(slot))},
                states=self._states(slot),
            )
            for slot in self._slots
            if slot.shard is not None
        ]

    def _state_names(self, slot: Slot) -> set[str]:
        return set(self._state_shapes(slot)) | ({"master"} if slot.needs_master else set())

    def state_dict(self) -> dict[str, Any]:
        """This rank's states, each with the layout it lies in."""
        tensors = {}
        for slot in self._slots:
            states = self._states(slot) if slot.shard is not None else {}
            if not states:
                continue
            records = {name: self._where(slot, name).record() | {"tensor": t.clone()} for name, t in states.items()}
            tensors[slot.name] = {"step": slot.step, "states": records}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {
            "format": STATE_DICT_FORMAT,
            "optimizer": type(self).__name__,
            "param_groups": groups,
            "tensors": tensors,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved. Every state must have been saved in the
        layout it has now; nothing changes unless all of them fit."""
        if state_dict.get("format") != STATE_DICT_FORMAT or state_dict.get("optimizer") != type(self).__name__:
            raise OptimizerError(
                f"not a {type(self).__name__} state dict (format {state_dict.get('format')!r}, "
                f"optimizer {state_dict.get('optimizer')!r})"
            )
        saved_groups = state_dict["param_groups"]
        if [g["param_names"] for g in saved_groups] != [g["param_names"] for g in self.param_groups]:
            raise OptimizerError("the state dict's parameter names and groups differ from this optimizer's")
        loaded = []
        for slot in self._slots:
            entry = state_dict["tensors"].get(slot.name)
            if slot.shard is None or entry is None:
                continue
            expected = self._state_names(slot)
            if set(entry["states"]) != expected:
                raise OptimizerError(
                    f"tensor '{slot.name}': the state dict holds states {sorted(entry['states'])}, "
                    f"expected {sorted(expected)}"
                )
            states = {}
            for name, saved in entry["states"].items():
                where = self._where(slot, name)
                for key, value in where.record().items():
                    if saved.get(key) != value:
                        raise OptimizerError(
                            f"tensor '{slot.name}', state '{name}': saved with {key} {saved.get(key)!r}, "
                            f"but it is {value!r} now"
                        )
                tensor = saved["tensor"]
                if tuple(tensor.shape) != where.local_shape:
                    raise OptimizerError(
                        f"tensor '{slot.name}', state '{name}': the saved piece has shape {list(tensor.shape)}, "
                        f"rank {self.rank} holds {list(where.local_shape)}"
                    )
                states[name] = tensor
            loaded.append((slot, int(entry["step"]), states))
        flat = self._flat_states()
        for slot, step, states in loaded:
            slot.step = step
            for name, tensor in states.items():
                if name in slot.own_layouts:
                    slot.own_states[name] = tensor.to(dtype=slot.dtype, device=slot.local_param().device, copy=True)
                else:
                    flat.view(slot.index, name).copy_(tensor)
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "param_names"})

    def full_state_dict(self) -> dict[str, Any]:
        """Every state gathered whole, in the format of ``torch.optim.AdamW`` (for
        :class:`ShardedAdamW`) or ``came_pytorch.CAME`` (``runtime.optim.full_state``); every
        rank calls it."""
        return full_state.full_state_dict(self)

    def load_full_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what :meth:`full_state_dict` or the torch optimizer's ``state_dict()`` wrote,
        each rank its pieces; every rank calls it."""
        full_state.load_full_state_dict(self, state_dict)


class _UpdateFailed(Exception):
    """This rank's math failed (``error``), after joining the step's sums
    (:meth:`ShardedOptimizer._exchange`)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _failed(step_number: int, stage: str, e: ShardlangError) -> OptimizerStepError:
    return OptimizerStepError(
        f"step {step_number} failed {stage}: {e.message}; parameters and optimizer states are unchanged"
    )


def _memory_and_version(tensor: torch.Tensor) -> tuple[int, int]:
    """Which memory a tensor is, and how often it was changed in place (its version counter,
    shared by its views and ``detach()``)."""
    return tensor.data_ptr(), tensor._version


def _grad_versions(grads: Sequence[tuple[torch.Tensor, Layout]]) -> tuple[tuple[int, int], ...]:
    """Which gradient tensors, and how often changed in place: a kept reduction's key."""
    return tuple(_memory_and_version(grad) for grad, _ in grads)


def _take_grad(slot: Slot, layout: Layout) -> None:
    """Free the slot's gradient, a bucket having packed it (``free_grads``): an empty tensor of
    its dtype stands in for it until the step."""
    grad = slot.param.grad
    assert grad is not None
    slot.taken = (torch.empty(0, dtype=grad.dtype, device=grad.device), layout)
    slot.param.grad = None


def _grad_key(slot: Slot) -> tuple[Layout, torch.dtype]:
    """The layout and dtype of a slot's gradient as it is now."""
    grad, layout = slot.local_grad()
    return layout, grad.dtype


def _expected_grad(slot: Slot) -> tuple[Layout, torch.dtype] | None:
    """The layout and dtype a slot's next gradient is planned with before it exists: the spec's
    grad layout, or a DTensor's gradient as last seen (None before its first step)."""
    if slot.grad_layout is not None and not is_dtensor(slot.param):
        return slot.grad_layout, slot.param.dtype
    return slot.seen_grad


def _layouts(
    name: str, param: torch.Tensor, spec: SpecLike
) -> tuple[tuple[int, ...], Layout, Layout | None, Layout, dict[str, Layout], DeviceMesh | None]:
    """The whole tensor's shape, its (param, grad, state) layouts, the states the spec gives a
    layout of their own (other than the state layout), and its device mesh.

    A DTensor's param layout is its placements, its grad layout its gradient's (read each
    step), and the spec, when it places the tensor, gives the state layout (else the param
    layout); a DTensor on a sub-mesh of the spec's mesh takes the spec's grad layout
    (``runtime.optim.dtensors``). A plain tensor is the rank's piece of the shape the spec declares, or, placed
    by a rule or a :class:`Layouts`, the whole tensor.
    """
    if is_dtensor(param):
        shape = tuple(param.shape)
        entry = _spec_entry(name, shape, param.dtype, spec)
        if entry is not None and entry.shape != shape:
            raise OptimizerError(f"the spec declares shape {list(entry.shape)}, the DTensor has {list(shape)}")
        layout, grad, device_mesh = dtensor_param_layouts(param, entry)
        state = entry.state() if entry is not None else layout
        own = _own_layouts(entry) if entry is not None else {}
        return shape, layout, grad, state, own, device_mesh
    entry = _spec_entry(name, tuple(param.shape), param.dtype, spec)
    if entry is None:
        raise OptimizerError("it has no layouts: the spec does not place it, and it is not a DTensor")
    return entry.shape, entry.param, entry.grad, entry.state(), _own_layouts(entry), None


def _own_layouts(entry: TensorSpec) -> dict[str, Layout]:
    return {k: lay for k, lay in entry.layouts.states if k != STATE_DEFAULT and lay != entry.state()}


def _spec_entry(name: str, shape: tuple[int, ...], dtype: torch.dtype, spec: SpecLike) -> TensorSpec | None:
    """The spec's entry for a tensor; ``shape`` is assumed for one placed without a shape."""
    if spec is None:
        return None
    if isinstance(spec, Spec):
        declared = next((t for t in spec.tensors if t.name == name), None)
        if declared is not None or not any(rule.matches(name) for rule in spec.rules):
            return declared
        return spec.resolve(name, shape, dtype_name(dtype))
    entry = spec.get(name)
    if isinstance(entry, Layouts):
        return TensorSpec(name=name, dtype=dtype_name(dtype), shape=shape, layouts=entry)
    return entry


def _names_text(names: Sequence[str]) -> str:
    """``'w'``; several as ``'w' and 2 more``."""
    return f"'{names[0]}'" + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def _ranks_text(ranks: Sequence[int]) -> str:
    """``[0, 1]``; a long list as ``[0, 1, 2, ..., 1023] (1024 ranks)``."""
    if len(ranks) <= 8:
        return str(list(ranks))
    return f"[{ranks[0]}, {ranks[1]}, {ranks[2]}, ..., {ranks[len(ranks) - 1]}] ({len(ranks)} ranks)"
