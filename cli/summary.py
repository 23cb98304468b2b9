"""Whole-spec planning for display: the optimizer step of every tensor, with progress, and
tensors declared together with identical plans folded into one row (``h.{0..11}.mlp.c_fc.weight``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, TextIO

import attrs

from cli.terminal import Progress
from planner.spec_plan import SpecPlan, TensorPlans, plan_spec
from shardlang import Spec, TensorSpec


def plan_spec_with_progress(
    spec: Spec, stream: TextIO, *, tensors: Sequence[TensorSpec] | None = None, **options: Any
) -> SpecPlan:
    """:func:`planner.spec_plan.plan_spec` (``options`` are its keywords), with progress on a terminal."""
    chosen = spec.tensors if tensors is None else tuple(tensors)
    progress = Progress("planning", len(chosen), stream)
    try:
        return plan_spec(spec, tensors=chosen, on_tensor=lambda t: progress.advance(t.name), **options)
    finally:
        progress.close()


@attrs.frozen
class TensorGroup:
    """Tensors of one declaration with the same shape, dtype and layouts (so the same plans)."""

    members: tuple[TensorPlans, ...]

    @property
    def first(self) -> TensorPlans:
        return self.members[0]

    @property
    def count(self) -> int:
        return len(self.members)

    @property
    def label(self) -> str:
        return fold_names([m.tensor.name for m in self.members])

    @property
    def total_bytes(self) -> int:
        return sum(m.total_bytes for m in self.members)

    @property
    def total_seconds(self) -> float:
        return sum(m.total_seconds for m in self.members)


def group_tensors(spec_plan: SpecPlan) -> list[TensorGroup]:
    """Groups in declaration order; only neighbours from one declaration are folded."""

    def key(tp: TensorPlans) -> object:
        t = tp.tensor
        return (t.position, t.shape, t.dtype, t.layouts)

    return [TensorGroup(tuple(members)) for _, members in itertools.groupby(spec_plan.tensors, key=key)]


def largest_first(groups: list[TensorGroup]) -> list[TensorGroup]:
    return sorted(groups, key=lambda g: (-g.total_seconds, -g.total_bytes, g.first.tensor.name))


def fold_names(names: Sequence[str]) -> str:
    """``h.0.w, h.1.w, h.2.w`` -> ``h.{0..2}.w``; a set that is not a full product of dotted
    parts stays ``first (+N more)``."""
    if len(names) == 1:
        return names[0]
    split = [n.split(".") for n in names]
    if len({len(s) for s in split}) == 1:
        columns = [list(dict.fromkeys(part)) for part in zip(*split, strict=True)]
        product = 1
        for values in columns:
            product *= len(values)
        if product == len(set(names)) == len(names):
            return ".".join(_fold_part(values) for values in columns)
    return f"{names[0]} (+{len(names) - 1} more)"


def _fold_part(values: list[str]) -> str:
    if len(values) == 1:
        return values[0]
    if all(v.isdigit() and (v == "0" or not v.startswith("0")) for v in values):
        numbers = [int(v) for v in values]
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return f"{{{numbers[0]}..{numbers[-1]}}}"
    return "{" + ",".join(values) + "}"
