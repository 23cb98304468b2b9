"""What every sharded optimizer shares: :class:`ShardedOptimizer`, a facade over the objects
that own each part of a step (docs/design.md walks one step through them):

- the slots (``runtime.optim.slots``): every parameter placed from the spec or its DTensor
  placements, and this rank's part of its state;
- the state store (``runtime.optim.states``): the flat state buffers, the states kept in
  layouts of their own, state dicts and what checkpoints read;
- the step compiler (``runtime.optim.compiler``): the step plan of the gradients' layouts, this
  rank's program of it and its bucket buffers, cached and checked across ranks once per plan;
- the step transaction (``runtime.optim.transaction``): the buckets before the update, the
  norm (``runtime.optim.clipping``), the commit point, the math (``runtime.optim.phases``: its
  phases and their statistic sums) and the buckets after it, committed on every rank or none;
- overlap (``runtime.optim.overlap``): buckets started during backward, parameters gathered
  while forward runs;
- accounting (``runtime.optim.accounting``): planned traffic and memory.

A subclass gives the math: its states (:meth:`_state_shapes`, :meth:`_state_where`), its updates
(:meth:`_updates`) and the sums between its phases (:meth:`_sum_specs`).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypedDict

import torch

from planner.cost import CostModel
from planner.legs import DEFAULT_OVERLAP_BUCKET_BYTES
from planner.step import StepPlan
from runtime.comm.collectives import default_device, timeout_of
from runtime.memory.buffers import KeptViews, Scratch
from runtime.optim import full_state
from runtime.optim.accounting import Accounting
from runtime.optim.clipping import Clipping
from runtime.optim.commit import CommitFlag, Staged, StepIdentity
from runtime.optim.compiler import StepCompiler
from runtime.optim.errors import OptimizerError, OptimizerStepError
from runtime.optim.memory import MemoryReport
from runtime.optim.overlap import Backward, OverlapController, ParamGathers
from runtime.optim.phases import PhaseDriver, StepWork, Update, done
from runtime.optim.records import STATE_DICT_FORMAT, HeldTensor, StateWhere, StepTraffic
from runtime.optim.replica_checks import ReplicaChecks, agree_on_layouts, replica_checks_every
from runtime.optim.slots import Slot, Slots, SpecLike, names_text
from runtime.optim.states import ShardedStates, StateStore, state_where
from runtime.optim.sums import SumReducer, SumSpec
from runtime.optim.transaction import StepTransaction
from shardlang import Spec
from shardlang.errors import ShardlangError
from shardlang.interop import is_dtensor
from shardlang.model_check import ModelMismatchError, check_model

# Names the optimizers, the checkpoints and DCP import from here.
__all__ = [
    "STATE_DICT_FORMAT",
    "HeldTensor",
    "ShardedOptimizer",
    "Slot",
    "SpecLike",
    "StateWhere",
    "StepOptions",
    "StepTraffic",
    "StepWork",
    "Update",
    "done",
]


class StepOptions(TypedDict, total=False):
    """The options every sharded optimizer takes besides its hyperparameters (see
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
    free_grads: bool | None
    verify_replicas: bool | int


class ShardedOptimizer(torch.optim.Optimizer):
    """Base of the sharded optimizers; subclasses give the states, the math and its phases of sums."""

    phases: tuple[str, ...] = ()
    # Whether an update runs collectives besides its phases' sums (a failed one is not joined:
    # ``PhaseDriver.joinable``).
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
        free_grads: bool | None = None,
        verify_replicas: bool | int = True,
    ) -> None:
        named, kind = list(named_params), type(self).__name__
        if not named:
            raise OptimizerError(f"{kind} got no parameters")
        try:
            super().__init__(named, defaults)
        except (TypeError, ValueError) as e:
            raise OptimizerError(f"{kind}: {e}") from None
        self.state = ShardedStates(kind)  # type: ignore[assignment]  # states live in the store
        if any("param_names" not in g for g in self.param_groups):
            raise OptimizerError(
                f"{kind} needs named parameters: pass model.named_parameters(), not model.parameters()"
            )
        if isinstance(spec, Spec):
            # The spec against the parameters before anything is built (shardlang.model_check):
            # wrappers' prefixes, misspellings with "did you mean", shapes (a rank's piece or the
            # whole); the same on every rank (meshes against the world size: Slots). DTensors
            # the spec does not name carry their own layouts.
            dist = torch.distributed
            plain = [
                (n, p)
                for g in self.param_groups
                for n, p in zip(g["param_names"], g["params"], strict=True)
                if not is_dtensor(p)
            ]
            try:
                check_model(spec, plain, rank=dist.get_rank() if dist.is_initialized() else 0).raise_errors()
            except ModelMismatchError as e:
                raise OptimizerError(f"{kind}: {e}") from None
        if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes < 1):
            raise OptimizerError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise OptimizerError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")
        if reduce_dtype is not None and reduce_dtype not in (torch.float32, torch.float64):
            raise OptimizerError(f"reduce_dtype must be torch.float32 or torch.float64, got {reduce_dtype!r}")
        if cost is not None and not isinstance(cost, CostModel):
            raise OptimizerError(f"cost must be a planner.CostModel, got {type(cost).__name__}")
        self.timeout = timeout_of(timeout, OptimizerError)
        self.bucket_bytes = DEFAULT_OVERLAP_BUCKET_BYTES if bucket_bytes is None and overlap else bucket_bytes
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.skip_nonfinite, self.verify, self.idle_ranks = skip_nonfinite, verify, idle_ranks
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.all_ranks_commit, self.overlap = all_ranks_commit, bool(overlap)
        # ZeRO-2 by default: step() frees the gradients it reduced; under overlap each bucket
        # frees them during backward, leaving placeholders that refuse to be read (docs/memory.md,
        # "Gradients").
        self.free_grads = True if free_grads is None else bool(free_grads)
        # In place behind an early commit point (or, for math with sums between its phases, the
        # math into spare states before it), or the whole step on spare buffers, swapped in when
        # every rank finished it (docs/memory.md, "The commit point").
        self.transactional = bool(transactional)
        # Gradients in a lower precision are reduced in this one (FSDP2's MixedPrecisionPolicy).
        self.reduce_dtype = reduce_dtype
        self._scratch = Scratch()  # the math's working buffers, kept between steps
        self._views = KeptViews()  # the math's views of kept buffers (runtime.memory.buffers)
        # One cost model for choosing and for running the plans (``shardlang plan --costs``); by
        # default the spec's hints for each state mesh.
        slots = self._slots = Slots(
            spec, flat_axis=flat_axis, state_dtype=state_dtype, cost=cost, rank=self.rank,
            idle_ranks=idle_ranks, state_shapes=self._state_shapes, owner=kind,
        )  # fmt: skip
        for group in self.param_groups:
            slots.add(slots.place(group))
        # The ranks of each mesh hold the same tensors in the same layouts; declared replication
        # checked: parameters now and after a load, gradients at the first step
        # (runtime.optim.replica_checks).
        agree_on_layouts(slots, self.timeout)
        every = replica_checks_every(verify_replicas)
        self._replicas = ReplicaChecks(slots, rank=self.rank, timeout=self.timeout, every=every)
        self._replicas.parameters()
        store = self._store = StateStore(
            slots, rank=self.rank, state_shapes=self._state_shapes, where=self._state_where, kind=kind
        )
        compiler = self._compiler = StepCompiler(
            slots, rank=self.rank, timeout=self.timeout, bucket_bytes=self.bucket_bytes, overlap=self.overlap,
            write_through=not self.transactional, verify=verify, reduce_dtype=reduce_dtype,
        )  # fmt: skip
        gathers = self._gathers = ParamGathers(slots)
        self._overlap = OverlapController(slots, compiler, store, gathers, free_grads=self.free_grads, owner=kind)
        reducer = SumReducer(self.rank, self.timeout)  # the norm's sums and the math's
        clipping = Clipping(reducer, max_grad_norm=self.max_grad_norm, skip_nonfinite=skip_nonfinite)
        # The math, looked up at every step: tests and tools replace an optimizer's _updates.
        driver = PhaseDriver(
            self.phases, lambda work: self._updates(work), self._sum_specs, reducer,
            communicates=self.updates_communicate,
        )  # fmt: skip
        # The commit flag also compares what every rank steps: step number, hyperparameters,
        # zero_grad() calls and backward passes (counted by gradient hooks).
        self._identity = StepIdentity(self.param_groups)
        self._identity.hook(slots)
        flag = CommitFlag(
            timeout=self.timeout, enabled=all_ranks_commit, flags=1 if self.transactional else 2,
            identity=self._identity, replicas=self._replicas,
        )  # fmt: skip
        self._transaction = StepTransaction(
            slots, store, compiler, self._overlap, gathers, clipping, driver, flag, self._scratch,
            transactional=self.transactional, math_in_place=self.updates_in_place, free_grads=self.free_grads,
            owner=kind, replicas=self._replicas,
        )  # fmt: skip
        self._accounting = Accounting(
            slots, store, compiler, driver, clipping, flag, self._scratch,
            transactional=self.transactional, free_grads=self.free_grads,
        )  # fmt: skip
        if self.overlap:
            self._overlap.hook(slots)

    # --- what subclasses give ----------------------------------------------------------
    def _state_shapes(self, slot: Slot) -> dict[str, tuple[int, ...]]:
        """The local shape of every state the slot keeps in its state layout (master excluded)."""
        raise NotImplementedError

    def _updates(self, work: StepWork) -> list[Update]:
        """The math of the step: generators (see :data:`~runtime.optim.phases.Update`), each
        yielding once per phase the sums of its slots in :meth:`_sum_specs` order; their
        slots, in order, are ``work.slots``."""
        raise NotImplementedError

    def _sum_specs(self, slot: Slot) -> tuple[tuple[SumSpec, ...], ...]:
        """Per phase, the sums the slot's math yields, in order."""
        return tuple(() for _ in self.phases)

    def _state_where(self, slot: Slot, name: str) -> StateWhere:
        """Where state ``name`` lies; by default it has the parameter's shape."""
        return state_where(slot, name, self.rank)

    # Its name to planner.memory's one accounting (the formulas of its states and scratch).
    memory_kind = "adamw"

    def _memory_extras(self) -> dict[str, Any]:
        """What only the live optimizer knows, for ``Accounting.memory_report``: none by default."""
        return {"fused": False, "kept": 0, "iterated": ()}

    # --- the step ------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of named parameters (``{"params": list(module.named_parameters()),
        "lr": ...}``), placed from the spec and checked like the first ones (their replicas
        too: every rank calls it); nothing changes unless every one of them is placed."""
        if not hasattr(self, "_slots"):  # torch.optim.Optimizer.__init__ adds the first groups
            super().add_param_group(param_group)
            return
        kind = type(self).__name__
        try:
            super().add_param_group(param_group)
        except (TypeError, ValueError) as e:
            raise OptimizerError(f"{kind}.add_param_group: {e}") from None
        group = self.param_groups[-1]
        try:
            if "param_names" not in group:
                raise OptimizerError(
                    f"{kind}.add_param_group needs named parameters: {{'params': list(module.named_parameters()), ...}}"
                )
            placed = self._slots.place(group)
            agree_on_layouts(placed, self.timeout)  # checked as those given at construction
            self._replicas.parameters(placed)
        except ShardlangError:
            self.param_groups.pop()
            raise
        kept = list(self._slots)
        self._slots.add(placed)
        if self.overlap:
            self._overlap.hook(placed)
        self._identity.hook(placed)
        self._store.grow(kept)  # the flat buffers grow; the states kept so far move along

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait_params()
        if self._gathers.broken is not None:
            raise OptimizerStepError(self._gathers.broken)
        backward = self._overlap.take()
        slots = self._slots.stepped()
        if not slots:
            if backward is not None and backward.run is not None:
                backward.run.drain()
            return loss
        self._transaction.run(slots, lambda: self._stage(slots, backward))
        return loss

    def _stage(self, slots: list[Slot], backward: Backward | None = None) -> Staged:
        """This rank's step of ``slots``, run without changing anything (``StepTransaction.stage``)."""
        return self._transaction.stage(slots, backward)

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
        slots = self._slots.stepped()
        backward = self._overlap.take()
        if not slots:
            return torch.zeros((), device=default_device())
        return self._transaction.clip(slots, backward, max_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; a backward whose step will not come is dropped
        too: its buckets waited out, the stand-ins of the gradients it freed (``free_grads``)
        forgotten, so that the next backward starts afresh."""
        super().zero_grad(set_to_none)
        self._overlap.drop()
        self._identity.zero_grads += 1  # compared at the next step's commit flag
        self._identity.fresh()

    # --- overlap -------------------------------------------------------------------------
    def no_sync(self) -> Any:
        """Backward passes inside accumulate gradients without starting any bucket (micro-batches
        of gradient accumulation, as ``DistributedDataParallel.no_sync``); the backward after it
        starts them, and ``step()`` reduces what was accumulated once."""
        return self._overlap.no_sync()

    @property
    def buckets_started(self) -> int:
        """Buckets of the coming step already started during backward (``overlap``)."""
        return self._overlap.buckets_started

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
        self._gathers.register(units)
        self.wait_params()
        self._compiler.start_prefetch()  # the buckets after the update now start after the step

    def wait_params(self) -> None:
        """Wait for every gather of the last step and write the parameters (with
        :meth:`prefetch_params`; forward does it module by module, the next step, backward and
        checkpoints at once): call it before reading parameters outside forward."""
        self._gathers.wait()

    # --- what a step communicates and holds ----------------------------------------------
    def step_plan(self) -> StepPlan:
        """The plan of the next step: for the parameters that have gradients now, or where none
        has one, for every parameter with the gradient its layout expects."""
        slots, keys = self._slots.coming()
        unknown = [s.name for s, key in zip(slots, keys, strict=True) if key is None]
        if unknown:
            raise OptimizerError(f"the gradient layout of {names_text(unknown)} is not known before its first backward")
        return self._compiler.compiled(slots, keys).plan  # type: ignore[arg-type]

    def planned_traffic(self) -> StepTraffic:
        """What the next step will communicate on this rank, from its step plan and the
        statistics all-reduces, for the parameters that have gradients now."""
        return self._accounting.planned_traffic()

    @property
    def bucket_buffer_bytes(self) -> int:
        """Bytes of the buffers the buckets' collectives keep between steps on this rank."""
        return self._accounting.bucket_buffer_bytes

    @property
    def work_bytes(self) -> int:
        """Bytes of what a step keeps besides the states: the spare state buffers it writes
        (for the all-or-nothing swap), its working buffers and the bucket buffers."""
        return self._accounting.work_bytes

    def memory_report(self) -> MemoryReport:
        """What this rank holds for the parameters it steps, by kind (``runtime.optim.memory``),
        predicted from their layouts and the step plan of the gradients they have (before the
        first backward, of the gradients their layouts declare)."""
        return self._accounting.memory_report(self.memory_kind, **self._memory_extras())

    # The last committed step's traffic, gradients' norm (with max_grad_norm or skip_nonfinite),
    # whether it was skipped for a NaN or inf in them, and the seconds it spent blocked waiting
    # for its buckets' collectives.
    last_traffic = property(lambda self: self._transaction.last.traffic)
    last_grad_norm = property(lambda self: self._transaction.last.grad_norm)
    last_step_skipped = property(lambda self: self._transaction.last.skipped)
    last_wait_seconds = property(lambda self: self._transaction.last.wait_seconds)

    # --- states and checkpoints ----------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (master shards included)."""
        return self._store.nbytes

    def held_tensors(self) -> list[HeldTensor]:
        """Every parameter whose states this rank keeps, with where each state lies."""
        self.wait_params()
        return self._store.held_tensors()

    def state_dict(self) -> dict[str, Any]:
        """This rank's states, each with the layout it lies in."""
        return self._store.state_dict(self.param_groups)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved. Every state must have been saved in the
        layout it has now; nothing changes unless all of them fit. Every rank calls it: the
        parameters and the states declared replicated are then checked (``verify_replicas``)."""
        self._store.load_state_dict(state_dict, self.param_groups, self._replicas.states)

    def full_state_dict(self) -> dict[str, Any]:
        """Every state gathered whole, in the format of ``torch.optim.AdamW`` (for
        :class:`ShardedAdamW`) or ``came_pytorch.CAME`` (``runtime.optim.full_state``); every
        rank calls it."""
        return full_state.full_state_dict(self)

    def load_full_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what :meth:`full_state_dict` or the torch optimizer's ``state_dict()`` wrote,
        each rank its pieces; every rank calls it."""
        full_state.load_full_state_dict(self, state_dict)
