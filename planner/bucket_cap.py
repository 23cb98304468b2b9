"""The bucket cap the cost model chooses: a step's latency against the memory its buffers cost.

Each bucket of a step plan (``planner.step``) is one collective: it pays its kind's latency
and the executor's overhead once, and each rank holds its buffer while it runs. A larger cap
gives fewer buckets (less latency) and larger buffers (more memory); past the largest
collective kind's buffer it changes nothing. The cost model's cap is the smallest of
:data:`CAPS` (powers of two from 1 MiB) under which the step's modeled time is at most
:data:`SLACK` more than under buckets of any size (one bucket per collective kind): the least
buffer memory that keeps the step within 5% of its least latency. It follows the step and the
model: many ranks on a slow axis (more rounds per bucket) take a larger cap than a few fast
ones, and a step whose kinds fit in a small buffer takes a small one.

A cap in use is *far* from the model's (:func:`far_from`) where the step under it is more than
:data:`SLOWER` times the model cap's time (too small: latency), or its largest bucket buffer is
more than :data:`LARGER` times the model cap's and at least :data:`FLOOR` bytes larger (too
large: memory for at most 5% of the time). ``shardlang plan`` and ``shardlang suggest`` warn
so; ``--bucket-bytes auto`` (``bucket_bytes=AUTO`` in :func:`planner.spec_plan.plan_spec`,
:func:`plan_step_with_model_cap` for a step plan) takes the model's cap.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from planner.cost import CostModel
from planner.legs import STAGES, Leg, StepTensor, rounds_price, stage_rounds
from planner.step import StepPlan, bucketed_step, step_legs

AUTO = "auto"  # bucket_bytes: the cost model's cap
CAPS = tuple(2**k for k in range(20, 41))  # 1 MiB ... 1 TiB
UNCAPPED = 2**62  # bucket bytes: one bucket per collective kind
SLACK = 0.05
SLOWER = 1.25
LARGER = 4
FLOOR = 16 * 2**20


@attrs.frozen
class BucketCap:
    """A cap and what it gives: the step's modeled ``seconds`` and its largest bucket buffer
    (``buffer_bytes``, per rank), beside the step's ``best_seconds`` under buckets of any size."""

    bytes: int
    seconds: float
    buffer_bytes: int
    best_seconds: float


# What a cap gives a step: (modeled seconds, largest bucket buffer in bytes per rank).
Priced = Callable[[int], tuple[float, int]]


def choose_cap(price: Priced) -> BucketCap:
    """The smallest of :data:`CAPS` whose step time is within :data:`SLACK` of the uncapped
    step's (module docstring); ``price`` gives a cap's (seconds, largest buffer)."""
    best, _ = price(UNCAPPED)
    for cap in CAPS:
        seconds, buffer = price(cap)
        if seconds <= best * (1 + SLACK):
            return BucketCap(cap, seconds, buffer, best)
    seconds, buffer = price(CAPS[-1])
    return BucketCap(CAPS[-1], seconds, buffer, best)


def step_price(legs: Sequence[Leg], costs: Mapping[str, CostModel], *, overlap: bool = False) -> Priced:
    """A step plan's legs priced under a cap: its buckets' seconds (both stages) and the
    largest bucket buffer, as :func:`planner.step.plan_step` would cut them."""

    # The merge does not depend on the cap (planner.legs.Round): once, both stages in order.
    rounds = [r for stage in STAGES for r in stage_rounds(legs, stage, costs, reverse=overlap and stage == STAGES[0])]

    def price(cap: int) -> tuple[float, int]:
        return rounds_price(legs, rounds, costs, cap)

    return price


def step_bucket_cap(step: StepPlan, costs: Mapping[str, CostModel], *, overlap: bool = False) -> BucketCap:
    """The cost model's cap for ``step``'s legs (``costs``: each tensor's model by name)."""
    return choose_cap(step_price(step.legs, costs, overlap=overlap))


def plan_step_with_model_cap(
    tensors: Sequence[StepTensor],
    rank: int,
    *,
    overlap: bool = False,
    prefetch: bool = False,
    **options: Any,
) -> StepPlan:
    """:func:`planner.step.plan_step` (``options`` are its other keywords but ``bucket_bytes``)
    with the cost model's cap for these tensors."""
    legs = step_legs(tensors, rank, **options)
    names = tuple(t.name for t in tensors)
    return step_with_model_cap(legs, names, {t.name: t.cost for t in tensors}, rank, overlap=overlap, prefetch=prefetch)


def step_with_model_cap(
    legs: Sequence[Leg],
    names: tuple[str, ...],
    costs: Mapping[str, CostModel],
    rank: int,
    *,
    overlap: bool = False,
    prefetch: bool = False,
) -> StepPlan:
    """:func:`planner.step.bucketed_step` of given legs under the cost model's cap for them."""
    uncapped = bucketed_step(legs, names, costs, rank, UNCAPPED, overlap=overlap, prefetch=prefetch)
    cap = step_bucket_cap(uncapped, costs, overlap=overlap)
    return bucketed_step(legs, names, costs, rank, cap.bytes, overlap=overlap, prefetch=prefetch)


def far_from(in_use: tuple[float, int], model: BucketCap) -> str | None:
    """How a cap in use, of ``in_use`` (seconds, largest buffer), is far from the model's
    (module docstring): ``"slower"``, ``"larger"``, or ``None`` where it is not."""
    seconds, buffer = in_use
    if seconds > SLOWER * model.seconds:
        return "slower"
    if buffer > LARGER * model.buffer_bytes and buffer - model.buffer_bytes >= FLOOR:
        return "larger"
    return None
