"""What both sharded optimizers share: placing every parameter, and the step.

Every parameter gets its layouts (param, grad, state) from the spec, or from its DTensor
placements, and this rank's part of its state (:class:`StateShard`). A step is staged, then
committed:

1. every gradient is resharded from its grad layout to the state layout (``routes``);
2. the optimizer math runs on the local shards out of place; the partial sums it needs
   (CAME) are completed phase by phase, all tensors' sums of a phase batched
   (``sums.plan_collectives``);
3. every updated parameter is resharded from the state layout to its param layout.

Only when all of that succeeded are the parameters and states replaced on this rank. An
error in any reshard or reduction (a bad layout, a peer that died) raises
:class:`OptimizerStepError` naming the tensor, and leaves this rank's parameters and states
as they were. (A rank whose peers failed after it had finished cannot know; ranks that
raise are consistent with each other.)

Parameters in a lower precision than the states (bf16) keep an fp32 master shard in the
state layout (state ``master``); otherwise the parameter's state-layout shard is taken from
the parameter each step (usually a slice: no communication).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from planner.cost import CostModel
from runtime.blocks import piece_shape
from runtime.comm import timeout_of
from runtime.dtypes import dtype_name
from runtime.errors import DistributedError
from runtime.optim.errors import OptimizerError, OptimizerStepError
from runtime.optim.routes import Hop, Route, flat_view, without_axis
from runtime.optim.shards import StateShard
from runtime.optim.sums import SumReducer, SumSpec, plan_collectives
from shardlang.errors import ShardlangError
from shardlang.interop import from_dtensor_placements, mesh_from_device_mesh
from shardlang.layout import Layout
from shardlang.spec import STATE_DEFAULT, Layouts, Spec, TensorSpec

STATE_DICT_FORMAT = "shardlang.sharded_optimizer/1"

SpecLike = Spec | Mapping[str, Layouts | TensorSpec] | None
# The math of one tensor's step: yields the partial sums of each phase, is sent them
# completed, returns the new parameter and states.
Update = Generator[list[torch.Tensor], list[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@attrs.define(eq=False)
class Slot:
    """One parameter as this rank's optimizer sees it."""

    name: str
    param: torch.Tensor
    shape: tuple[int, ...]  # the whole tensor's
    group: dict[str, Any]
    param_layout: Layout
    grad_layout: Layout | None  # None: read from the gradient (DTensor)
    state_layout: Layout
    shard: StateShard | None  # None: this rank is outside the tensor's mesh
    flat_axis: int | None
    device_mesh: DeviceMesh | None
    dtype: torch.dtype  # of the states and the math
    cost: CostModel  # the reshards are planned under
    states: dict[str, torch.Tensor] = attrs.field(factory=dict)
    step: int = 0

    @property
    def needs_master(self) -> bool:
        return self.param.dtype != self.dtype

    def local_param(self) -> torch.Tensor:
        return self.param.to_local() if isinstance(self.param, DTensor) else self.param.detach()

    def local_grad(self) -> tuple[torch.Tensor, Layout]:
        grad = self.param.grad
        assert grad is not None
        if isinstance(grad, DTensor):
            mesh = mesh_from_device_mesh(grad.device_mesh)
            return grad.to_local(), from_dtensor_placements(grad.placements, grad.ndim, mesh)
        if self.grad_layout is None:
            raise OptimizerError(f"tensor '{self.name}' is a DTensor but its gradient is a plain tensor")
        return grad, self.grad_layout

    # --- routes between placements (each hop planned by the planner) ---------------------
    def route_to_state(self, layout: Layout) -> Route:
        """From ``layout`` (the gradient's or the parameter's) to the state layout; with flat
        sharding, to the base block (keeping ``layout``'s pending reduction over the flat axis),
        then to its flat chunk."""
        if self.flat_axis is None:
            return Route((Hop(layout, self.state_layout, self.shape),), self.cost)
        assert self.shard is not None
        partial = tuple((a, op) for a, op in layout.partial if a == self.flat_axis)
        arriving = attrs.evolve(self.shard.layout, partial=partial)
        src, dst = flat_view(arriving, self.flat_axis)
        n = math.prod(self.shard.block_shape)
        return Route((Hop(layout, arriving, self.shape), Hop(src, dst, (n,), view=(n,))), self.cost)

    def route_to_param(self) -> Route:
        if self.flat_axis is None:
            return Route((Hop(self.state_layout, self.param_layout, self.shape),), self.cost)
        assert self.shard is not None
        src, dst = flat_view(self.shard.layout, self.flat_axis)
        n = math.prod(self.shard.block_shape)
        return Route(
            (Hop(dst, src, (n,)), Hop(self.shard.layout, self.param_layout, self.shape, view=self.shard.block_shape)),
            self.cost,
        )


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
    """What one step communicates on this rank, as planned: reshard bytes and collectives
    (planner), statistics all-reduces and their bytes (``sums.plan_collectives``)."""

    reshard_bytes: int = 0
    reshard_collectives: int = 0
    sum_bytes: int = 0
    sum_collectives: int = 0

    @property
    def bytes(self) -> int:
        return self.reshard_bytes + self.sum_bytes

    @property
    def collectives(self) -> int:
        return self.reshard_collectives + self.sum_collectives


