"""Running a stage of a step plan (``planner.step``): one collective per bucket.

Every leg of the stage starts from the rank's piece of its tensor and walks its hops' steps in
order; local steps (slice, partial, an axis of one rank) run on the leg alone, and each
communicating step waits for its bucket. A bucket's buffer is laid out peer-major: for a
reduce_scatter or all_to_all over ``n`` ranks it is ``[n, sum of chunks]``, row ``p`` holding
every member's block for peer ``p`` one after another; for an all_gather or all_reduce it is
the members' pieces one after another. Each member packs its (padded) blocks straight into its
columns (``Move.send_into``: the same padding as an unbucketed reshard, so uneven, empty and
nested pieces stay exact), the collective runs once, and each member's result is a view of its
columns (``Move.finish``). Ranks of one group hold the same chunk sizes (``runtime.program``),
so their buffers agree.

Memory: with ``buffers`` (a :class:`~runtime.buffers.Scratch` kept by the caller between steps)
the buckets share one send buffer (the largest bucket's, and the all_to_all space of gloo's
reduce_scatter), and each bucket keeps its result buffer (read after later buckets have run).
Without it every bucket allocates both. Results are views of bucket results or of the inputs (a
leg that never communicates returns a view of its input), valid until the next run with the
same ``buffers``: callers copy what they keep.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping, Sequence

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh

from planner.step import AFTER, BEFORE, Bucket, Leg, StepPlan
from runtime import stats
from runtime.blocks import piece_shape
from runtime.buffers import Scratch
from runtime.comm import collective
from runtime.dtypes import dtype_name
from runtime.errors import DistributedError, ReshardError
from runtime.exchange import Exchange
from runtime.groups import group_for
from runtime.program import Move, bytes_sent, compile_plan
from shardlang.dtypes import ITEMSIZE


@attrs.frozen(eq=False)
class _LegProgram:
    """A leg as one rank runs it: its moves per hop, and the shape of the piece it starts from."""

    leg: Leg
    moves: tuple[tuple[Move | Exchange | None, ...], ...]
    source_shape: tuple[int, ...]


@attrs.frozen(eq=False)
class _BucketProgram:
    """A bucket as one rank runs it: per member its leg, move, chunk and offset in each peer's
    part of the buffer, and the buffer's per-peer length."""

    index: int
    bucket: Bucket
    members: tuple[tuple[int, Move, int, int], ...]  # (leg, move, chunk, offset)
    total: int
    per_peer: bool  # the send buffer has one row per peer (reduce_scatter, all_to_all)
    # Where its result (and gloo's reduce_scatter workspace) lie in the kept buffer of its
    # dtype: (offset, elements); see :func:`_lay_out`.
    result: tuple[int, int] = (0, 0)
    workspace: tuple[int, int] | None = None

    @property
    def send_numel(self) -> int:
        """Elements of the send buffer: a row per peer of ``total``, or one row."""
        return (self.members[0][1].n if self.per_peer else 1) * self.total


@attrs.frozen(eq=False)
class StepProgram:
    """A step plan compiled for one rank: built once per plan, as ``compile_plan`` is for a
    plan, so that the step itself only moves data."""

    plan: StepPlan
    rank: int
    legs: tuple[_LegProgram, ...]
    buckets: tuple[_BucketProgram, ...]
    # Per wire dtype: elements of the shared send buffer and of the kept buffer.
    send_numel: Mapping[str, int] = attrs.field(factory=dict)
    kept_numel: Mapping[str, int] = attrs.field(factory=dict)


def compile_step(plan: StepPlan, rank: int) -> StepProgram:
    """``rank``'s part of every leg and bucket of ``plan``."""
    legs = []
    for leg in plan.legs:
        source = leg.hops[0].plan
        legs.append(
            _LegProgram(
                leg=leg,
                moves=tuple(compile_plan(hop.plan, rank) for hop in leg.hops),
                source_shape=piece_shape(source.src.rank_piece(source.shape, rank)),
            )
        )
    buckets = []
    for index, bucket in enumerate(plan.buckets):
        members, offset = [], 0
        for m in bucket.members:
            move = legs[m.leg].moves[m.hop][m.step]
            if not isinstance(move, Move):
                what = "a point-to-point step" if isinstance(move, Exchange) else "a step on a mesh without this rank"
                leg = plan.legs[m.leg]
                raise ReshardError(f"{leg.what} of tensor '{leg.tensor}' has {what}: not run in a step plan")
            members.append((m.leg, move, move.chunk, offset))
            offset += move.chunk
        per_peer = bucket.op in ("reduce_scatter", "all_to_all")
        buckets.append(_BucketProgram(index, bucket, tuple(members), offset, per_peer))
    laid, send_numel, kept_numel = _lay_out(buckets)
    return StepProgram(plan, rank, tuple(legs), tuple(laid), send_numel, kept_numel)


