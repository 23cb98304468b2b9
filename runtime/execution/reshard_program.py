"""A reshard's plan compiled for one rank as a step program of one leg, so that
``runtime.execution.buckets.StageRun`` runs it as it runs an optimizer step's buckets (one
driver of moves: docs/design.md, "One executor").

The leg is the plan itself (one hop, no view); every communicating step the rank takes part in
(every one of its mesh, and every point-to-point step) is a bucket of its own,
run in ``step()`` order (one at a time), so a reshard's collectives, their padding and their
buffers are the ones a step's bucket of that one member has (``runtime.execution.names.ReshardNames``
names them as the plan's steps).
"""

from __future__ import annotations

import attrs

from planner.legs import BEFORE, Bucket, Hop, Leg, Member
from planner.plans import Plan
from planner.step import StepPlan
from runtime.execution.step_program import StepProgram, compile_step

# The leg's tensor name: a reshard's program is shared by every call of its plan, whatever
# name the call gives (``ReshardNames`` names it per call).
_TENSOR = "reshard"


def compile_reshard(plan: Plan, rank: int) -> StepProgram:
    """``rank``'s program of ``plan``: one leg, one bucket per communicating step (cached per
    plan and rank by the executor, so a training loop compiles once)."""
    leg = Leg(tensor=_TENSOR, what="reshard", stage=BEFORE, dtype=plan.dtype, hops=(Hop(plan),))
    buckets = tuple(
        Bucket(
            stage=BEFORE,
            op=step.op,
            mesh=step.layout.mesh,
            axis=step.axis,
            reduce_op=step.reduce_op,
            dtype=plan.dtype,
            members=(Member(0, 0, k),),
            bytes=step.bytes,
            buffer_bytes=step.bytes,
            seconds=step.seconds,
        )
        for _, k in leg.communicating
        for step in (plan.steps[k],)
        # A collective on a mesh without this rank is no bucket of its (its walk skips it).
        if step.op == "point_to_point" or rank in step.layout.mesh.ranks
    )
    step_plan = StepPlan(rank=rank, tensors=(_TENSOR,), legs=(leg,), buckets=buckets, bucket_bytes=1)
    return _last_result_fresh(compile_step(step_plan, rank))


def _last_result_fresh(program: StepProgram) -> StepProgram:
    """``program`` with its last collective bucket's result left out of the kept buffer: the
    executor allocates it per call (``StageRun``'s ``fresh``), since it is what the reshard
    returns (kept, it would be copied out, one more copy and one more result held). The
    workspaces after it (``_lay_out`` puts those of the buckets run in ``step()`` after the
    results) move into its place."""
    last = next((b for b in reversed(program.buckets) if b.bucket.op != "point_to_point"), None)
    if last is None:
        return program
    start, numel = last.result
    buckets, kept = [], 0
    for b in program.buckets:
        if b.workspace is not None and b.workspace[0] == start + numel:
            b = attrs.evolve(b, workspace=(start, b.workspace[1]))
        if b is not last and b.bucket.op != "point_to_point":
            kept = max(kept, sum(b.result), sum(b.workspace or (0, 0)))
        elif b.workspace is not None:
            kept = max(kept, sum(b.workspace))
        buckets.append(b)
    return attrs.evolve(program, buckets=tuple(buckets), kept_numel={last.bucket.dtype: kept})


def fresh_bucket(program: StepProgram) -> frozenset[int]:
    """The bucket whose result a reshard's run allocates (:func:`_last_result_fresh`)."""
    last = next((b for b in reversed(program.buckets) if b.bucket.op != "point_to_point"), None)
    return frozenset() if last is None else frozenset((last.index,))
