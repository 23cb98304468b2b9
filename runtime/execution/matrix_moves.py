"""Running the matrices' moves of a step plan (``planner.matrices``) on one rank, bucket by
bucket as planned.

To the iteration: the collective buckets first (the joins of flat chunks and the gathers), run
by the step plan's bucket runner (``runtime.execution.buckets``, on a step plan of those legs alone); then each
exchange bucket, as the executor runs a reshard's point-to-point step
(``runtime.execution.run.Exchange``): one message per peer for all its members, every message
of the bucket posted in one ``batch_isend_irecv``. A matrix's legs of
one stage run in order, each from the previous one's result (a joined block moves to its
owner). Back from the iteration: the exchange buckets again, from the owners' results.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh

from planner.legs import BEFORE, Bucket
from planner.matrices import TO, MatrixPlan
from planner.step import StepPlan
from runtime.comm.exchange import RankExchange
from runtime.errors import DistributedError
from runtime.execution.buckets import run_stage
from runtime.execution.program import CollectiveMove, compile_plan
from runtime.execution.run import Exchange, Walk, exchange, record_traffic, walk
from runtime.execution.step_program import StepProgram, compile_step
from runtime.memory.buffers import Scratch
from runtime.memory.dtypes import torch_dtype
from shardlang.dtypes import ITEMSIZE


@attrs.frozen(eq=False)
class MatrixProgram:
    """A matrix plan compiled for one rank: its collective legs as a step program (``index``:
    the matrix plan's leg -> the program's), and every exchange leg's moves."""

    plan: MatrixPlan
    rank: int
    collectives: StepProgram
    index: Mapping[int, int]
    exchanges: Mapping[int, tuple[CollectiveMove | RankExchange | None, ...]]


def compile_matrices(plan: MatrixPlan, rank: int) -> MatrixProgram:
    exchange_buckets = [b for b in plan.buckets if b.op == "point_to_point"]
    exchanged = {m.leg for b in exchange_buckets for m in b.members}
    kept = [i for i in range(len(plan.legs)) if i not in exchanged]
    index = {leg: k for k, leg in enumerate(kept)}
    # The bucket runner runs (and lays out buffers for) a step's stages: the collective moves,
    # all to the iteration, run as a step plan's first stage.
    collective = StepPlan(
        rank=rank,
        tensors=tuple(m.name for m in plan.matrices),
        legs=tuple(attrs.evolve(plan.legs[i], stage=BEFORE) for i in kept),
        buckets=tuple(
            attrs.evolve(b, stage=BEFORE, members=tuple(attrs.evolve(m, leg=index[m.leg]) for m in b.members))
            for b in plan.buckets
            if b.op != "point_to_point"
        ),
        bucket_bytes=1,
    )
    exchanges = {i: compile_plan(plan.legs[i].hops[0].plan, rank) for i in sorted(exchanged)}
    return MatrixProgram(plan, rank, compile_step(collective, rank), index, exchanges)


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
    current: dict[int, torch.Tensor | None] = {}  # each leg's input, then its result
    for name, chain in chains.items():
        if chain:
            current[chain[0]] = inputs[name]
    if stage == TO:
        fed = {program.index[i]: x for i, x in current.items() if i in program.index and x is not None}
        if fed:
            done = run_stage(
                program.collectives, BEFORE, fed, device_meshes=device_meshes, timeout=timeout, buffers=buffers
            )
            back = {k: i for i, k in program.index.items()}
            for k, x in done.items():
                current[back[k]] = x
    for bucket in plan.buckets:
        if bucket.stage != stage or bucket.op != "point_to_point":
            continue
        for m in bucket.members:  # a leg after a collective leg of its matrix starts from its result
            if m.leg not in current:
                name = plan.legs[m.leg].tensor
                chain = chains[name]
                current[m.leg] = current[chain[chain.index(m.leg) - 1]]
        ran = _exchange(program, bucket, current, device, timeout)
        current.update(ran)
    return {name: current.get(chain[-1]) for name, chain in chains.items() if chain}


def _exchange(
    program: MatrixProgram,
    bucket: Bucket,
    inputs: Mapping[int, torch.Tensor | None],
    device: torch.device,
    timeout: datetime.timedelta,
) -> dict[int, torch.Tensor | None]:
    """One exchange bucket: every member's leg walked (``runtime.execution.run.walk``: the local
    steps around its point-to-point step), their point-to-point steps run as one
    :class:`~runtime.execution.run.Exchange`, one message per peer."""
    plan = program.plan
    started = time.perf_counter()
    outs: dict[int, torch.Tensor | None] = {}
    walks: dict[int, Walk] = {}
    posts = []
    for m in bucket.members:
        leg = plan.legs[m.leg]
        x, view = inputs[m.leg], leg.hops[0].view
        moves = walk(
            program.exchanges[m.leg],
            x if x is None or view is None else x.reshape(view),
            dtype=torch_dtype(leg.hops[0].plan.dtype),
            device=device,
        )
        try:
            post = next(moves)
        except StopIteration as done:  # this rank takes no part in the member's step
            outs[m.leg] = done.value
            continue
        assert isinstance(post[0], RankExchange)  # an exchange leg's other steps are local
        posts.append(post)
        walks[m.leg] = moves
    messages = Exchange(posts)  # type: ignore[arg-type]
    try:
        exchange(messages, timeout)
    except DistributedError as e:
        names = ", ".join(f"'{plan.legs[m.leg].tensor}'" for m in bucket.members)
        raise DistributedError(f"the exchange {bucket.stage} of {names} failed: {e.message}") from e
    for leg, moves in walks.items():
        try:
            moves.send(None)
        except StopIteration as done:
            outs[leg] = done.value
    record_traffic(
        [post[0] for post in posts],
        tensor=",".join(plan.legs[m.leg].tensor for m in bucket.members),
        step=plan.buckets.index(bucket),
        itemsize=ITEMSIZE[bucket.dtype],
        planned_bytes=bucket.bytes,
        started=started,
    )
    return outs
