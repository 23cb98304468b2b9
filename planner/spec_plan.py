"""Whole-model planning: the step plan (``planner.step``) of a spec file's tensors.

This is the plan the sharded optimizers run for the same tensors: per tensor its legs (the
gradient into the state layout; the parameter's state-layout shard while it has no fp32
master; every state kept in a layout of its own into the state layout and back; the updated
parameter into its param layout), each leg one or two planned hops, and the buckets that run
the legs' collectives together. The cost model of a tensor is its state mesh's hints, as the
optimizers take it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from planner.bucket_cap import AUTO, plan_step_with_model_cap
from planner.cost import CostModel
from planner.errors import PlanError
from planner.legs import Leg, StepTensor
from planner.plans import Plan
from planner.search import DEFAULT_MAX_STATES
from planner.step import StepPlan, plan_step
from shardlang.errors import ShardlangError
from shardlang.spec import STATE_DEFAULT, Spec, TensorSpec

# States are kept in f32, or f64 for f64 parameters; other parameters keep an f32 master.
_STATE_DTYPES = {"f64": "f64"}


@attrs.frozen
class TensorPlans:
    """One tensor's legs of the step plan and the cost model they were planned under."""

    tensor: TensorSpec
    legs: tuple[Leg, ...]
    cost: CostModel

    def plans(self) -> tuple[tuple[str, Plan], ...]:
        """Every hop of the step, labelled (``grad -> state``, ``state -> param``; a leg of two
        hops, with flat sharding, as ``grad -> state (1/2)`` and ``(2/2)``)."""
        out = []
        for leg in self.legs:
            for k, hop in enumerate(leg.hops):
                label = leg.what if len(leg.hops) == 1 else f"{leg.what} ({k + 1}/{len(leg.hops)})"
                out.append((label, hop.plan))
        return tuple(out)

    def plan_of(self, what: str) -> Plan:
        """The plan of the one-hop leg ``what`` (``grad -> state``, ...)."""
        (leg,) = (leg for leg in self.legs if leg.what == what)
        (hop,) = leg.hops
        return hop.plan

    @property
    def total_bytes(self) -> int:
        return sum(leg.total_bytes for leg in self.legs)

    @property
    def total_seconds(self) -> float:
        """Modeled time of the tensor's plans on their own (buckets share latency; see
        :attr:`SpecPlan.total_seconds`)."""
        return sum(leg.total_seconds for leg in self.legs)


@attrs.frozen
class SpecPlan:
    spec: Spec
    tensors: tuple[TensorPlans, ...]
    step: StepPlan

    @property
    def total_bytes(self) -> int:
        return self.step.total_bytes

    @property
    def total_seconds(self) -> float:
        """Modeled time of the step, bucketed."""
        return self.step.total_seconds


def cost_for(
    spec: Spec,
    tensor: TensorSpec,
    *,
    alpha: float | tuple[float, ...] | None = None,
    bandwidth: float | tuple[float, ...] | None = None,
    cost: CostModel | None = None,
) -> CostModel:
    """The cost model of a tensor's state mesh: ``cost`` when given (a measured model,
    ``CostModel.from_file``), else the spec's hints; overridden by explicit values."""
    base = cost if cost is not None else CostModel.from_hints(spec.hints(tensor.state().mesh))
    return base.with_overrides(alpha=alpha, bandwidth=bandwidth)


def step_tensor(tensor: TensorSpec, cost: CostModel, flat_axis: str | int | None = None) -> StepTensor:
    """What the step plan needs of a spec's tensor (dtypes as the optimizers choose them)."""
    state = tensor.state()
    state_dtype = _STATE_DTYPES.get(tensor.dtype, "f32")
    try:
        axis = None if flat_axis is None else state.mesh.axis_index(flat_axis)
    except ShardlangError as e:
        raise PlanError(f"tensor '{tensor.name}': flat axis: {e.message}", tensor.position) from None
    return StepTensor(
        name=tensor.name,
        shape=tensor.shape,
        param=tensor.param,
        grad=tensor.grad,
        state=state,
        param_dtype=tensor.dtype,
        grad_dtype=tensor.dtype,
        state_dtype=state_dtype,
        own_states=tuple(
            (name, layout) for name, layout in tensor.layouts.states if name != STATE_DEFAULT and layout != state
        ),
        flat_axis=axis,
        fetch_param=state_dtype == tensor.dtype,
        cost=cost,
        position=tensor.position,
    )


def plan_spec(
    spec: Spec,
    *,
    tensors: Sequence[str | TensorSpec] | None = None,
    alpha: float | tuple[float, ...] | None = None,
    bandwidth: float | tuple[float, ...] | None = None,
    cost: CostModel | None = None,
    max_local_bytes: int | None = None,
    point_to_point: bool = False,
    flat_axis: str | int | None = None,
    bucket_bytes: int | str | None = None,
    overlap: bool = False,
    prefetch: bool = False,
    rank: int = 0,
    on_tensor: Callable[[TensorSpec], None] | None = None,
    max_states: int = DEFAULT_MAX_STATES,
) -> SpecPlan:
    """The step plan of every declared tensor, or of ``tensors``: names of declared tensors,
    or tensor specs the caller resolved (``Spec.resolve``, rules included), as seen by ``rank``
    (with ``flat_axis``, the flat hop's length is the rank's base block).

    ``point_to_point=True`` lets every hop use point-to-point steps and mixes where they are
    cheaper (:func:`planner.plan`); by default hops are collective plans (the baseline move set,
    which the optimizers run). ``cost`` replaces the spec's hints for every mesh (one model for
    choosing the plans and for running them: give the optimizers the same one). ``flat_axis``,
    ``bucket_bytes`` and ``overlap`` are the optimizers' options (``bucket_bytes``
    :data:`planner.bucket_cap.AUTO`: the cost model's cap), ``prefetch`` stands for their
    ``prefetch_params``. ``max_states`` is the search budget of every hop (:func:`planner.plan`).
    ``on_tensor`` is called with each tensor before it is planned (progress display).

    Plans are memoized by :func:`planner.plan`, so tensors with equal layouts, shape and
    dtype are planned once.
    """
    if tensors is None:
        chosen = spec.tensors
    else:
        chosen = tuple(t if isinstance(t, TensorSpec) else spec.tensor(t) for t in tensors)
    inputs, costs = [], {}
    for t in chosen:
        if on_tensor is not None:
            on_tensor(t)
        mesh = t.state().mesh
        if mesh not in costs:
            costs[mesh] = cost_for(spec, t, alpha=alpha, bandwidth=bandwidth, cost=cost)
        inputs.append(step_tensor(t, costs[mesh], flat_axis))
    options: dict[str, Any] = {
        "max_local_bytes": max_local_bytes,
        "point_to_point": point_to_point,
        "overlap": overlap,
        "prefetch": prefetch,
        "max_states": max_states,
    }
    if bucket_bytes == AUTO:
        step = plan_step_with_model_cap(inputs, rank, **options)
    else:
        step = plan_step(inputs, rank, bucket_bytes=bucket_bytes, **options)  # type: ignore[arg-type]
    plans = tuple(
        TensorPlans(tensor=t, legs=step.legs_of(t.name), cost=item.cost) for t, item in zip(chosen, inputs, strict=True)
    )
    return SpecPlan(spec=spec, tensors=plans, step=step)
