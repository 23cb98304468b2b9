"""Communication overlapped with the training step: buckets started during backward
(:class:`OverlapController`, ``overlap=True``) and parameters gathered while forward runs
(:class:`ParamGathers`, ``prefetch_params``), as FSDP2 overlaps its reduce-scatters and
all-gathers (docs/tutorials/overlap.md).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from planner.legs import AFTER, BEFORE
from runtime.comm.collectives import collective, default_device
from runtime.comm.groups import ranks_group
from runtime.errors import DistributedError, ReshardError
from runtime.execution.buckets import StageRun
from runtime.execution.ranges import BACKWARD, profiled
from runtime.memory.dtypes import as_dtype
from runtime.optim.commit import Agreement
from runtime.optim.compiler import CompiledStep, StepCompiler
from runtime.optim.errors import OptimizerError, OptimizerStepError
from runtime.optim.freed_grads import freed_grad, freed_of
from runtime.optim.slots import (
    Slot,
    Slots,
    expected_grad,
    grad_versions,
    memory_and_version,
    names_text,
    ranks_text,
    take_grad,
)
from runtime.optim.states import StateStore
from shardlang.errors import ShardlangError
from shardlang.layout import Layout


@attrs.define(eq=False)
class Gathers:
    """The gathers after a committed step (``prefetch_params``): which legs bring each slot's
    parameter, and the slots not yet written."""

    run: StageRun
    legs: Mapping[int, int]  # slot index -> its "state -> param" leg
    waiting: dict[int, Slot]
    step: int
    # Per slot index, its parameter's memory and version at the commit: a parameter written
    # since (``model.load_state_dict``) is not overwritten by its gather.
    written: Mapping[int, tuple[int, int]]


class ParamGathers:
    """What a committed step leaves in flight: the parameters' gathers (``prefetch_params``),
    written into the parameters unit by unit as forward reaches them, and the flag after its
    commit point (:meth:`CommitFlag.post`), waited on before anything else of the next step; and
    ``broken``, why every later step refuses to run: a gather that failed, or a step that failed
    after its commit point on some rank (the parameters may then hold part of a step)."""

    def __init__(self, slots: Slots) -> None:
        self._slots = slots
        self._pending: Gathers | None = None
        self._agreement: tuple[Agreement, int] | None = None  # (the flag, its step)
        self.broken: str | None = None
        self._hooks: list[Any] = []

    def register(self, units: Sequence[torch.nn.Module]) -> None:
        """Give each unit's forward and ``state_dict()`` a pre-hook that writes its parameters
        (see ``ShardedOptimizer.prefetch_params``), so that neither reads a value a step old;
        nothing is registered unless every held parameter belongs to a unit."""
        slots = {id(s.param): s for s in self._slots.held()}
        taken: set[int] = set()
        owned = []
        for unit in units:
            mine = [slots[id(p)] for p in unit.parameters() if id(p) in slots and id(p) not in taken]
            taken |= {id(s.param) for s in mine}
            if mine:
                owned.append((unit, mine))
        missing = [s.name for s in slots.values() if id(s.param) not in taken]
        if missing:  # before any hook is registered: a refused call changes nothing
            raise OptimizerError(f"prefetch_params: no unit given holds tensor {names_text(missing)}")
        for unit, mine in owned:
            self._hooks.append(unit.register_forward_pre_hook(lambda *_, mine=mine: self.gather_for(mine)))
            # model.state_dict() (and torch.distributed.checkpoint's, which calls it) calls each
            # submodule's state_dict, and so this hook, before reading the unit's tensors.
            self._hooks.append(unit.register_state_dict_pre_hook(lambda *_, mine=mine: self.gather_for(mine)))

    def hand(self, run: StageRun, legs: Mapping[int, int], slots: Sequence[Slot], step: int) -> None:
        """The gathers of a step that committed, left to run (``legs``: per slot its "state ->
        param" leg)."""
        written = {s.index: memory_and_version(s.local_param()) for s in slots}
        self._pending = Gathers(run, legs, {s.index: s for s in slots}, step, written)

    def hand_agreement(self, agreement: Agreement, step: int) -> None:
        """The flag of ``step`` after its commit point, posted: waited on at the next
        :meth:`wait` or :meth:`gather_for`."""
        self._agreement = (agreement, step)

    def failed_after_commit(self, step: int, what: str) -> OptimizerStepError:
        """The error of a step that failed after its commit point (``what``: "failed after its
        commit point on" which rank, and why), raised on every rank; every later step refuses
        to run."""
        self.broken = (
            f"step {step} {what}; the optimizer states and parameters may hold this step in part on every "
            "rank: load a checkpoint to go on"
        )
        return OptimizerStepError(self.broken)

    def wait(self) -> None:
        """Wait for the last step's flag after its commit point, then for every gather of it,
        and write the parameters."""
        self._settle()
        if self._pending is not None:
            self.gather_for(list(self._pending.waiting.values()))

    def gather_for(self, slots: Sequence[Slot]) -> None:
        """Wait for the gathers of ``slots``' parameters (and those started before them) and
        write the parameters; raises ``OptimizerError`` for parameters written since the step
        (keeping what was written there), after writing the others."""
        self._settle()
        gathers = self._pending
        if gathers is None:
            return
        waiting = [s for s in slots if s.index in gathers.waiting]
        if not waiting:
            return
        written = [s for s in waiting if memory_and_version(s.local_param()) != gathers.written[s.index]]
        try:
            with profiled(AFTER, lambda: f"write {names_text([s.name for s in waiting])}"):
                gathers.run.write({gathers.legs[s.index]: s.local_param() for s in waiting if s not in written})
        except ShardlangError as e:
            self._fail(e)
        for slot in waiting:
            del gathers.waiting[slot.index]
        if not gathers.waiting:
            gathers.run.drain()  # the gathers of written parameters: the next step reuses their buffers
            self._pending = None
        if written:
            raise OptimizerError(
                f"parameter {names_text([s.name for s in written])}"
                f" written while the gather of step {gathers.step}'s value was in flight (prefetch_params): "
                "what was written is kept, not the step's value; call optimizer.wait_params() before "
                "writing parameters (model.load_state_dict)"
            )

    def _settle(self) -> None:
        """Wait for the last step's flag after its commit point (posted, not waited on: it is
        done by the time the next step or forward needs it); where some rank failed past the
        commit point, raise that here, with nothing more written."""
        held, self._agreement = self._agreement, None
        if held is None:
            return
        agreement, step = held
        members = agreement.members
        if agreement.agreed():
            return
        if self._pending is not None:
            self._pending.run.drain()
            self._pending = None
        if agreement.missing is not None:  # this rank finished; a peer may not have
            what = "may have failed after its commit point: the flag after it did not come from every rank of "
            raise self.failed_after_commit(step, f"{what}{ranks_text(members)} ({agreement.missing})")
        raise self.failed_after_commit(step, f"failed after its commit point on another rank of {ranks_text(members)}")

    def _fail(self, error: ShardlangError) -> None:
        gathers = self._pending
        assert gathers is not None
        gathers.run.drain()
        self._pending = None
        names = sorted(s.name for s in gathers.waiting.values())
        self.broken = (
            f"step {gathers.step}: gathering the updated parameters failed: {error.message}; the optimizer "
            f"states hold step {gathers.step}, but {len(names)} parameters (first '{names[0]}') still hold "
            f"step {gathers.step - 1}'s values: load a checkpoint to go on"
        )
        raise OptimizerStepError(self.broken) from error


@attrs.define(eq=False)
class Backward:
    """The buckets before the update of the coming step, started during backward (``overlap``):
    the slots and plan they were started for (``run`` is None when the plan is not known yet:
    a DTensor whose gradient has not been seen), the first error met (raised in ``step()``,
    after every bucket has run, so that no peer waits for this rank), whether a gradient
    arrived in another layout than planned (then ``step()`` waits the buckets out and runs
    without them), and each gradient given to them as it was then (``fed``: per slot index
    its memory and version, ``slots.memory_and_version``)."""

    slots: list[Slot]
    compiled: CompiledStep | None
    run: StageRun | None
    error: ShardlangError | None = None
    stale: bool = False
    fed: dict[int, tuple[int, int]] = attrs.field(factory=dict)
    # free_grads: the gradient legs by their index, and those whose packed gradient was freed.
    grad_legs: dict[int, Slot] | None = None
    freed: set[int] = attrs.field(factory=set)
    # What the ranks agreed the step does with these buckets (USE, AGAIN or REFUSE), the lowest
    # rank that refused, and this rank's reasons: the parameters that got no gradient, whose
    # gradient changed after its bucket took it, and whose freed gradient something wrote.
    verdict: int | None = None
    refused_by: int | None = None
    unused: list[str] = attrs.field(factory=list)
    changed: list[str] = attrs.field(factory=list)
    written: list[str] = attrs.field(factory=list)


# The verdicts on the buckets started during backward, lowest first (the ranks take the least).
REFUSE, AGAIN, USE = 0, 1, 2
_NO_RANK = 2**62


class OverlapController:
    """The buckets before the update, started by gradient hooks as backward makes the
    gradients (``overlap``), and handed to the step that follows (:meth:`take`,
    :meth:`started`); ``free_grads`` frees each gradient once its bucket packed it, leaving a
    placeholder in ``.grad`` (``runtime.optim.freed_grads``)."""

    def __init__(
        self,
        slots: Slots,
        compiler: StepCompiler,
        store: StateStore,
        gathers: ParamGathers,
        *,
        free_grads: bool,
        owner: str,
    ) -> None:
        self._slots, self._compiler, self._store, self._gathers = slots, compiler, store, gathers
        self._free_grads, self._owner = free_grads, owner
        self._sync = True  # False inside no_sync()
        self._backward: Backward | None = None
        self._said: set[str] = set()  # the warnings said so far (each once)
        self._hooks: list[Any] = []

    def hook(self, slots: Sequence[Slot]) -> None:
        for slot in slots:
            if slot.shard is not None and slot.param.requires_grad:
                hook = slot.param.register_post_accumulate_grad_hook(lambda _, slot=slot: self._grad_ready(slot))
                self._hooks.append(hook)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def take(self) -> Backward | None:
        """The buckets started during the last backward, for the step (or clipping) now, once
        the ranks of the step agreed what to do with them (:meth:`_agree`). The placeholders of
        the gradients it freed become ``None`` again; one that something tried to write (a
        backward accumulating into it) makes every rank refuse the step."""
        backward = self._release()
        if backward is not None and backward.run is not None:
            with profiled(BEFORE, "overlap agreement"):
                backward.verdict, backward.refused_by = self._agree(backward)
        return backward

    def drop(self) -> None:
        """Forget a backward whose step will not come: its buckets waited out, the stand-ins of
        the gradients it freed forgotten, their placeholders cleared."""
        backward = self._release()
        if backward is not None and backward.run is not None:
            backward.run.drain()
        for slot in self._slots:
            slot.taken = None
            if freed_of(slot.param.grad) is not None:
                slot.param.grad = None

    def _release(self) -> Backward | None:
        """The last backward's buckets, and ``.grad`` ``None`` again where it was freed (the
        written placeholders named in the backward; kept without one, so that the step
        refuses them)."""
        backward, self._backward = self._backward, None
        for slot in self._slots:
            placeholder = freed_of(slot.param.grad)
            if placeholder is None or (placeholder.written and backward is None):
                continue
            if placeholder.written:
                backward.written.append(slot.name)  # type: ignore[union-attr]
            slot.param.grad = None
        return backward

    def _agree(self, backward: Backward) -> tuple[int, int | None]:
        """What every rank of the step does with the buckets started during backward: use them
        (``USE``), wait them out and reduce the gradients as they are (``AGAIN``: some rank's
        gradients changed after their buckets took them, or did not come as planned), or refuse
        the step (``REFUSE``: a freed gradient was written), and the lowest rank that refused.
        One all-reduce of two int64, before the step runs anything a rank could do alone: a rank
        that reduced anew, or failed, while its peers used their buckets would leave them
        waiting for collectives it never starts."""
        slots = self._slots.stepped()
        grads = [slot.local_grad() for slot in slots]
        try:
            compiled = self._compiler.compiled(slots, [(layout, grad.dtype) for grad, layout in grads])
        except ShardlangError:  # raised by the step, on every rank (the commit flag)
            compiled = None
        stepped = {s.index for s in slots}
        backward.unused = [s.name for s in backward.slots if s.index not in stepped]
        backward.changed = [
            slot.name
            for slot, key in zip(slots, grad_versions(grads), strict=True)
            if backward.fed.get(slot.index, key) != key
        ]
        planned = not backward.stale and backward.compiled is compiled and backward.slots == slots
        vote = REFUSE if backward.written else USE if planned and not backward.changed else AGAIN
        rank = self._slots.rank
        members = self._slots.members(slots) if slots else ()
        if len(members) < 2 or not torch.distributed.is_initialized():
            return vote, rank if vote == REFUSE else None
        flag = torch.tensor([vote, rank if vote == REFUSE else _NO_RANK], dtype=torch.int64, device=default_device())
        # A group of its own (a purpose): this all-reduce never pairs with a bucket's collective
        # that a peer has in flight, or that a rank whose hook failed starts only in the step.
        try:
            group = ranks_group(members, timeout=self._compiler.timeout, purpose="overlap agreement")
            agreed = collective("all_reduce", flag, len(members), "min", group, self._compiler.timeout).tolist()
        except DistributedError:  # a peer is gone: the buckets' own waits raise it, naming them
            return vote, None
        return int(agreed[0]), None if agreed[1] == _NO_RANK else int(agreed[1])

    @property
    def buckets_started(self) -> int:
        backward = self._backward
        return 0 if backward is None or backward.run is None else backward.run.started

    def _grad_ready(self, slot: Slot) -> None:
        """A gradient hook: put the slot's gradient into the buckets before the update,
        starting each as soon as every tensor it packs is ready."""
        if not self._sync or slot.shard is None:
            return
        self._gathers.wait()  # the gathers' buffers are reused by these buckets
        backward = self._backward
        if backward is None:
            backward = self._backward = self._begin()
        if backward.run is None or backward.stale or slot not in backward.slots:
            return
        assert backward.compiled is not None
        grad, layout = slot.local_grad()
        if (layout, grad.dtype) != expected_grad(slot):
            backward.stale = True
            return
        leg = backward.compiled.legs[(slot.name, "grad -> state")]
        if leg in backward.run.legs or (backward.error is not None and not isinstance(backward.error, ReshardError)):
            return
        wire = self._compiler.wire_dtype(grad.dtype)
        try:
            run = backward.run
            with profiled(BACKWARD, lambda: _hook_name(run, slot, leg)):
                run.feed({leg: as_dtype(grad, wire)})
                backward.fed[slot.index] = memory_and_version(grad)
                if self._free_grads:
                    self._free_packed(backward)
        except ReshardError as e:  # a piece of the wrong shape: sent as zeros, raised in step()
            backward.error = backward.error or e
            if leg not in backward.run.legs:
                shape = backward.run.source_shape(leg)
                backward.run.feed({leg: torch.zeros(shape, dtype=wire, device=grad.device)})
        except ShardlangError as e:  # a collective failed to start: raised in step()
            backward.error = backward.error or e
        except Exception as e:  # out of memory while a bucket allocates: raised in step()
            # Raised from backward on this rank alone, it would leave the peers waiting for this
            # bucket; step() starts it again and fails the step on every rank (the flag).
            error = OptimizerStepError(f"{type(e).__name__} in the gradient hook of '{slot.name}': {_first_line(e)}")
            error.__cause__ = e
            backward.error = backward.error or error

    def _free_packed(self, backward: Backward) -> None:
        """Free the gradients whose buckets have packed them (``free_grads``): an empty stand-in
        keeps each one's dtype and layout for the step, and the parameter's ``.grad`` becomes a
        placeholder without memory that refuses to be read or written (``FreedGrad``)."""
        assert backward.compiled is not None and backward.run is not None
        if backward.grad_legs is None:
            legs = backward.compiled.legs
            backward.grad_legs = {legs[(s.name, "grad -> state")]: s for s in backward.slots}
        for leg in backward.run.packed - backward.freed:
            slot = backward.grad_legs.get(leg)
            backward.freed.add(leg)
            grad = None if slot is None else slot.param.grad
            if slot is not None and grad is not None:
                take_grad(slot, slot.local_grad()[1])
                slot.param.grad = freed_grad(grad, slot.name, self._owner)
                backward.fed[slot.index] = memory_and_version(slot.local_grad()[0])

    def _begin(self) -> Backward:
        """The buckets of the coming step, for every slot this rank steps, with its non-gradient
        inputs given at once (they do not change during backward)."""
        slots = [s for s in self._slots if s.shard is not None and s.param.requires_grad]
        keys = [expected_grad(slot) for slot in slots]
        if any(key is None for key in keys):  # a DTensor's gradient layout shows at its first step
            return Backward(slots, None, None)
        compiled = self._compiler.compiled(slots, keys)  # type: ignore[arg-type]
        run = self._compiler.stage(compiled, BEFORE, slots)
        backward = Backward(slots, compiled, run)
        rank = self._slots.rank
        try:
            for slot in slots:
                run.feed(compiled.before_inputs(slot, self._store.own(slot), rank, slot.local_param().device))
        except ShardlangError as e:
            backward.error = e
        return backward

    def started(
        self,
        backward: Backward | None,
        compiled: CompiledStep,
        slots: Sequence[Slot],
        grads: Sequence[tuple[torch.Tensor, Layout]],
        step_number: int,
    ) -> StageRun | None:
        """The buckets started during backward, if every rank of the step agreed to use them
        (:meth:`take`); else ``None``, after waiting out those started, and every rank reduces
        the gradients as they are. A gradient changes after its bucket took it when a second
        backward accumulates into it outside ``no_sync()``, or when it is changed in place after
        backward (``GradScaler.unscale_``), with ``free_grads=False``; parameters that got no
        gradient leave the buckets planned for them unfed. The step then runs without overlap,
        and says why (once each). Where a rank wrote a freed gradient, every rank refuses the
        step: ``OptimizerError`` there, ``OptimizerStepError`` naming it on the others."""
        if backward is None or backward.run is None:
            return None
        planned = not backward.stale and backward.compiled is compiled and backward.slots == list(slots)
        verdict = backward.verdict
        if verdict == USE and planned:
            return backward.run
        backward.run.drain()
        if verdict == REFUSE:
            if backward.written:
                raise OptimizerError(
                    f"the gradient of {names_text(backward.written)} was accumulated again (or changed in place)"
                    " after its bucket had taken and freed it (free_grads=True): accumulate micro-batches inside"
                    " optimizer.no_sync(), clip with optimizer.clip_grad_norm_, or pass free_grads=False"
                )
            raise OptimizerStepError(
                f"step {step_number} was refused by rank {backward.refused_by}, where a gradient was written after"
                " its bucket had taken and freed it; parameters and optimizer states are unchanged on every rank"
            )
        if backward.unused and not backward.stale:
            self._say(
                "unused",
                f"{self._owner}: step {step_number}: {names_text(backward.unused)} got no gradient in backward, so"
                " the buckets started during backward (planned for every parameter that requires a gradient)"
                " were waited out and the step reduced every gradient anew, without overlap; set"
                " requires_grad=False on parameters the model does not use, or leave them out of the"
                " optimizer (said once)",
            )
        elif backward.changed:
            self._say(
                "changed",
                f"{self._owner}: step {step_number}: the gradients of {names_text(backward.changed)} changed"
                " after backward had started reducing them, so the step reduced the gradients again, without"
                " overlap; accumulate micro-batches inside no_sync() and clip with the optimizer's"
                " clip_grad_norm_ to keep the overlap (said once)",
            )
        elif planned:
            self._say(
                "peer",
                f"{self._owner}: step {step_number}: the gradients changed on another rank after backward had"
                " started reducing them (or some did not come there), so every rank reduced the gradients again,"
                " without overlap; that rank says which (said once)",
            )
        return None

    def _say(self, what: str, message: str) -> None:
        if what not in self._said:
            self._said.add(what)
            warnings.warn(message, stacklevel=4)


def _hook_name(run: StageRun, slot: Slot, leg: int) -> str:
    """A gradient hook's range: the gradient and the bucket it goes into, named as the bucket's
    own ranges name it (docs/stacks/profiler.md)."""
    stage = (b for b in run.program.buckets if b.bucket.stage == BEFORE)
    bucket = next((b for b in stage if any(member[0] == leg for member in b.members)), None)
    return f"hook '{slot.name}'" + ("" if bucket is None else f" into {run.bucket_text(bucket)}")


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"