def _lay_out(buckets: Sequence[_BucketProgram]) -> tuple[list[_BucketProgram], dict[str, int], dict[str, int]]:
    """Place every bucket's buffers, per wire dtype: one send buffer shared by all (free again
    once its collective returns), and one kept buffer holding, in order, the results of the
    buckets before the update (read by the math), then those after it (read at the commit).
    A gloo reduce_scatter's all_to_all workspace is only alive during its collective, before the
    update, so it shares the space of the later results.

    E.g. ZeRO-2 on 4 ranks, buckets of ``T`` elements per rank: the reduce_scatter's result
    takes ``[0, T)``, its workspace ``[T, 5T)``, the all_gather's result ``[T, 5T)`` too; the
    kept buffer has ``5T`` elements and the send buffer ``4T``."""
    laid: list[_BucketProgram] = []
    send: dict[str, int] = {}
    kept: dict[str, int] = {}
    for dtype in dict.fromkeys(b.bucket.dtype for b in buckets):
        mine = [b for b in buckets if b.bucket.dtype == dtype]
        offset, places = 0, {}
        for stage in (BEFORE, AFTER):
            for b in mine:
                if b.bucket.stage == stage:
                    n = b.members[0][1].n
                    numel = n * b.total if b.bucket.op in ("all_gather", "all_to_all") else b.total
                    places[b.index] = (offset, numel)
                    offset += numel
            if stage == BEFORE:
                later = offset
        end = offset
        for b in mine:
            workspace = None
            if b.bucket.op == "reduce_scatter":
                start = later if b.bucket.stage == BEFORE else offset
                workspace = (start, b.send_numel)
                end = max(end, start + b.send_numel)
            laid.append(attrs.evolve(b, result=places[b.index], workspace=workspace))
        send[dtype] = max((b.send_numel for b in mine if b.bucket.op != "all_reduce"), default=0)
        kept[dtype] = end
    laid.sort(key=lambda b: b.index)
    return laid, send, kept


class _Walk:
    """Where one leg is: its current piece, and the next step (hop ``h``, step ``k``)."""

    __slots__ = ("h", "k", "leg", "moves", "viewed", "x")

    def __init__(self, program: _LegProgram, x: torch.Tensor, rank: int) -> None:
        leg = self.leg = program.leg
        self.x, self.h, self.k, self.viewed, self.moves = x, 0, 0, False, program.moves
        if tuple(x.shape) != program.source_shape or dtype_name(x.dtype) != leg.dtype:
            source = leg.hops[0].plan
            raise ReshardError(
                f"{leg.what} of tensor '{leg.tensor}': rank {rank} holds a piece of {dtype_name(x.dtype)} "
                f"{list(x.shape)}, but '{source.src}' gives it {leg.dtype} {list(program.source_shape)} "
                f"of {list(source.shape)}"
            )

    def advance(self, until: tuple[int, int] | None = None) -> None:
        """Run the local steps up to the communicating step ``until`` (to the end when ``None``)."""
        while self.h < len(self.leg.hops):
            hop = self.leg.hops[self.h]
            if not self.viewed:
                if hop.view is not None:
                    self.x = self.x.reshape(hop.view)
                self.viewed = True
            if self.k == len(hop.plan.steps):
                self.h, self.k, self.viewed = self.h + 1, 0, False
                continue
            if (self.h, self.k) == until:
                return
            move = self.moves[self.h][self.k]
            if not isinstance(move, Move) or not move.is_local:
                raise ReshardError(f"{self.leg.what} of tensor '{self.leg.tensor}' reached a collective out of order")
            self.x = move.local(self.x)
            self.k += 1
        if until is not None:
            raise ReshardError(f"{self.leg.what} of tensor '{self.leg.tensor}' has no step {until}")


