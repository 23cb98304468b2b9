"""A reshard's plan compiled for one rank as a step program of one leg, so that
``runtime.execution.buckets.StageRun`` runs it as it runs an optimizer step's buckets (one
driver of moves: docs/design.md, "One executor").

The leg is the plan itself (one hop, no view); every communicating step the rank takes part in
(every one of its mesh, and every point-to-point step) is a bucket of its own,
run in ``step()`` order (one at a time), so a reshard's collectives and their padding are
the ones a step's bucket of that one member has (``runtime.execution.names.ReshardNames``
names them as the plan's steps). Its buffers are the move's own: ``StageRun`` runs the
program ``direct`` (sent from the piece where it can be, results allocated per call), so it
copies what the planner's copy table prices (``planner/copies.py``).
"""

from __future__ import annotations

from planner.legs import BEFORE, Hop, Leg, bucket_stage
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
    # The planner's bucket maker, on one leg: every communicating step a bucket of its own.
    made = bucket_stage((leg,), BEFORE, {_TENSOR: plan.cost}, cap=1, reverse=False)
    # A collective on a mesh without this rank is no bucket of its (its walk skips it).
    buckets = tuple(b for b in made if b.op == "point_to_point" or rank in b.mesh.ranks)
    step_plan = StepPlan(rank=rank, tensors=(_TENSOR,), legs=(leg,), buckets=buckets, bucket_bytes=1)
    return compile_step(step_plan, rank)