def computed(param: torch.Tensor, states: dict[str, torch.Tensor]) -> Update:
    """The update of math that needs no sums: its result, already computed."""
    return param, states
    yield  # a generator that yields nothing


class ShardedOptimizer(torch.optim.Optimizer):
    """Base of :class:`ShardedAdamW` and :class:`ShardedCAME`; subclasses give the states,
    the math and its phases of sums."""

    phases: tuple[str, ...] = ()

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]],
        spec: SpecLike,
        defaults: dict[str, Any],
        *,
        flat_axis: str | int | None = None,
        state_dtype: torch.dtype | None = None,
        timeout: float | datetime.timedelta | None = None,
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
        self.timeout = timeout_of(timeout, OptimizerError)
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self._reducer = SumReducer(self.rank, self.timeout)
        self._slots = [
            self._place(name, p, group, spec, flat_axis, state_dtype)
            for group in self.param_groups
            for name, p in zip(group["param_names"], group["params"], strict=True)
        ]
        self.last_traffic = StepTraffic()

    # --- what subclasses give ----------------------------------------------------------
    def _initial_states(self, slot: Slot) -> dict[str, torch.Tensor]:
        """Zero states in the slot's shard (master excluded)."""
        raise NotImplementedError

    def _updates(
        self,
        slots: Sequence[Slot],
        grads: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
        states: Sequence[dict[str, torch.Tensor]],
    ) -> list[Update]:
        """One generator per slot (see :data:`Update`), each yielding once per phase."""
        raise NotImplementedError

    def _sum_specs(self, slot: Slot) -> tuple[tuple[SumSpec, ...], ...]:
        """Per phase, the sums the slot's math yields, in order."""
        return tuple(() for _ in self.phases)

    def _where(self, slot: Slot, name: str) -> StateWhere:
        """Where state ``name`` lies; by default it has the parameter's shape."""
        assert slot.shard is not None
        layout, shape = slot.shard.data_layout()
        flat_of = slot.shard.layout if slot.flat_axis is not None else None
        return StateWhere(layout, shape, flat_of, slot.shard.local_shape)

    # --- placing parameters ------------------------------------------------------------
    def _place(
        self,
        name: str,
        param: torch.Tensor,
        group: dict[str, Any],
        spec: SpecLike,
        flat_axis: str | int | None,
        state_dtype: torch.dtype | None,
    ) -> Slot:
        try:
            shape, param_layout, grad_layout, state_layout, device_mesh = _layouts(name, param, spec)
            # A spec file's cost hints for the mesh (bandwidth, latency) steer the reshard plans.
            cost = CostModel.from_hints(spec.hints(state_layout.mesh)) if isinstance(spec, Spec) else CostModel()
            for layout in (param_layout, grad_layout, state_layout):
                if layout is not None:
                    layout.check_shape(shape)
            if param_layout.is_partial or state_layout.is_partial:
                raise OptimizerError("its param and state layouts must not be partial")
            axis = None if flat_axis is None else state_layout.mesh.axis_index(flat_axis)
            block = state_layout if axis is None else without_axis(state_layout, axis)
            inside = self.rank in state_layout.mesh.ranks
            shard = StateShard.of(shape, block, self.rank, axis) if inside else None
            if inside and not isinstance(param, DTensor):
                piece = piece_shape(param_layout.rank_piece(shape, self.rank))
                if piece != tuple(param.shape):
                    raise OptimizerError(
                        f"rank {self.rank} holds a piece of shape {list(param.shape)}, but its param layout "
                        f"'{param_layout}' gives it {list(piece)} of {list(shape)}"
                    )
        except ShardlangError as e:
            raise OptimizerError(f"tensor '{name}': {e.message}") from None
        dtype = state_dtype or (param.dtype if param.dtype in (torch.float32, torch.float64) else torch.float32)
        return Slot(
            name=name,
            param=param,
            shape=shape,
            group=group,
            param_layout=param_layout,
            grad_layout=grad_layout,
            state_layout=state_layout,
            shard=shard,
            flat_axis=axis,
            device_mesh=device_mesh,
            dtype=dtype,
            cost=cost,
        )

    # --- the step ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        slots = [s for s in self._slots if s.shard is not None and s.param.grad is not None]
        staged, traffic = self._stage(slots)
        for slot, (local, states) in zip(slots, staged, strict=True):
            slot.local_param().copy_(local)
            slot.states = states
            slot.step += 1
        self.last_traffic = traffic
        return loss

    def _stage(self, slots: list[Slot]) -> tuple[list[tuple[torch.Tensor, dict[str, torch.Tensor]]], StepTraffic]:
        """New local parameters and states for ``slots`` (nothing is changed), and the
        traffic as planned."""
        reshard_bytes = reshard_collectives = 0

        def move(slot: Slot, route: Route, local: torch.Tensor, what: str) -> torch.Tensor:
            nonlocal reshard_bytes, reshard_collectives
            try:
                out = route.run(local, name=slot.name, device_mesh=slot.device_mesh, timeout=self.timeout)
            except (ShardlangError, RuntimeError) as e:
                message = e.message if isinstance(e, ShardlangError) else str(e)
                raise OptimizerStepError(
                    f"step {slot.step + 1} of tensor '{slot.name}' failed moving {what}: {message}; "
                    "parameters and optimizer states are unchanged"
                ) from e
            for plan in route.plans(local.dtype):
                reshard_bytes += plan.total_bytes
                reshard_collectives += len(plan.collectives)
            return out

        grads, params, states = [], [], []
        for slot in slots:
            local, layout = slot.local_grad()
            grad = move(slot, slot.route_to_state(layout), local, "its gradient to the state layout")
            grads.append(grad.to(slot.dtype))
            state = slot.states or self._initial_states(slot)
            if slot.needs_master and "master" in state:
                param = state["master"]
            else:  # the parameter's shard in the state layout (with a master: the first step only)
                route = slot.route_to_state(slot.param_layout)
                param = move(slot, route, slot.local_param(), "the parameter to the state layout").to(slot.dtype)
                if slot.needs_master:
                    state = state | {"master": param}
            states.append(state)
            params.append(param)
        results, sum_bytes, sum_collectives = self._exchange(slots, self._updates(slots, grads, params, states))
        staged = []
        for slot, (param, new_states) in zip(slots, results, strict=True):
            if slot.needs_master:
                new_states["master"] = param
            local = param.to(slot.param.dtype)
            staged.append((move(slot, slot.route_to_param(), local, "the updated parameter to its layout"), new_states))
        return staged, StepTraffic(reshard_bytes, reshard_collectives, sum_bytes, sum_collectives)

    def _exchange(
        self, slots: Sequence[Slot], updates: list[Update]
    ) -> tuple[list[tuple[torch.Tensor, dict[str, torch.Tensor]]], int, int]:
        """Drive the slots' math in lockstep, one batch of reductions per phase; the
        results, and the bytes and all-reduces the reductions took."""
        specs = [self._sum_specs(slot) for slot in slots]
        results: list[Any] = [None] * len(updates)
        sent: list[list[torch.Tensor]] = []
        for i, update in enumerate(updates):
            try:
                sent.append(next(update))
            except StopIteration as stop:  # no phases: the math is local
                results[i] = stop.value
                sent.append([])
        total_bytes = total_collectives = 0
        for k, phase in enumerate(self.phases):
            phase_specs = [spec for slot_specs in specs for spec in slot_specs[k]]
            values = [v for slot_values in sent for v in slot_values]
            try:
                done, collectives = self._reducer.reduce(phase_specs, values, phase)
            except DistributedError as e:
                raise OptimizerStepError(
                    f"step {slots[0].step + 1} failed reducing {phase}: {e.message}; "
                    "parameters and optimizer states are unchanged"
                ) from e
            total_bytes += sum(c.bytes for c in collectives)
            total_collectives += len(collectives)
            offset = 0
            for i, update in enumerate(updates):
                n = len(specs[i][k])
                try:
                    sent[i] = update.send(done[offset : offset + n])
                except StopIteration as stop:
                    results[i] = stop.value
                offset += n
        return results, total_bytes, total_collectives

    # --- what a step communicates ------------------------------------------------------
    def planned_traffic(self) -> StepTraffic:
        """What the next step will communicate on this rank, from the plans alone: every
        reshard (planner) and every statistics all-reduce, for the parameters that have
        gradients now."""
        slots = [s for s in self._slots if s.shard is not None and s.param.grad is not None]
        reshard_bytes = reshard_collectives = 0
        for slot in slots:
            grad, grad_layout = slot.local_grad()
            legs = [(slot.route_to_state(grad_layout), grad.dtype), (slot.route_to_param(), slot.param.dtype)]
            if not slot.needs_master or "master" not in slot.states:
                legs.append((slot.route_to_state(slot.param_layout), slot.param.dtype))
            for route, dtype in legs:
                for plan in route.plans(dtype):
                    reshard_bytes += plan.total_bytes
                    reshard_collectives += len(plan.collectives)
        specs = [self._sum_specs(slot) for slot in slots]
        sum_bytes = sum_collectives = 0
        for k in range(len(self.phases)):
            collectives = plan_collectives([spec for s in specs for spec in s[k]], self.rank)
            sum_bytes += sum(c.bytes for c in collectives)
            sum_collectives += len(collectives)
        return StepTraffic(reshard_bytes, reshard_collectives, sum_bytes, sum_collectives)

    # --- memory and checkpoints --------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (master shards included)."""
        return sum(t.numel() * t.element_size() for slot in self._slots for t in slot.states.values())

    def held_tensors(self) -> list[HeldTensor]:
        """Every parameter whose states this rank keeps, with where each state lies."""
        return [
            HeldTensor(
                name=slot.name,
                shape=slot.shape,
                param_layout=slot.param_layout,
                param=slot.local_param(),
                step=slot.step,
                state_dtype=slot.dtype,
                wheres={name: self._where(slot, name) for name in sorted(self._state_names(slot))},
                states=dict(slot.states),
            )
            for slot in self._slots
            if slot.shard is not None
        ]

    def _state_names(self, slot: Slot) -> set[str]:
        return set(self._initial_states(slot)) | ({"master"} if slot.needs_master else set())

    def state_dict(self) -> dict[str, Any]:
        """This rank's states, each with the layout it lies in."""
        tensors = {}
        for slot in self._slots:
            if slot.shard is None or not slot.states:
                continue
            records = {}
            for name, tensor in slot.states.items():
                records[name] = self._where(slot, name).record() | {"tensor": tensor.clone()}
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
                states[name] = tensor.to(dtype=slot.dtype, device=slot.local_param().device, copy=True)
            loaded.append((slot, int(entry["step"]), states))
        for slot, step, states in loaded:
            slot.step, slot.states = step, states
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "param_names"})


