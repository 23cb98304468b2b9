"""Measured communication: what each collective of a reshard really sent, per rank.

    with runtime.recording() as log:
        out = runtime.reshard(grad, src, dst, global_shape=shape, name="wte.grad")
    log.total_bytes, log.planned_bytes, len(log.records)

Only the calling rank's collectives are recorded (each rank keeps its own log); steps that
communicate nothing (slice, partial, a mesh axis of size 1) are not collectives and leave no
record. ``bytes_sent`` applies the cost model's formulas to the buffers the rank really
passed, so on the busiest rank (coordinate 0) it equals the plan's ``bytes`` and elsewhere
it is at most that (uneven pieces pad less).

A point-to-point step leaves one record (``op="point_to_point"``, ``axis=None``) on every
rank that sends or receives a message in it: ``ranks`` are its peers, ``bytes_sent`` the
boxes it sent to them (what it copies to itself is not sent and not counted), and
``planned_bytes`` the step's ``bytes`` (the largest per-rank max(sent, received)).

The sharded optimizers' statistics all-reduces (``runtime.optim.sums``) are recorded too
(``step=0``, ``tensor`` the owners' names joined by commas).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs

from shardlang.mesh import RankGroup


@attrs.frozen
class CommRecord:
    """One collective (or point-to-point step) of one reshard on the calling rank."""

    tensor: str | None
    step: int
    op: str
    axis: int | None
    ranks: RankGroup
    bytes_sent: int
    planned_bytes: int
    seconds: float


@attrs.define
class CommLog:
    records: list[CommRecord] = attrs.field(factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes_sent for r in self.records)

    @property
    def planned_bytes(self) -> int:
        return sum(r.planned_bytes for r in self.records)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.records)


_active: list[CommLog] = []


@contextlib.contextmanager
def recording() -> Iterator[CommLog]:
    """Record every collective the runtime runs in this block (logs may nest)."""
    log = CommLog()
    _active.append(log)
    try:
        yield log
    finally:
        _active.remove(log)


def record(entry: CommRecord) -> None:
    for log in _active:
        log.records.append(entry)


def is_recording() -> bool:
    return bool(_active)
