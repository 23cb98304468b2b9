"""Running the matrices' moves of a step plan (``planner.matrices``) on one rank, bucket by
bucket as planned, by the step plan's bucket runner (``runtime.execution.buckets.StageRun``).

The matrices are moved in *waves*: a wave is the matrices whose moves to the iteration share
a bucket (each bucket is bounded by the plan's byte cap), so that a rank holds one wave's whole
matrices at a time, not the model's (docs/memory.md). Each wave's moves to the iteration are
compiled as a step program of their own (its first stage): the collective buckets first (the
joins of flat chunks and the gathers), then each exchange bucket
(``runtime.execution.run.Exchange``: one message per peer for all its members, posted in one
``batch_isend_irecv``). A matrix's legs of one stage run in order, each from the previous one's
result (a joined block moves to its owner). The moves back from the iteration are the whole
plan's second stage, one run fed wave by wave: each exchange bucket back starts once its
members' results are given, in the plan's order on every rank.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh

from planner.legs import AFTER, BEFORE
from planner.matrices import BACK, TO, MatrixPlan
from planner.step import StepPlan
from runtime.execution.buckets import StageRun
from runtime.execution.step_program import StepProgram, compile_step
from runtime.memory.buffers import Scratch

_STAGES = {TO: BEFORE, BACK: AFTER}


@attrs.frozen(eq=False)
class Wave:
    """Matrices whose moves to the iteration share buckets: their names (in plan order), per
    name its legs to the iteration as indices into ``steps``' legs (in the order they run), and
    those legs and buckets compiled as a step program (its first stage)."""

    names: tuple[str, ...]
    chains: Mapping[str, tuple[int, ...]]
    steps: StepProgram


@attrs.frozen(eq=False)
class MatrixProgram:
    """A matrix plan compiled for one rank: its waves to the iteration, and all its legs and
    buckets as one step program whose second stage (``AFTER``) is the moves back."""

    plan: MatrixPlan
    rank: int
    steps: StepProgram
    waves: tuple[Wave, ...]


def compile_matrices(plan: MatrixPlan, rank: int) -> MatrixProgram:
    legs = tuple(attrs.evolve(leg, stage=_STAGES[leg.stage]) for leg in plan.legs)
    buckets = tuple(attrs.evolve(b, stage=_STAGES[b.stage]) for b in plan.buckets)
    names = tuple(m.name for m in plan.matrices)
    steps = StepPlan(rank=rank, tensors=names, legs=legs, buckets=buckets, bucket_bytes=1)
    waves = []
    for members in _waves(plan):
        to = [i for m in members for i in plan.matrices[m].legs if plan.legs[i].stage == TO]
        index = {leg: k for k, leg in enumerate(to)}
        mine = [
            attrs.evolve(b, members=tuple(attrs.evolve(x, leg=index[x.leg]) for x in b.members))
            for b in buckets
            if b.stage == BEFORE and b.members[0].leg in index
        ]
        wave_names = tuple(plan.matrices[m].name for m in members)
        wave_legs = tuple(legs[i] for i in to)
        wave = StepPlan(rank=rank, tensors=wave_names, legs=wave_legs, buckets=tuple(mine), bucket_bytes=1)
        chains = {plan.matrices[m].name: tuple(index[i] for i in plan.matrices[m].legs if i in index) for m in members}
        waves.append(Wave(wave_names, chains, compile_step(wave, rank)))
    return MatrixProgram(plan, rank, compile_step(steps, rank), tuple(waves))


def _waves(plan: MatrixPlan) -> list[list[int]]:
    """The matrices (indices, in plan order) joined by sharing a bucket to the iteration; the
    same on every rank (buckets' members are)."""
    matrix_of = {leg: k for k, m in enumerate(plan.matrices) for leg in m.legs}
    root = list(range(len(plan.matrices)))

    def find(k: int) -> int:
        while root[k] != k:
            k = root[k]
        return k

    for bucket in plan.buckets:
        if bucket.stage == TO:
            tops = {find(matrix_of[m.leg]) for m in bucket.members}
            for top in tops:
                root[top] = min(tops)
    waves: dict[int, list[int]] = {}
    for k in range(len(plan.matrices)):
        waves.setdefault(find(k), []).append(k)
    return sorted(waves.values())


Pieces = dict[str, torch.Tensor | None]


class MatrixRun:
    """One step's moves of a compiled matrix plan: :meth:`to_iteration` per wave (in order),
    :meth:`back` with the wave's results, then :meth:`finish` for the pieces back. After an
    error, :meth:`drain` waits out what is in flight."""

    def __init__(
        self,
        program: MatrixProgram,
        *,
        device: torch.device,
        device_meshes: Mapping[str, DeviceMesh | None],
        timeout: datetime.timedelta,
        buffers: Scratch,
    ) -> None:
        self.program = program
        self._run: Callable[[StepProgram, str], StageRun] = lambda steps, stage: StageRun(
            steps, stage, device_meshes=device_meshes, timeout=timeout, buffers=buffers, device=device
        )
        plan = program.plan
        self._back_leg = {m.name: i for m in plan.matrices for i in m.legs if plan.legs[i].stage == BACK}
        self._back = self._run(program.steps, AFTER)
        self._current: StageRun | None = None

    def to_iteration(self, wave: Wave, inputs: Mapping[str, torch.Tensor | None]) -> Pieces:
        """The wave's legs to the iteration from ``inputs`` (``None`` on a rank that holds none
        of a matrix): per matrix, the whole on a rank that iterates it, else ``None``. Results
        of collective buckets are views of the buffers, valid until the next wave."""
        run = self._current = self._run(wave.steps, BEFORE)
        chains = {name: chain for name, chain in wave.chains.items() if chain}
        run.feed({chain[0]: inputs[name] for name, chain in chains.items()})
        # A leg after another of its matrix (a joined block to its owner) starts from its result.
        for k in range(1, max((len(chain) for chain in chains.values()), default=0)):
            later = {chain[k]: chain[k - 1] for chain in chains.values() if len(chain) > k}
            done = run.wait_for(list(later.values()))
            run.feed({leg: done[before] for leg, before in later.items()})
        done = run.finish()
        self._current = None
        return {name: done[chain[-1]] for name, chain in chains.items()}

    def back(self, results: Mapping[str, torch.Tensor | None]) -> None:
        """Give the moves back their inputs (an owner's result, ``None`` on other ranks);
        each exchange bucket back starts once all its members have theirs."""
        self._back.feed({self._back_leg[name]: x for name, x in results.items()})

    def finish(self) -> Pieces:
        """Every owned matrix's piece of its result, moved back."""
        done = self._back.finish()
        return {name: done[leg] for name, leg in self._back_leg.items()}

    def drain(self) -> None:
        for run in (self._current, self._back):
            if run is not None:
                run.drain()
