"""The optimizer step as one plan: every tensor's routes, and the buckets that move them together.

A step of a sharded optimizer moves each tensor along *legs*, each a route of one or two
planned reshards (*hops*):

- before the update: ``grad -> state`` (the gradient into the state layout), ``param -> state``
  (the parameter's state-layout shard, while no fp32 master exists: usually a slice, no
  communication) and ``state.X -> state`` for every state ``X`` kept in its own layout;
- after the update: ``state -> param`` and ``state -> state.X``.

With flat sharding over mesh axis ``a`` the state is the rank's chunk of its *base block* (the
piece under the state layout without ``a``) flattened, so a leg into the state takes two hops,
``layout -> base block (keeping layout's pending reduction over a)`` and, on the 1-d view of
the base block, ``R | P(a) -> S(a)`` (one reduce_scatter); out of the state, ``S(a) -> R`` (one
all_gather) and ``base block -> layout``. The flat hop's shape is the rank's base block, so a
plan with a flat axis is the plan of one rank (``StepPlan.rank``); ranks that share a flat
group share it exactly.

The legs and their buckets are ``planner.legs``'s (its docstring says how steps are bucketed);
this module plans a step's legs and holds the step plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from planner.cheapest import plan as plan_pair
from planner.cost import CostModel
from planner.errors import PlanError
from planner.legs import (
    AFTER,
    AFTER_STEP,
    BEFORE,
    DEFAULT_BUCKET_BYTES,
    DURING_BACKWARD,
    IN_STEP,
    STAGES,
    Bucket,
    Hop,
    Leg,
    LegsInBuckets,
    StepTensor,
    bucket_from_json,
    bucket_stage,
    flat_view,
    leg_from_json,
    leg_meshes,
)
from planner.matrices import MatrixPlan
from planner.search import DEFAULT_MAX_STATES
from shardlang.layout import Layout


@attrs.frozen
class StepPlan(LegsInBuckets):
    """One optimizer step of every tensor a rank holds: the legs (``legs_of`` per tensor) and
    the buckets, in the order every rank runs them."""

    rank: int
    tensors: tuple[str, ...]
    legs: tuple[Leg, ...]
    buckets: tuple[Bucket, ...]
    bucket_bytes: int
    # Muon's Newton-Schulz iterations: where each runs, its moves and their buckets
    # (``planner.matrices``); ``None`` for optimizers without them.
    matrices: MatrixPlan | None = None

    def legs_of(self, tensor: str) -> tuple[Leg, ...]:
        return tuple(leg for leg in self.legs if leg.tensor == tensor)

    def stage_buckets(self, stage: str) -> tuple[Bucket, ...]:
        return tuple(b for b in self.buckets if b.stage == stage)

    @property
    def total_seconds(self) -> float:
        """Modeled time of the step's communication, bucketed."""
        return sum(b.seconds for b in self.buckets)

    @property
    def max_buffer_bytes(self) -> int:
        """The largest bucket buffer a rank holds (the memory buckets add)."""
        return max((b.buffer_bytes for b in self.buckets), default=0)

    def to_json(self) -> dict[str, Any]:
        out = {
            "rank": self.rank,
            "bucket_bytes": self.bucket_bytes,
            "tensors": list(self.tensors),
            "legs": [leg.to_json() for leg in self.legs],
            "buckets": [b.to_json() for b in self.buckets],
            "total_bytes": self.total_bytes,
            "total_seconds": self.total_seconds,
            "collectives": self.collectives,
            "unbucketed_collectives": self.unbucketed_collectives,
            "unbucketed_seconds": self.unbucketed_seconds,
        }
        if self.matrices is not None:
            out["matrices"] = self.matrices.to_json()
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepPlan:
        """Read back what :meth:`to_json` wrote."""
        try:
            legs = tuple(leg_from_json(leg) for leg in data["legs"])
            meshes = leg_meshes(legs)
            matrices = data.get("matrices")
            return cls(
                rank=int(data["rank"]),
                tensors=tuple(str(t) for t in data["tensors"]),
                legs=legs,
                buckets=tuple(bucket_from_json(b, meshes) for b in data["buckets"]),
                bucket_bytes=int(data["bucket_bytes"]),
                matrices=None if matrices is None else _matrix_plan_from_json(matrices),
            )
        except PlanError as e:
            raise PlanError(f"not a step plan in JSON form: {e.message}") from None
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise PlanError(f"not a step plan in JSON form: {type(e).__name__}: {e}") from None


def _matrix_plan_from_json(data: Mapping[str, Any]) -> MatrixPlan:
    return MatrixPlan.from_json(data)