def _layouts(
    name: str, param: torch.Tensor, spec: SpecLike
) -> tuple[tuple[int, ...], Layout, Layout | None, Layout, DeviceMesh | None]:
    """The whole tensor's shape, its (param, grad, state) layouts and device mesh.

    A DTensor's param layout is its placements, its grad layout its gradient's (read each
    step), and the spec, when it places the tensor, gives the state layout (else the param
    layout). A plain tensor is the rank's piece of the shape the spec declares, or, placed
    by a rule or a :class:`Layouts`, the whole tensor.
    """
    if isinstance(param, DTensor):
        shape = tuple(param.shape)
        entry = _spec_entry(name, shape, param.dtype, spec)
        layout = from_dtensor_placements(param.placements, param.ndim, mesh_from_device_mesh(param.device_mesh))
        if entry is not None and entry.shape != shape:
            raise OptimizerError(f"the spec declares shape {list(entry.shape)}, the DTensor has {list(shape)}")
        state = entry.state() if entry is not None else layout
        return shape, layout, None, state, param.device_mesh
    entry = _spec_entry(name, tuple(param.shape), param.dtype, spec)
    if entry is None:
        raise OptimizerError("it has no layouts: the spec does not place it, and it is not a DTensor")
    for key, layout in entry.layouts.states:
        if key != STATE_DEFAULT and layout != entry.state():
            raise OptimizerError(
                f"state.{key} has its own layout '{layout}'; the sharded optimizers keep every state in "
                f"the tensor's state layout '{entry.state()}'"
            )
    return entry.shape, entry.param, entry.grad, entry.state(), None


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
