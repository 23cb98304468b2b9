"""From the slots and their gradients' layouts to the step a rank runs: the step compiler.

A step plan (``planner.step.plan_step``) says, per tensor, its legs (``grad -> state``, ``param
-> state``, ``state -> param``, a state kept in its own layout there and back) and puts every
communicating step in a bucket; ``runtime.execution.step_program.compile_step`` makes this rank's program
of it. :class:`StepCompiler` builds both once per combination of slots, gradient layouts and
dtypes, checks once per plan that the ranks of every group hold the same buckets, keeps a few
plans (:data:`MAX_PLANS`), and owns the buffers the buckets' collectives keep between steps.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from planner.legs import StepTensor
from planner.step import StepPlan, plan_step
from runtime.comm.groups import axis_ranks, group_for
from runtime.errors import DistributedError, PlanMismatchError
from runtime.execution.agreement import differing_ranks
from runtime.execution.buckets import StageRun
from runtime.execution.step_program import StepProgram, compile_step
from runtime.memory.buffers import Scratch
from runtime.memory.dtypes import dtype_name
from runtime.optim.errors import OptimizerError, OptimizerStepError
from runtime.optim.records import StepTraffic
from runtime.optim.slots import Slot, Slots
from shardlang.errors import ShardlangError
from shardlang.layout import Layout
from shardlang.mesh import Mesh

# Step plans kept. A job usually runs one or two (the first step of a tensor with an fp32
# master fetches the parameter, the later ones do not); more come from steps over changing
# sets of tensors. A plan's program keeps views of the bucket buffers (``StepProgram.views``),
# so an unbounded cache would keep buffers that larger buckets have replaced.
MAX_PLANS = 8


@attrs.frozen(eq=False)
class CompiledStep:
    """A step plan, this rank's program of it, per (tensor, leg) the leg's index in it, and
    the legs whose input is the same tensor every step (a parameter's piece, a new parameter's
    place in a kept buffer: ``StageRun``'s ``stable``)."""

    plan: StepPlan
    program: StepProgram
    legs: Mapping[tuple[str, str], int]
    stable: frozenset[int]

    def before_inputs(
        self, slot: Slot, own: Mapping[str, torch.Tensor], rank: int, device: torch.device
    ) -> dict[int, torch.Tensor]:
        """The inputs of a slot's legs before the update other than its gradient's: its
        parameter's piece (while it has no master), and its states kept in a layout of their
        own (``own``; zeros before the first step)."""
        legs, inputs = self.legs, {}
        fetch = legs.get((slot.name, "param -> state"))
        if fetch is not None:
            inputs[fetch] = slot.local_param()
        for state in slot.own_layouts:
            held = own.get(state)
            if held is None:
                held = torch.zeros(slot.own_piece_shape(state, rank), dtype=slot.dtype, device=device)
            inputs[legs[(slot.name, f"state.{state} -> state")]] = held
        return inputs

    def traffic(self, sums: tuple[int, int], flag: tuple[int, int]) -> StepTraffic:
        """What a step of this plan communicates on this rank: its buckets (the plan's bytes and
        collectives), with the statistics all-reduces' and the commit flags' (bytes, collectives)
        given, as planned (``Accounting.planned_traffic``) or as the step ran them."""
        return StepTraffic(self.plan.total_bytes, self.plan.collectives, *sums, *flag)


class StepCompiler:
    """The step plans of a rank and their programs (see the module doc). ``write_through``:
    the stage after the update writes every result where it is kept as it lands (an update in
    place: ``compile_step``); ``reduce_dtype``: lower-precision gradients are reduced in it."""

    def __init__(
        self,
        slots: Slots,
        *,
        rank: int,
        timeout: datetime.timedelta,
        bucket_bytes: int | None,
        overlap: bool,
        write_through: bool,
        verify: bool,
        reduce_dtype: torch.dtype | None,
    ) -> None:
        self._slots, self.rank, self.timeout = slots, rank, timeout
        self.bucket_bytes, self.overlap, self._write_through = bucket_bytes, overlap, write_through
        self._verify_plans, self.reduce_dtype = verify, reduce_dtype
        # Whether the buckets after the update start after the step (prefetch_params).
        self.prefetch = False
        self.buffers = Scratch()  # the buckets' buffers (``runtime.execution.buckets``)
        self._plans: dict[tuple, CompiledStep] = {}  # in order of use, the last used last
        self._last: tuple[tuple, CompiledStep] | None = None  # the one the last step ran
        # Keys whose plans the ranks have compared: a plan compiled again after it left the
        # cache is not compared again, so that every rank joins the same comparisons.
        self._verified: set[tuple] = set()

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of ``dtype`` is reduced in: ``reduce_dtype`` when it is wider."""
        wide = self.reduce_dtype
        wider = wide is not None and dtype.is_floating_point and dtype.itemsize < wide.itemsize
        return wide if wider else dtype  # type: ignore[return-value]

    def start_prefetch(self) -> None:
        """From now on the buckets after the update start after the step: plans anew."""
        self.prefetch = True
        self._plans.clear()
        self._verified.clear()
        self._last = None

    def compiled(self, slots: Sequence[Slot], grads: Sequence[tuple[Layout, torch.dtype]]) -> CompiledStep:
        """The step plan for these slots and their gradients' layouts and dtypes, built once
        per combination."""
        key = tuple(
            (slot.index, layout, self.wire_dtype(dtype), slot.needs_master and slot.step > 0)
            for slot, (layout, dtype) in zip(slots, grads, strict=True)
        )
        # Most steps run the plan of the last one: an equality test of the key, whose layouts
        # are then the same objects, costs less than hashing it.
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        compiled = self._plans.pop(key, None)
        if compiled is None:
            compiled = self._compile(slots, grads)
            if self._verify_plans and key not in self._verified:
                self._verify(compiled.plan)
                self._verified.add(key)
            while len(self._plans) >= MAX_PLANS:  # the least recently used goes
                del self._plans[next(iter(self._plans))]
        self._plans[key] = compiled
        self._last = (key, compiled)
        return compiled

    def _compile(self, slots: Sequence[Slot], grads: Sequence[tuple[Layout, torch.dtype]]) -> CompiledStep:
        tensors = [
            StepTensor(
                name=slot.name,
                shape=slot.shape,
                param=slot.param_layout,
                grad=layout,
                state=slot.state_layout,
                param_dtype=dtype_name(slot.param.dtype),
                grad_dtype=dtype_name(self.wire_dtype(dtype)),
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
                tensors, self.rank, bucket_bytes=self.bucket_bytes, overlap=self.overlap, prefetch=self.prefetch
            )
            legs = {(leg.tensor, leg.what): i for i, leg in enumerate(plan.legs)}
            program = compile_step(plan, self.rank, write_through=self._write_through)
        except ShardlangError as e:
            raise OptimizerError(e.message) from None
        stable = frozenset(
            legs[(slot.name, what)]
            for slot in slots
            for what in ("param -> state", "state -> param")
            if (slot.name, what) in legs and not (what == "state -> param" and slot.needs_master)
        )
        return CompiledStep(plan, program, legs, stable)

    def stage(
        self,
        compiled: CompiledStep,
        stage: str,
        slots: Sequence[Slot],
        deliver: frozenset[int] = frozenset(),
        write_to: Mapping[int, torch.Tensor] | None = None,
    ) -> StageRun:
        """A run of one stage (before or after the update) of ``compiled`` for ``slots``, on
        the kept bucket buffers."""
        return StageRun(
            compiled.program,
            stage,
            device_meshes={s.name: s.device_mesh for s in slots},
            timeout=self.timeout,
            buffers=self.buffers,
            deliver=deliver,
            stable=compiled.stable,
            write_to=write_to,
        )

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
            device = self._slots[0].local_param().device
            try:
                group = group_for(mesh, (axis,), members, timeout=self.timeout)
                differ = differing_ranks(records, members, group, device, self.timeout)
            except DistributedError as e:
                raise OptimizerStepError(f"checking the step plan on ranks {list(members)} failed: {e.message}") from e
            if differ:
                raise PlanMismatchError(
                    f"the ranks of {mesh.describe()} along axis {mesh.axis_label(axis)} disagree on the step plan: "
                    f"rank {self.rank}'s buckets ({len(records)} on this axis) differ from those of ranks {differ}; "
                    "every rank must give the optimizer the same parameters, layouts and gradients"
                )