def plan_step(
    tensors: Sequence[StepTensor],
    rank: int,
    *,
    bucket_bytes: int | None = None,
    max_local_bytes: int | None = None,
    point_to_point: bool = False,
    overlap: bool = False,
    prefetch: bool = False,
    max_states: int = DEFAULT_MAX_STATES,
) -> StepPlan:
    """The step plan of ``rank`` for ``tensors`` (in the order given, which must be the same on
    every rank). ``bucket_bytes`` caps a bucket's buffer (default :data:`DEFAULT_BUCKET_BYTES`;
    1 puts every step in a bucket of its own); ``max_local_bytes``, ``point_to_point`` and
    ``max_states`` (the search budget of each hop) are passed to :func:`planner.plan` for every
    hop. A hop's error is raised as its own type (:class:`~planner.errors.PlanBudgetError` stays
    one) with the tensor's name in front.

    ``overlap``: the buckets before the update are launched during backward, so they take the
    tensors in reverse order (the order in which backward finishes their gradients, as DDP
    buckets them). ``prefetch``: those after the update are launched after the step."""
    cap = DEFAULT_BUCKET_BYTES if bucket_bytes is None else int(bucket_bytes)
    if cap < 1:
        raise PlanError(f"bucket_bytes must be at least 1, got {bucket_bytes}")
    legs = step_legs(
        tensors, rank, max_local_bytes=max_local_bytes, point_to_point=point_to_point, max_states=max_states
    )
    costs = {t.name: t.cost for t in tensors}
    return bucketed_step(legs, tuple(t.name for t in tensors), costs, rank, cap, overlap=overlap, prefetch=prefetch)


def bucketed_step(
    legs: Sequence[Leg],
    names: tuple[str, ...],
    costs: Mapping[str, CostModel],
    rank: int,
    cap: int,
    *,
    overlap: bool = False,
    prefetch: bool = False,
) -> StepPlan:
    """The step plan of ``rank`` from its ``legs`` (:func:`step_legs`, of the tensors ``names``
    in order, ``costs`` by name): their steps bucketed under ``cap``, launched as
    :func:`plan_step` says."""
    launch = {BEFORE: DURING_BACKWARD if overlap else IN_STEP, AFTER: AFTER_STEP if prefetch else IN_STEP}
    buckets = [
        b
        for stage in STAGES
        for b in bucket_stage(legs, stage, costs, cap, reverse=overlap and stage == BEFORE, launch=launch[stage])
    ]
    return StepPlan(rank=rank, tensors=names, legs=tuple(legs), buckets=tuple(buckets), bucket_bytes=cap)


def step_legs(
    tensors: Sequence[StepTensor],
    rank: int,
    *,
    max_local_bytes: int | None = None,
    point_to_point: bool = False,
    max_states: int = DEFAULT_MAX_STATES,
) -> list[Leg]:
    """The legs of :func:`plan_step` (its keywords but the bucketing ones), not bucketed."""
    legs: list[Leg] = []
    for tensor in tensors:
        try:
            legs += _legs(tensor, rank, max_local_bytes, point_to_point, max_states)
        except PlanError as e:
            raise type(e)(f"tensor '{tensor.name}': {e.message}", tensor.position or e.position) from None
    return legs


def _legs(
    tensor: StepTensor, rank: int, max_local_bytes: int | None, point_to_point: bool, max_states: int
) -> list[Leg]:
    def hop(src: Layout, dst: Layout, shape: tuple[int, ...], dtype: str, view: tuple[int, ...] | None = None) -> Hop:
        planned = plan_pair(
            src,
            dst,
            shape,
            dtype,
            tensor.cost,
            max_local_bytes=max_local_bytes,
            point_to_point=point_to_point,
            max_states=max_states,
        )
        return Hop(planned, view)

    axis, base = tensor.flat_axis, tensor.base
    block = None
    if axis is not None:
        bounds = base.rank_piece(tensor.shape, rank)
        block = tuple(hi - lo for lo, hi in bounds)

    def into_state(layout: Layout, dtype: str) -> tuple[Hop, ...]:
        if axis is None or block is None:
            return (hop(layout, tensor.state, tensor.shape, dtype),)
        partial = tuple((a, op) for a, op in layout.partial if a == axis)
        arriving = attrs.evolve(base, partial=partial)
        src, dst = flat_view(arriving, axis, rank)
        n = math.prod(block)
        return hop(layout, arriving, tensor.shape, dtype), hop(src, dst, (n,), dtype, view=(n,))

    def out_of_state(layout: Layout, dtype: str) -> tuple[Hop, ...]:
        if axis is None or block is None:
            return (hop(tensor.state, layout, tensor.shape, dtype),)
        src, dst = flat_view(base, axis, rank)
        n = math.prod(block)
        return hop(dst, src, (n,), dtype), hop(base, layout, tensor.shape, dtype, view=block)

    name, state_dtype = tensor.name, tensor.state_dtype
    legs = [Leg(name, "grad -> state", BEFORE, tensor.grad_dtype, into_state(tensor.grad, tensor.grad_dtype))]
    if tensor.fetch_param:
        legs.append(
            Leg(name, "param -> state", BEFORE, tensor.param_dtype, into_state(tensor.param, tensor.param_dtype))
        )
    for state, layout in tensor.own_states:
        legs.append(Leg(name, f"state.{state} -> state", BEFORE, state_dtype, into_state(layout, state_dtype)))
    legs.append(Leg(name, "state -> param", AFTER, tensor.param_dtype, out_of_state(tensor.param, tensor.param_dtype)))
    for state, layout in tensor.own_states:
        legs.append(Leg(name, f"state -> state.{state}", AFTER, state_dtype, out_of_state(layout, state_dtype)))
    return legs
