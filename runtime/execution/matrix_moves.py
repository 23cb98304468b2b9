"""Running the matrices' moves of a step plan (``planner.matrices``) on one rank, bucket by
bucket as planned, by the step plan's bucket runner (``runtime.execution.buckets.StageRun``):
the matrix plan is compiled as a step program whose first stage is the moves to the iteration
and whose second the moves back. To the iteration: the collective buckets first (the joins of
flat chunks and the gathers), then each exchange bucket (``runtime.execution.run.Exchange``: one
message per peer for all its members, posted in one ``batch_isend_irecv``). A matrix's legs of
one stage run in order, each from the previous one's result (a joined block moves to its
owner). Back from the iteration: the exchange buckets again, from the owners' results.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh

from planner.legs import AFTER, BEFORE
from planner.matrices import BACK, TO, MatrixPlan
from planner.step import StepPlan
from runtime.execution.buckets import StageRun
from runtime.execution.step_program import StepProgram, compile_step
from runtime.memory.buffers import Scratch
from shardlang.errors import ShardlangError


@attrs.frozen(eq=False)
class MatrixProgram:
    """A matrix plan compiled for one rank: its legs and buckets as a step program, the legs to
    the iteration its first stage (``BEFORE``), those back its second (``AFTER``)."""

    plan: MatrixPlan
    rank: int
    steps: StepProgram


_STAGES = {TO: BEFORE, BACK: AFTER}


def compile_matrices(plan: MatrixPlan, rank: int) -> MatrixProgram:
    steps = StepPlan(
        rank=rank,
        tensors=tuple(m.name for m in plan.matrices),
        legs=tuple(attrs.evolve(leg, stage=_STAGES[leg.stage]) for leg in plan.legs),
        buckets=tuple(attrs.evolve(b, stage=_STAGES[b.stage]) for b in plan.buckets),
        bucket_bytes=1,
    )
    return MatrixProgram(plan, rank, compile_step(steps, rank))


Pieces = dict[str, torch.Tensor | None]


def run_matrix_stage(
    program: MatrixProgram,
    stage: str,
    inputs: Mapping[str, torch.Tensor | None],
    *,
    device: torch.device,
    device_meshes: Mapping[str, DeviceMesh | None],
    timeout: datetime.timedelta,
    buffers: Scratch,
) -> Pieces:
    """Every matrix's legs of ``stage`` (:data:`~planner.matrices.TO` or ``BACK``) from its
    input (``None`` on a rank that holds none of it: not the owner, back from the iteration):
    per matrix with legs in the stage, its piece after them (``None`` where this rank gets
    none: a non-owner, to the iteration). Results of collective buckets are views of
    ``buffers``, valid until the next run."""
    plan = program.plan
    chains = {m.name: [i for i in m.legs if plan.legs[i].stage == stage] for m in plan.matrices}
    run = StageRun(
        program.steps, _STAGES[stage], device_meshes=device_meshes, timeout=timeout, buffers=buffers, device=device
    )
    try:
        run.feed({chain[0]: inputs[name] for name, chain in chains.items() if chain})
        # A leg after another of its matrix (a joined block to its owner) starts from its result.
        for k in range(1, max((len(chain) for chain in chains.values()), default=0)):
            later = {chain[k]: chain[k - 1] for chain in chains.values() if len(chain) > k}
            done = run.wait_for(list(later.values()))
            run.feed({leg: done[before] for leg, before in later.items()})
        done = run.finish()
    except ShardlangError:
        run.drain()
        raise
    return {name: done[chain[-1]] for name, chain in chains.items() if chain}
