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

Memory: a bucket allocates its send buffer and its result; the send buffer is released when
the collective returns. Results are views of bucket results or of the inputs (a leg that never
communicates returns a view of its input): callers copy what they keep.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from planner.step import Bucket, Leg, StepPlan
from runtime import stats
from runtime.blocks import piece_shape
from runtime.comm import collective
from runtime.dtypes import dtype_name
from runtime.errors import DistributedError, ReshardError
from runtime.exchange import Exchange
from runtime.groups import group_for
from runtime.program import Move, bytes_sent, compile_plan
from shardlang.dtypes import ITEMSIZE


class _Walk:
    """Where one leg is: its current piece, and the next step (hop ``h``, step ``k``)."""

    __slots__ = ("h", "k", "leg", "moves", "viewed", "x")

    def __init__(self, leg: Leg, x: torch.Tensor, rank: int) -> None:
        self.leg, self.x, self.h, self.k, self.viewed = leg, x, 0, 0, False
        self.moves = [compile_plan(hop.plan, rank) for hop in leg.hops]
        source = leg.hops[0].plan
        want = piece_shape(source.src.rank_piece(source.shape, rank))
        if tuple(x.shape) != want or dtype_name(x.dtype) != leg.dtype:
            raise ReshardError(
                f"{leg.what} of tensor '{leg.tensor}': rank {rank} holds a piece of {dtype_name(x.dtype)} "
                f"{list(x.shape)}, but '{source.src}' gives it {leg.dtype} {list(want)} of {list(source.shape)}"
            )

    def advance(self, until: tuple[int, int] | None = None) -> Move:
        """Run the local steps up to the communicating step ``until`` (to the end when
        ``None``); returns the move of ``until``."""
        while self.h < len(self.leg.hops):
            hop = self.leg.hops[self.h]
            if not self.viewed:
                if hop.view is not None:
                    self.x = self.x.reshape(hop.view)
                self.viewed = True
            if self.k == len(hop.plan.steps):
                self.h, self.k, self.viewed = self.h + 1, 0, False
                continue
            move = self.moves[self.h][self.k]
            if not isinstance(move, Move):
                what = "a point-to-point step" if isinstance(move, Exchange) else "a step on a mesh without this rank"
                raise ReshardError(f"{self.leg.what} of tensor '{self.leg.tensor}' has {what}: not run in a step plan")
            if (self.h, self.k) == until:
                return move
            if not move.is_local:
                raise ReshardError(f"{self.leg.what} of tensor '{self.leg.tensor}' reached a collective out of order")
            self.x = move.local(self.x)
            self.k += 1
        if until is not None:
            raise ReshardError(f"{self.leg.what} of tensor '{self.leg.tensor}' has no step {until}")
        return None  # type: ignore[return-value]


def run_stage(
    step_plan: StepPlan,
    stage: str,
    inputs: Mapping[int, torch.Tensor],
    *,
    rank: int,
    device_meshes: Mapping[str, DeviceMesh | None],
    timeout: datetime.timedelta,
) -> dict[int, torch.Tensor]:
    """Every leg of ``stage`` (keys of ``inputs``: indices into ``step_plan.legs``) run from
    its input to its piece in the leg's target layout. ``device_meshes`` gives a tensor's
    DeviceMesh whose groups to use (a DTensor's), by name. Raises :class:`DistributedError`
    naming the bucket when its collective fails."""
    walks = {i: _Walk(step_plan.legs[i], x, rank) for i, x in inputs.items()}
    for index, bucket in enumerate(step_plan.buckets):
        if bucket.stage == stage:
            _run_bucket(step_plan, index, bucket, walks, rank, device_meshes, timeout)
    for walk in walks.values():
        walk.advance()
    return {i: walk.x for i, walk in walks.items()}


def _run_bucket(
    step_plan: StepPlan,
    index: int,
    bucket: Bucket,
    walks: Mapping[int, _Walk],
    rank: int,
    device_meshes: Mapping[str, DeviceMesh | None],
    timeout: datetime.timedelta,
) -> None:
    moves = [walks[m.leg].advance((m.hop, m.step)) for m in bucket.members]
    first = moves[0]
    n, op = first.n, bucket.op
    chunks = [move.chunk for move in moves]
    total = sum(chunks)
    device = walks[bucket.members[0].leg].x.device
    dtype = walks[bucket.members[0].leg].x.dtype
    per_peer = op in ("reduce_scatter", "all_to_all")
    send = torch.empty((n, total) if per_peer else (total,), dtype=dtype, device=device)
    offsets = []
    offset = 0
    for member, move, chunk in zip(bucket.members, moves, chunks, strict=True):
        part = send[:, offset : offset + chunk] if per_peer else send[offset : offset + chunk]
        move.send_into(walks[member.leg].x, part)
        walks[member.leg].x = None  # type: ignore[assignment]  # the piece is in the buffer now
        offsets.append(offset)
        offset += chunk
    names = [walks[m.leg].leg.tensor for m in bucket.members]
    started = time.perf_counter()
    try:
        group = group_for(bucket.mesh, (first.step.axis,), first.members, device_meshes.get(names[0]), timeout=timeout)
        received = collective(op, send.view(-1), n, bucket.reduce_op, group, timeout)
    except (DistributedError, ReshardError) as e:
        raise type(e)(
            f"bucket {index + 1} of {len(step_plan.buckets)} ({_describe(bucket, names)}) failed: {e.message}"
        ) from e
    del send
    if stats.is_recording():
        itemsize = ITEMSIZE[bucket.dtype]
        stats.record(
            stats.CommRecord(
                tensor=",".join(names),
                step=index,
                op=op,
                axis=first.step.axis,
                ranks=first.members,
                bytes_sent=sum(bytes_sent(move, itemsize) for move in moves),
                planned_bytes=bucket.bytes,
                seconds=time.perf_counter() - started,
            )
        )
    gathered = received.view(n, total) if op in ("all_gather", "all_to_all") else received
    for member, move, chunk, start in zip(bucket.members, moves, chunks, offsets, strict=True):
        walk = walks[member.leg]
        part = gathered[:, start : start + chunk] if gathered.dim() == 2 else gathered[start : start + chunk]
        walk.x = move.finish(part)
        walk.k += 1


def _describe(bucket: Bucket, names: Sequence[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{bucket.describe()} of {shown}"
