"""Where a step plan's bucket buffers lie on one rank, and how many bytes they take: the one home
of that sizing, for the runtime (``runtime.execution.step_program`` places its buckets with
:func:`lay_out`) and for the planner's memory predictions (:func:`step_buffer_bytes`), so that
the two cannot differ (docs/memory.md).

A bucket is described by :class:`BucketUse`: its collective, stage, launch, wire dtype, the
size ``n`` of its axis and ``total``, the elements per peer of its members' chunks. A collective
bucket's buffer is peer-major: ``[n, total]`` for a reduce_scatter or all_to_all, ``[total]``
for an all_reduce, and an all_gather's result ``[n, total]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from planner.legs import AFTER, AFTER_STEP, BEFORE, DURING_BACKWARD, IN_STEP, Bucket, Leg, Round
from planner.step import StepPlan
from shardlang.dtypes import itemsize

# Buckets launched during backward that may be in flight at once: a hook that would start one
# more first waits for the oldest (as FSDP2 bounds its reduce-scatters in flight), so their
# buffers are a few buckets', not the model's (docs/memory.md).
IN_FLIGHT = 2


@attrs.frozen
class BucketUse:
    """What of a bucket sizes its buffers on one rank (module doc)."""

    index: int
    op: str
    stage: str
    launch: str
    dtype: str
    n: int
    total: int

    @property
    def send_numel(self) -> int:
        """Elements of the send buffer: a row per peer of ``total`` (reduce_scatter,
        all_to_all), or one row."""
        return (self.n if self.op in ("reduce_scatter", "all_to_all") else 1) * self.total


@attrs.frozen
class Place:
    """Where a bucket's buffers lie in the kept and send buffers of its dtype: its result and
    gloo's reduce_scatter workspace as (offset, elements), its send buffer's offset."""

    result: tuple[int, int] = (0, 0)
    workspace: tuple[int, int] | None = None
    send: int = 0


@attrs.frozen
class Layout:
    """Every bucket's :class:`Place` (by index), and per wire dtype the elements of the shared
    send buffer and of the kept buffer."""

    places: dict[int, Place]
    send_numel: dict[str, int]
    kept_numel: dict[str, int]

    @property
    def nbytes(self) -> int:
        """Bytes of the kept and send buffers together."""
        return sum(n * itemsize(d) for numel in (self.kept_numel, self.send_numel) for d, n in numel.items())


def lay_out(buckets: Sequence[BucketUse], *, shared_after: bool = False) -> Layout:
    """Place every bucket's buffers, per wire dtype: send buffers, and one kept buffer holding,
    in order, the results of the buckets before the update (read by the math), then those after
    it (read at the commit). A gloo reduce_scatter's all_to_all workspace is alive only while its
    collective runs, before the update, so it shares the space of the later results.

    An all_gather sends from its own row of its result (in place: ``runtime.comm.collectives``), an
    all_reduce reduces its result in place, so neither takes send space. Buckets launched in
    ``step()`` run one at a time: they share one send buffer (the largest bucket's) and one
    workspace. Buckets launched during backward or after the step are in
    flight together, so each gets its own send region and workspace; the two stages never are
    (the gathers after a step are waited on before the next backward), so their send regions
    share one buffer.

    E.g. ZeRO-2 on 4 ranks, buckets of ``T`` elements per rank run in ``step()``: the
    reduce_scatter's result takes ``[0, T)``, its workspace ``[T, 5T)``, the all_gather's
    result ``[T, 5T)`` too, its send buffer its row ``[T + rT, T + (r+1)T)`` there on rank ``r``;
    the kept buffer has ``5T`` elements and the send buffer ``4T``.
    Launched during backward, buckets are in flight together, at most :data:`IN_FLIGHT` of them:
    they take that many slots of send space and workspace in turn, so that the stage holds a
    few buckets' buffers, not the model's. Two such reduce_scatters take the send regions
    ``[0, 4T)`` and ``[4T, 8T)`` and the workspaces ``[2T, 6T)`` and ``[6T, 10T)`` of the kept
    buffer; a third takes the first ones again, once the first bucket has landed. Launched after
    the step (gathers waited on by forward), each bucket has regions of its own.

    ``shared_after``: the buckets after the update launched in ``step()`` are written out as each
    lands (``StageRun``'s ``write_to``), so they all take the same region, the largest one's: the
    kept buffer is then the results before the update plus one bucket, not the whole model's
    gathered parameters. With ``k`` all_gather buckets of ``T`` per rank above, every one's result
    takes ``[T, 5T)``.

    Point-to-point buckets (exchanges) have no buffers of their own and are not placed."""
    places: dict[int, Place] = {}
    send: dict[str, int] = {}
    kept: dict[str, int] = {}
    for dtype in dict.fromkeys(b.dtype for b in buckets if b.op != "point_to_point"):
        mine = [b for b in buckets if b.dtype == dtype and b.op != "point_to_point"]
        offset, results, later = 0, {}, 0
        for stage in (BEFORE, AFTER):
            shared = 0  # the largest result of the buckets sharing one region (shared_after)
            for b in mine:
                if b.stage == stage:
                    numel = b.n * b.total if b.op in ("all_gather", "all_to_all") else b.total
                    if shared_after and stage == AFTER and b.launch == IN_STEP:
                        results[b.index] = (later, numel)
                        shared = max(shared, numel)
                        continue
                    results[b.index] = (offset + (shared if stage == AFTER else 0), numel)
                    offset += numel
            if stage == BEFORE:
                later = offset
            else:
                offset += shared
        end = offset
        workspace_at = {BEFORE: later, AFTER: offset}
        send_at = dict.fromkeys((BEFORE, AFTER), 0)
        send_numel = 0
        # Buckets launched during backward take IN_FLIGHT slots in turn, each of the largest one's
        # size (StageRun starts one only when the one before it in its slot has landed).
        ring = [b for b in mine if b.launch == DURING_BACKWARD]
        slot_numel = max((b.send_numel for b in ring), default=0)
        turn = {b.index: k % IN_FLIGHT for k, b in enumerate(ring)}
        for b in mine:
            workspace = None
            sent = 0
            if b.index in turn:
                at = turn[b.index] * slot_numel
                if b.op == "reduce_scatter":
                    workspace = (workspace_at[b.stage] + at, b.send_numel)
                    end = max(end, workspace_at[b.stage] + at + b.send_numel)
                if b.op not in ("all_reduce", "all_gather"):
                    sent = at
                    send_numel = max(send_numel, sent + b.send_numel)
                places[b.index] = Place(results[b.index], workspace, sent)
                continue
            together = b.launch == AFTER_STEP
            if b.op == "reduce_scatter":
                workspace = (workspace_at[b.stage], b.send_numel)
                end = max(end, workspace_at[b.stage] + b.send_numel)
                if together:
                    workspace_at[b.stage] += b.send_numel
            if b.op not in ("all_reduce", "all_gather"):
                sent = send_at[b.stage]
                send_numel = max(send_numel, sent + b.send_numel)
                if together:
                    send_at[b.stage] += b.send_numel
            places[b.index] = Place(results[b.index], workspace, sent)
        send[dtype] = send_numel
        kept[dtype] = end
    return Layout(places, send, kept)


def bucket_use(index: int, bucket: Bucket) -> BucketUse:
    """A step plan's bucket as :func:`lay_out` sizes it, from its planned buffer (the members'
    padded pieces, ``planner.legs``): what the rank at coordinate 0 of its group holds, and
    every rank where the pieces divide evenly (``runtime.execution.program`` pads a group to its
    own chunk, never more)."""
    n = None if bucket.axis is None else bucket.mesh.shape[bucket.axis]
    return _use(index, bucket.op, n, bucket.stage, bucket.launch, bucket.dtype, bucket.buffer_bytes)


def _use(index: int, op: str, n: int | None, stage: str, launch: str, dtype: str, buffer_bytes: int) -> BucketUse:
    """:func:`bucket_use` of a bucket of ``op`` on an axis of ``n`` ranks (``None``: no axis)."""
    if op == "point_to_point" or n is None:
        return BucketUse(index, "point_to_point", stage, launch, dtype, 1, 0)
    elements = buffer_bytes // itemsize(dtype)
    return BucketUse(index, op, stage, launch, dtype, n, elements if op == "all_reduce" else elements // n)


def shares_after(plan: StepPlan) -> bool:
    """Whether the buckets after the update may share one result region when the stage is
    written out as each bucket lands (:func:`lay_out`'s ``shared_after``): all of them launched
    in ``step()``, and every leg after the update communicating in at most one step, so that a
    bucket's results are final pieces and nothing of it is read once the next one starts."""
    launches = {b.launch for b in plan.buckets if b.stage == AFTER}
    return launches == {IN_STEP} and _after_in_one_step(plan.legs)


def _after_in_one_step(legs: Sequence[Leg]) -> bool:
    """Whether every leg after the update communicates in at most one step."""
    return all(len(leg.communicating) <= 1 for leg in legs if leg.stage == AFTER)


def step_buffer_bytes(plan: StepPlan, *, shared_after: bool = False) -> int:
    """Bytes of the kept and send buffers a rank holds to run ``plan`` (:func:`lay_out`), as
    ``memory_report()`` counts them."""
    return lay_out([bucket_use(i, b) for i, b in enumerate(plan.buckets)], shared_after=shared_after).nbytes


def rounds_buffer_bytes(legs: Sequence[Leg], rounds: Mapping[str, Sequence[Round]], cap: int) -> int:
    """:func:`step_buffer_bytes` of the step plan whose buckets ``cap`` cuts the stages' merged
    ``rounds`` into (``planner.legs.stage_rounds`` of ``legs``, before and after the update),
    every bucket launched in ``step()``, with :func:`shares_after`'s sharing; the buckets'
    sizes taken from the rounds, not from buckets built (suggest sizes every choice it times)."""
    uses = []
    for stage in (BEFORE, AFTER):
        for merged in rounds[stage]:
            for part in merged.cut(cap):
                leg, _, _, step, _ = part[0]
                n = None if step.axis is None else step.layout.mesh.shape[step.axis]
                buffer = sum(size for *_, size in part)
                uses.append(_use(len(uses), step.op, n, stage, IN_STEP, legs[leg].dtype, buffer))
    return lay_out(uses, shared_after=_after_in_one_step(legs)).nbytes
