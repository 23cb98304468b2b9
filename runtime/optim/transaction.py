"""One optimizer step as a transaction: stage, agree, then commit or abandon.

:meth:`StepTransaction.stage` runs everything of a step that can fail on its input or
disagree between ranks without changing anything (the buckets before the update, the norm,
the non-finite test; for a transactional step the math into spare buffers and the gathers
too) and returns what commits it (:class:`Staged`). The ranks then agree with one all-reduce
of a flag (:class:`CommitFlag`): every rank commits or none does. An update in place runs
its math and gathers after that point, and a second flag raises a later failure everywhere
(docs/memory.md, "The commit point"; docs/design/failures.md).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from planner.legs import AFTER, BEFORE
from runtime.execution.buckets import StageRun
from runtime.execution.ranges import COMMIT, UPDATE, profiled, profiling
from runtime.memory.buffers import Scratch
from runtime.memory.dtypes import as_dtype
from runtime.optim.clipping import Clipping, Reduced, gradients_finite
from runtime.optim.commit import CommitFlag, Finite, LastStep, Staged
from runtime.optim.compiler import CompiledStep, StepCompiler
from runtime.optim.errors import OptimizerError, OptimizerStepError
from runtime.optim.overlap import Backward, OverlapController, ParamGathers
from runtime.optim.phases import PhaseDriver, StepWork, UpdateFailed
from runtime.optim.records import StepTraffic
from runtime.optim.replica_checks import ReplicaChecks
from runtime.optim.slots import Slot, Slots, grad_versions, names_text, ranks_text, take_grad
from runtime.optim.states import MASTER, StateStore
from shardlang.errors import ShardlangError
from shardlang.interop import is_dtensor
from shardlang.layout import Layout

# The own-layout states of a tensor that keeps none (read only).
NO_STATES: Mapping[str, torch.Tensor] = {}


class StepTransaction:
    """The steps of one optimizer (see the module doc): it reads the slots' gradients, runs
    the compiled buckets (``compiler``) with the ones started during backward (``overlap``),
    the norm (``clipping``) and the math (``driver``) on the states (``store``), and hands the
    gathers of a prefetching step to ``gathers``. ``scratch``: the math's working buffers, where
    new parameters go that have no place of their own."""

    def __init__(
        self,
        slots: Slots,
        store: StateStore,
        compiler: StepCompiler,
        overlap: OverlapController,
        gathers: ParamGathers,
        clipping: Clipping,
        driver: PhaseDriver,
        flag: CommitFlag,
        scratch: Scratch,
        *,
        transactional: bool,
        math_in_place: bool,
        free_grads: bool,
        owner: str,
        replicas: ReplicaChecks,
    ) -> None:
        self._slots, self._store, self._compiler, self._overlap = slots, store, compiler, overlap
        self._gathers, self._clipping, self._driver, self.flag = gathers, clipping, driver, flag
        self._scratch, self.transactional, self._free_grads, self._owner = scratch, transactional, free_grads, owner
        # Three kinds of step (docs/memory.md, "The commit point"): the math in place after the
        # commit point (math_in_place), the math into spare states before it and the gathers
        # after it (neither), or everything on spare buffers before it (transactional).
        self.math_in_place = math_in_place and not transactional
        self.rank = slots.rank
        self._replicas = replicas  # the gradients declared replicated, checked before the commit
        self.last = LastStep()
        # The names of the math's and the flags' ranges (runtime.execution.ranges).
        self._math = f"{owner} math"
        self._flag_names = tuple(f"flag {k} of {flag.flags}" for k in (1, 2))
        # _fresh_flat's views per set of slots stepped, with the buffers they are views of.
        self._fresh_views: dict[tuple[int, ...], tuple[dict[int, torch.Tensor], list[tuple[Any, int, int]]]] = {}

    def run(self, slots: list[Slot], stage: Callable[[], Staged]) -> None:
        """Stage a step of ``slots``, agree, and commit it on every rank or on none."""
        members = self._slots.members(slots)
        try:
            first = self._flag_names[0]
            try:
                staged = stage()
            except Exception:
                with profiled(COMMIT, first):
                    self.flag.agree(members, ok=False, slots=slots)  # the others must not commit either
                raise
            with profiled(COMMIT, first):
                agreed = self.flag.agree(members, ok=True, slots=slots, finite=staged.finite)
            if not agreed:
                staged.abandon()
                if self.flag.refusal is not None:  # the gradients declared replicated differ
                    raise self.flag.refusal
                why = self.flag.why or f"failed on another rank of {ranks_text(members)}"
                raise OptimizerStepError(
                    f"step {min(s.step for s in slots) + 1} {why}; "
                    "parameters and optimizer states are unchanged on every rank"
                )
            staged.commit()
            if self._free_grads:
                for slot in slots:
                    slot.param.grad = None
        finally:
            for slot in slots:  # freed gradients are used once, by this step, whatever it did
                slot.taken = None

    def stage(self, slots: list[Slot], backward: Backward | None) -> Staged:
        """Run the step's communication and math without changing anything; returns what
        commits it. ``backward``: the buckets already started during backward."""
        again = [s.name for s in slots if s.taken is not None and s.param.grad is not None]
        if again:
            if backward is not None and backward.run is not None:
                backward.run.drain()
            raise OptimizerError(
                f"the gradient of {names_text(again)} was accumulated again after its bucket had taken and "
                "freed it (free_grads=True): accumulate micro-batches inside optimizer.no_sync(), or pass "
                "free_grads=False"
            )
        grads = [slot.local_grad() for slot in slots]
        compiled = self._compiler.compiled(slots, [(layout, grad.dtype) for grad, layout in grads])
        for slot, (grad, layout) in zip(slots, grads, strict=True):
            if is_dtensor(slot.param):
                slot.seen_grad = (layout, grad.dtype)
        step_number = min(s.step for s in slots) + 1
        kept = self._clipping.take(compiled, slots, grads)  # the gradients changed since: reduced again
        before = self._overlap.started(backward, compiled, slots, grads, step_number)
        try:
            self._replicas.gradients(slots, grads, step_number)
            return self._staged(slots, grads, compiled, step_number, before, backward, kept)
        except Exception:
            if before is not None:
                before.drain()
            raise

    def clip(self, slots: list[Slot], backward: Backward | None, max_norm: float) -> torch.Tensor:
        """``clip_grad_norm_``: the buckets before the update and the norm of their results,
        kept for the step that follows."""
        grads = [slot.local_grad() for slot in slots]
        compiled = self._compiler.compiled(slots, [(layout, grad.dtype) for grad, layout in grads])
        step_number = min(s.step for s in slots) + 1
        before = self._overlap.started(backward, compiled, slots, grads, step_number)
        try:
            arrived, waited = self._reduce_before(slots, grads, compiled, step_number, before, backward)
            reduced = [arrived[compiled.legs[(s.name, "grad -> state")]] for s in slots]
            norm, norm_bytes, norm_collectives = self._clipping.grad_norm(slots, reduced, step_number)
        except Exception:
            if before is not None:
                before.drain()
            raise
        grads = [slot.local_grad() for slot in slots]  # with free_grads, the stand-ins of those freed
        traffic = (norm_bytes, norm_collectives)
        self._clipping.keep(Reduced(compiled, slots, grad_versions(grads), arrived, waited, norm, traffic, max_norm))
        return norm

    def _reduce_before(
        self,
        slots: list[Slot],
        grads: list[tuple[torch.Tensor, Layout]],
        compiled: CompiledStep,
        step_number: int,
        before: StageRun | None,
        backward: Backward | None,
    ) -> tuple[dict[int, torch.Tensor], float]:
        """The buckets before the update not started during backward, then all waited on: every
        leg's piece in the state layout, and the seconds spent waiting."""
        legs = compiled.legs
        inputs: dict[int, torch.Tensor] = {}
        for slot, (grad, _) in zip(slots, grads, strict=True):
            inputs[legs[(slot.name, "grad -> state")]] = as_dtype(grad, self._compiler.wire_dtype(grad.dtype))
            own = self._store.own(slot) if slot.own_layouts else NO_STATES  # a call less per tensor
            inputs |= compiled.before_inputs(slot, own, self.rank, grad.device)
        if before is None:
            before = self._compiler.stage(compiled, BEFORE, slots)
        try:
            before.feed({i: x for i, x in inputs.items() if i not in before.legs})
            arrived = before.finish()
        except ShardlangError as e:
            raise _failed(step_number, BEFORE, e) from e
        # Under overlap, freed as packed (backward's buckets are); otherwise once the step
        # committed (run), so that a failed step can be retried on the same gradients.
        if self._free_grads and self._compiler.overlap:
            for slot, (_, layout) in zip(slots, grads, strict=True):
                taken = slot.taken is not None  # during backward already (overlap)
                if not taken and legs[(slot.name, "grad -> state")] in before.packed:
                    take_grad(slot, layout)
        if backward is not None and backward.error is not None:
            raise _failed(step_number, BEFORE, backward.error) from backward.error
        return arrived, before.waited

    def _staged(
        self,
        slots: list[Slot],
        grads: list[tuple[torch.Tensor, Layout]],
        compiled: CompiledStep,
        step_number: int,
        before: StageRun | None,
        backward: Backward | None,
        kept: Reduced | None,
    ) -> Staged:
        legs, flat = compiled.legs, self._store.flat()

        # 1. Before the update (unless clip_grad_norm_ did it): the gradients into the state layout.
        if kept is None:
            arrived, waited = self._reduce_before(slots, grads, compiled, step_number, before, backward)
        else:
            arrived, waited = kept.arrived, kept.waited
        reduced = [arrived[legs[(s.name, "grad -> state")]] for s in slots]
        clipped = self._clipping.clip(slots, reduced, kept, step_number)
        if clipped.skip:
            return self._skip(clipped.norm, step_number)
        # Not committed where a NaN or inf reached them: tested here, told with the flag.
        finite = gradients_finite(slots, reduced, clipped.norm)
        reduced, norm = clipped.grads, clipped.norm
        if self.math_in_place:
            return self._staged_in_place(
                slots, compiled, arrived, reduced, norm, step_number, waited, clipped.traffic, finite
            )

        # 2. The math, into new buffers; new parameters where their gathers send them from (a
        # transactional step) or in one flat scratch buffer (the gathers run after the commit).
        param_legs = {s.index: legs[(s.name, "state -> param")] for s in slots}
        after = None
        if self.transactional:
            after = self._compiler.stage(compiled, AFTER, slots, deliver=frozenset(param_legs.values()))
            fresh_params = self._fresh_params(slots, after, param_legs)
        else:
            fresh_params = self._fresh_flat([s for s in slots if not s.needs_master])
        new_buffers = flat.fresh(s.index for s in slots)
        params, new_params, own = [], [], {}
        for i, slot in enumerate(slots):
            fetch = legs.get((slot.name, "param -> state"))
            params.append(as_dtype(arrived[fetch], slot.dtype) if fetch is not None else flat.view(slot.index, MASTER))
            new_params.append(
                flat.view(slot.index, MASTER, new_buffers) if slot.needs_master else fresh_params[slot.index]
            )
            for state in slot.own_layouts:
                own[(i, state)] = arrived[legs[(slot.name, f"state.{state} -> state")]]
        work = StepWork(slots, reduced, params, new_params, flat, new_buffers, own)
        try:
            with profiled(UPDATE, self._math):
                sums = self._driver.run(work, step_number)
        except UpdateFailed as failed:
            if after is not None:
                self._join_after(after, compiled, slots)
            where = "every rank" if self.flag.enabled else "this rank"
            raise OptimizerStepError(
                f"step {step_number} failed in the update on rank {self.rank}: {_first_line(failed.error)}; "
                f"parameters and optimizer states are unchanged on {where}"
            ) from failed.error
        if after is None:
            # Every sum of the math is done and nothing is written: the states swap in once the
            # ranks agreed, then the gathers write the parameters, as an update in place does.
            def swap_and_gather() -> None:
                flat.replace(new_buffers)
                self._after_commit(
                    slots, compiled, new_params, work.own_new, None, sums, step_number, waited, norm, clipped.traffic
                )

            return Staged(swap_and_gather, finite=finite)

        # 3. After the update; with prefetch_params the parameters' gathers are waited on later.
        prefetch = self._compiler.prefetch
        inputs = {}
        for i, (slot, param) in enumerate(zip(slots, new_params, strict=True)):
            inputs[legs[(slot.name, "state -> param")]] = as_dtype(param, slot.param.dtype)
            for state in slot.own_layouts:
                inputs[legs[(slot.name, f"state -> state.{state}")]] = work.own_new[(i, state)]
        own_legs = [legs[(s.name, f"state -> state.{state}")] for s in slots for state in s.own_layouts]
        try:
            after.feed(inputs)
            back = after.wait_for(own_legs) if prefetch else after.finish()
        except ShardlangError as e:
            after.drain()
            raise _failed(step_number, AFTER, e) from e
        self.last.wait_seconds = waited + after.waited
        traffic = self._traffic(compiled, slots, sums, clipped.traffic)

        def commit() -> None:
            for slot in slots:
                for state in slot.own_layouts:
                    self._store.own(slot)[state] = back[legs[(slot.name, f"state -> state.{state}")]].clone()
                slot.step += 1
            if prefetch:
                self._gathers.hand(after, param_legs, slots, step_number)
            else:
                after.write({param_legs[s.index]: s.local_param() for s in slots})
            flat.replace(new_buffers)
            self.last.traffic = traffic
            self.last.grad_norm, self.last.skipped = norm, False

        return Staged(commit, after.drain, finite)

    def _traffic(
        self, compiled: CompiledStep, slots: Sequence[Slot], sums: tuple[int, int], norm: tuple[int, int]
    ) -> StepTraffic:
        return compiled.traffic((sums[0] + norm[0], sums[1] + norm[1]), self.flag.traffic(self._slots.members(slots)))

    def _staged_in_place(
        self,
        slots: list[Slot],
        compiled: CompiledStep,
        arrived: Mapping[int, torch.Tensor],
        reduced: Sequence[torch.Tensor],
        norm: torch.Tensor | None,
        step_number: int,
        waited: float,
        norm_traffic: tuple[int, int],
        finite: Finite,
    ) -> Staged:
        """A step whose every check passed (the buckets before the update, the norm) and that
        has written nothing (the nonfinite test, ``finite``, goes with the flag): its
        ``commit``, run once the ranks agreed, updates states and parameter shards in place and
        gathers the parameters (docs/memory.md, "The commit point")."""
        legs, flat = compiled.legs, self._store.flat()
        params: list[torch.Tensor] = []
        first_masters: list[tuple[torch.Tensor, torch.Tensor]] = []  # (master, parameter shard)
        own: dict[tuple[int, str], torch.Tensor] = {}
        for i, slot in enumerate(slots):
            fetch = legs.get((slot.name, "param -> state"))
            if slot.needs_master:
                params.append(flat.view(slot.index, MASTER))
                if fetch is not None:  # its first step: the master starts as the parameter
                    first_masters.append((params[-1], arrived[fetch]))
            else:
                assert fetch is not None
                params.append(arrived[fetch])  # a view of the parameter where its layout allows
            for state in slot.own_layouts:
                own[(i, state)] = arrived[legs[(slot.name, f"state.{state} -> state")]]

        def commit() -> None:
            failure: Exception | None = None
            try:
                for master, shard in first_masters:
                    master.copy_(shard)
                with profiled(UPDATE, self._math):
                    sums = self._driver.run(StepWork.in_place_of(slots, reduced, params, flat, own), step_number)
            except UpdateFailed as e:  # after the commit point: joined below, then raised everywhere
                failure, sums = e.error, (0, 0)
            except Exception as e:
                failure, sums = e, (0, 0)
            self._after_commit(slots, compiled, params, own, failure, sums, step_number, waited, norm, norm_traffic)

        return Staged(commit, finite=finite)

    def _after_commit(
        self,
        slots: Sequence[Slot],
        compiled: CompiledStep,
        params: Sequence[torch.Tensor],
        own: Mapping[tuple[int, str], torch.Tensor],
        failure: Exception | None,
        sums: tuple[int, int],
        step_number: int,
        waited: float,
        norm: torch.Tensor | None,
        norm_traffic: tuple[int, int],
    ) -> None:
        """The gathers of a step past its commit point, from the new parameter shards
        (``params``) and own-layout states (``own``), written into the parameters bucket by
        bucket, then the second flag: a ``failure`` here raises at once, and on the other ranks
        at their next step (docs/design/failures.md, "Where the commit point lies")."""
        legs, store = compiled.legs, self._store
        param_legs = {s.index: legs[(s.name, "state -> param")] for s in slots}
        members = self._slots.members(slots)
        prefetch = self._compiler.prefetch
        inputs = {}
        for i, slot in enumerate(slots):
            inputs[param_legs[slot.index]] = as_dtype(params[i], slot.param.dtype)
            held = store.own(slot) if slot.own_layouts else NO_STATES
            for state in slot.own_layouts:
                inputs[legs[(slot.name, f"state -> state.{state}")]] = own[(i, state)]
                if state not in held:  # where the stage after the update writes it
                    held[state] = torch.zeros(  # type: ignore[index]
                        slot.own_piece_shape(state, self.rank), dtype=slot.dtype, device=params[i].device
                    )
        if prefetch:
            after = self._compiler.stage(compiled, AFTER, slots, deliver=frozenset(param_legs.values()))
        else:
            write_to = {param_legs[s.index]: s.local_param() for s in slots}
            for slot in slots:
                for state in slot.own_layouts:
                    write_to[legs[(slot.name, f"state -> state.{state}")]] = store.own(slot)[state]
            after = self._compiler.stage(compiled, AFTER, slots, write_to=write_to)
        try:
            after.feed(inputs)
            if prefetch:
                back = after.wait_for([leg for leg in inputs if leg not in param_legs.values()])
                for slot in slots:
                    for state in slot.own_layouts:
                        store.own(slot)[state].copy_(back[legs[(slot.name, f"state -> state.{state}")]])
            else:
                after.finish()
        except Exception as e:
            after.drain()
            failure = failure or e
        # The second flag is posted, not waited on: a rank that failed waits for it (the others
        # learn of the failure from it), the others at their next step (ParamGathers._settle).
        # Under torch.profiler every rank waits for it here: gloo work left in flight across the
        # profiler's stop can crash the process (runtime/comm/collectives.py).
        with profiled(COMMIT, self._flag_names[1]):
            agreement = self.flag.post(members, ok=failure is None)
            if failure is not None or profiling():
                agreement.agreed()
        if failure is not None:
            if prefetch:
                after.drain()
            what = f"failed after its commit point on rank {self.rank}: {_first_line(failure)}"
            raise self._gathers.failed_after_commit(step_number, what) from failure
        for slot in slots:
            slot.step += 1
        if prefetch:
            self._gathers.hand(after, param_legs, slots, step_number)
        self._gathers.hand_agreement(agreement, step_number)
        self.last.wait_seconds = waited + after.waited
        self.last.traffic = self._traffic(compiled, slots, sums, norm_traffic)
        self.last.grad_norm, self.last.skipped = norm, False

    def _skip(self, norm: torch.Tensor | None, step_number: int) -> Staged:
        """What commits a step skipped for a gradient that is NaN or inf (on every rank: the
        norm is the same everywhere): nothing changes but the record of it."""

        def commit() -> None:
            self.last.grad_norm, self.last.skipped = norm, True
            assert norm is not None  # a skipped step took the norm
            warnings.warn(
                f"{self._owner}: step {step_number} skipped: the gradients' norm is {float(norm)}", stacklevel=3
            )

        return Staged(commit)

    def _join_after(self, after: StageRun, compiled: CompiledStep, slots: Sequence[Slot]) -> None:
        """After this rank's update failed: the stage after the update runs anyway, on zeros,
        so that the ranks it shares buckets with finish their step and learn of the failure
        from the commit flag, instead of waiting out the timeout (and leaving their groups
        broken) for collectives this rank never joins. Only where nobody commits without this
        rank (``all_ranks_commit``; updates that run collectives of their own are never joined:
        ``PhaseDriver.joinable``)."""
        if not self.flag.enabled or len(self._slots.members(slots)) < 2:
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
        """The flat buffers' views of :meth:`_fresh_params` for ``slots`` (none with a master);
        views of buffers replaced since are dropped, so that they do not keep them."""

        def current(held: list[tuple[Any, int, int]]) -> bool:
            return all(self._scratch.take("new params", n, *key).data_ptr() == at for key, n, at in held)

        cached = self._fresh_views.get(tuple(s.index for s in slots))
        if cached is not None and current(cached[1]):
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
        self._fresh_views = {k: v for k, v in self._fresh_views.items() if current(v[1])}
        self._fresh_views[tuple(s.index for s in slots)] = (out, held)
        return out


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _failed(step_number: int, stage: str, e: ShardlangError) -> OptimizerStepError:
    return OptimizerStepError(
        f"step {step_number} failed {stage}: {e.message}; parameters and optimizer states are unchanged"
    )
