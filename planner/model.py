"""Whole-model planning: what one optimizer step communicates, tensor by tensor.

Per tensor the step is: the gradient moves from its grad layout to the (default) state
layout, the update runs there, and the parameter moves from the state layout back to its
param layout. A state given its own layout (``state.exp_avg_sq = ...``) that differs from
the default is brought to the default layout for the update and taken back after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from planner.choice import plan
from planner.cost import CostModel, PlanError
from planner.plan import Plan
from shardlang.layout import Layout
from shardlang.spec import STATE_DEFAULT, Spec, TensorSpec


@attrs.frozen
class TensorPlans:
    tensor: TensorSpec
    grad_to_state: Plan
    state_to_param: Plan
    # (state name, override -> default, default -> override) for states with their own layout.
    state_moves: tuple[tuple[str, Plan, Plan], ...] = ()

    def plans(self) -> tuple[tuple[str, Plan], ...]:
        """Every plan of the step, labelled (``grad -> state``, ``state -> param``, ...)."""
        out = [("grad -> state", self.grad_to_state)]
        for name, to_default, from_default in self.state_moves:
            out += [(f"state.{name} -> state", to_default), (f"state -> state.{name}", from_default)]
        out.append(("state -> param", self.state_to_param))
        return tuple(out)

    @property
    def total_bytes(self) -> int:
        return sum(p.total_bytes for _, p in self.plans())

    @property
    def total_seconds(self) -> float:
        return sum(p.total_seconds for _, p in self.plans())


@attrs.frozen
class SpecPlan:
    spec: Spec
    tensors: tuple[TensorPlans, ...]

    @property
    def total_bytes(self) -> int:
        return sum(t.total_bytes for t in self.tensors)

    @property
    def total_seconds(self) -> float:
        return sum(t.total_seconds for t in self.tensors)


def cost_for(
    spec: Spec,
    tensor: TensorSpec,
    *,
    alpha: float | tuple[float, ...] | None = None,
    bandwidth: float | tuple[float, ...] | None = None,
) -> CostModel:
    """The cost model of a tensor's mesh: the spec's hints, overridden by explicit values."""
    return CostModel.from_hints(spec.hints(tensor.param.mesh)).with_overrides(alpha=alpha, bandwidth=bandwidth)


def plan_tensor(
    tensor: TensorSpec, cost: CostModel, *, max_local_bytes: int | None = None, point_to_point: bool = False
) -> TensorPlans:
    """The plans of one tensor's optimizer step; ``point_to_point`` as in :func:`planner.plan`."""
    state = tensor.state()

    def leg(src: Layout, dst: Layout) -> Plan:
        try:
            return plan(
                src,
                dst,
                tensor.shape,
                tensor.dtype,
                cost,
                max_local_bytes=max_local_bytes,
                point_to_point=point_to_point,
            )
        except PlanError as e:
            raise PlanError(f"tensor '{tensor.name}': {e.message}", tensor.position) from None

    moves = tuple(
        (name, leg(layout, state), leg(state, layout))
        for name, layout in tensor.layouts.states
        if name != STATE_DEFAULT and layout != state
    )
    return TensorPlans(
        tensor=tensor,
        grad_to_state=leg(tensor.grad, state),
        state_to_param=leg(state, tensor.param),
        state_moves=moves,
    )


def plan_spec(
    spec: Spec,
    *,
    tensors: Sequence[str | TensorSpec] | None = None,
    alpha: float | tuple[float, ...] | None = None,
    bandwidth: float | tuple[float, ...] | None = None,
    max_local_bytes: int | None = None,
    point_to_point: bool = False,
    on_tensor: Callable[[TensorSpec], None] | None = None,
) -> SpecPlan:
    """Plans of one optimizer step for every declared tensor, or for ``tensors``: names of
    declared tensors, or tensor specs the caller resolved (``Spec.resolve``, rules included).

    ``point_to_point=True`` lets every leg use point-to-point steps and mixes where they are
    cheaper (:func:`planner.plan`); by default legs are collective plans (the baseline move set).
    ``on_tensor`` is called with each tensor before it is planned (progress display).

    Plans are memoized by :func:`planner.plan`, so tensors with equal layouts, shape and
    dtype are planned once.
    """
    if tensors is None:
        chosen = spec.tensors
    else:
        chosen = tuple(t if isinstance(t, TensorSpec) else spec.tensor(t) for t in tensors)
    planned = []
    for t in chosen:
        if on_tensor is not None:
            on_tensor(t)
        cost = cost_for(spec, t, alpha=alpha, bandwidth=bandwidth)
        planned.append(plan_tensor(t, cost, max_local_bytes=max_local_bytes, point_to_point=point_to_point))
    return SpecPlan(spec=spec, tensors=tuple(planned))