def run_stage(
    program: StepProgram,
    stage: str,
    inputs: Mapping[int, torch.Tensor],
    *,
    device_meshes: Mapping[str, DeviceMesh | None],
    timeout: datetime.timedelta,
    buffers: Scratch | None = None,
) -> dict[int, torch.Tensor]:
    """Every leg of ``stage`` (keys of ``inputs``: indices into the plan's legs) run from its
    input to its piece in the leg's target layout. ``device_meshes`` gives a tensor's
    DeviceMesh whose groups to use (a DTensor's), by name. Raises :class:`DistributedError`
    naming the bucket when its collective fails; nothing is sent before every input has been
    checked."""
    walks = {i: _Walk(program.legs[i], x, program.rank) for i, x in inputs.items()}
    for bucket in program.buckets:
        if bucket.bucket.stage == stage:
            _run_bucket(program, bucket, walks, device_meshes, timeout, buffers)
    for walk in walks.values():
        walk.advance()
    return {i: walk.x for i, walk in walks.items()}


def _run_bucket(
    program: StepProgram,
    bucket: _BucketProgram,
    walks: Mapping[int, _Walk],
    device_meshes: Mapping[str, DeviceMesh | None],
    timeout: datetime.timedelta,
    buffers: Scratch | None,
) -> None:
    plan = program.plan
    first_leg, first, _, _ = bucket.members[0]
    n, op, total = first.n, bucket.bucket.op, bucket.total
    sample = walks[first_leg].x
    shape = (n, total) if bucket.per_peer else (total,)
    out = workspace = None
    if buffers is None:
        send = torch.empty(shape, dtype=sample.dtype, device=sample.device)
    else:
        dtype = bucket.bucket.dtype
        kept = buffers.take("kept", program.kept_numel[dtype], sample.dtype, sample.device)
        start, numel = bucket.result
        out = kept[start : start + numel]
        if op == "all_reduce":  # reduces in place: its send buffer is its result
            send = out.view(shape)
        else:
            send = buffers.take("send", program.send_numel[dtype], sample.dtype, sample.device)
            send = send[: bucket.send_numel].view(shape)
        if bucket.workspace is not None:
            workspace = kept[bucket.workspace[0] : bucket.workspace[0] + bucket.workspace[1]]
    for m, (leg, move, chunk, offset) in zip(bucket.bucket.members, bucket.members, strict=True):
        walk = walks[leg]
        walk.advance((m.hop, m.step))
        move.send_into(walk.x, send[:, offset : offset + chunk] if bucket.per_peer else send[offset : offset + chunk])
        walk.x = None  # type: ignore[assignment]  # the piece is in the buffer now
    names = [plan.legs[leg].tensor for leg, *_ in bucket.members]
    started = time.perf_counter()
    try:
        group = group_for(
            bucket.bucket.mesh, (first.step.axis,), first.members, device_meshes.get(names[0]), timeout=timeout
        )
        received = collective(
            op, send.view(-1), n, bucket.bucket.reduce_op, group, timeout, out=out, workspace=workspace
        )
    except (DistributedError, ReshardError) as e:
        where = f"bucket {bucket.index + 1} of {len(plan.buckets)} ({_describe(bucket.bucket, names)})"
        raise type(e)(f"{where} failed: {e.message}") from e
    del send
    if stats.is_recording():
        itemsize = ITEMSIZE[bucket.bucket.dtype]
        stats.record(
            stats.CommRecord(
                tensor=",".join(names),
                step=bucket.index,
                op=op,
                axis=first.step.axis,
                ranks=first.members,
                bytes_sent=sum(bytes_sent(move, itemsize) for _, move, _, _ in bucket.members),
                planned_bytes=bucket.bucket.bytes,
                seconds=time.perf_counter() - started,
            )
        )
    rows = op in ("all_gather", "all_to_all")
    gathered = received.view(n, total) if rows else received
    for leg, move, chunk, offset in bucket.members:
        walk = walks[leg]
        walk.x = move.finish(gathered[:, offset : offset + chunk] if rows else gathered[offset : offset + chunk])
        walk.k += 1


def _describe(bucket: Bucket, names: Sequence[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{bucket.describe()} of {shown}"
