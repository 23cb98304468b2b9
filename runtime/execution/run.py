"""Running a rank's compiled moves (``runtime.execution.program``): the move logic every driver
shares (docs/design.md, "One executor").

:class:`LegWalk` is the one walker of a leg's moves: it runs the local steps (and a step
program's views between hops) up to the next communicating step, where its driver takes the
piece. One driver walks legs with it, the bucket runner (``runtime.execution.buckets.StageRun``),
which runs a bucket of many legs' moves as one collective or one :class:`Exchange`: an
optimizer step's buckets, Muon's matrix moves, and a reshard (its plan compiled as a program of
one leg, ``runtime.execution.reshard_program``), on torch.distributed or in the simulator
(``runtime.execution.simulate``), so the padding, trimming and packing the simulator checks are
the runtime's own.

An :class:`Exchange` is a bucket of point-to-point moves: one message per peer however many
members send to it (members in bucket order; both ends read the same plans, so they agree on
the message's layout). A reshard's exchange has one member; Muon's matrix moves bucket many.
:func:`start_exchange` posts one with torch.distributed, and :func:`start_move` starts a
collective bucket's, whose members all step as its first one does: every collective and
message of a compiled program is posted here, and what each sent is recorded by
:func:`record_traffic`.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh

from runtime.comm.collectives import PendingCollective, post_point_to_point, start_collective, wait_point_to_point
from runtime.comm.exchange import RankExchange
from runtime.comm.groups import group_for
from runtime.errors import ReshardError
from runtime.execution.program import CollectiveMove, bytes_sent
from runtime.measure import stats

# One entry of a leg's schedule (``runtime.execution.step_program.LegProgram``): the view its hop
# starts with (on the hop's first step), its move (``None``: a hop of no steps, or a step on a
# mesh without this rank) and whether that move is local.
Entry = tuple[tuple[int, ...] | None, CollectiveMove | RankExchange | None, bool]


class LegWalk:
    """Where one leg is in its schedule (a tuple of :data:`Entry`): its current piece ``x``, and
    ``i``, the entry it runs next; ``viewed``: that entry's view is applied already (the walk
    waits there for its communication). ``unpacking``: the leg's last move, a gather whose result
    ``x`` still holds as the blocks it received (a leg that ``runtime.execution.buckets``
    delivers straight into where it is kept); the walk is then at its end, any views after the
    gather left to its driver. ``flying``: its piece is in a communication in flight (``x`` may
    be ``None`` on a rank that holds none). ``label`` names the leg in errors (called only then).

    Its driver, ``runtime.execution.buckets.StageRun``, walks every leg (an optimizer step's, a
    reshard's one, Muon's matrices') up to the entries its buckets stop at.
    E.g. a ZeRO-2 gradient leg ``R,R | P(dp) -> S(dp),R`` has one entry, its reduce_scatter:
    the walk starts at ``i = 0``, its bucket packs ``x``, and the bucket's result makes ``x``
    the reduced piece and ``i = 1``, the end."""

    __slots__ = ("flying", "i", "label", "schedule", "unpacking", "viewed", "x")

    def __init__(self, schedule: tuple[Entry, ...], x: torch.Tensor | None, label: Callable[[], str]) -> None:
        self.schedule, self.x, self.label, self.i, self.viewed = schedule, x, label, 0, False
        self.unpacking: CollectiveMove | None = None
        self.flying = False  # its piece is in a communication in flight (until passed)

    def advance(self, until: int | None = None) -> None:
        """Run the local steps up to the schedule's entry ``until``, a communicating step, and
        apply its view (to the end when ``None``)."""
        schedule = self.schedule
        stop = len(schedule) if until is None else until
        while self.i < stop:
            view, move, local = schedule[self.i]
            if view is not None and not self.viewed and self.x is not None:
                self.x = self.x.reshape(view)
            if not local:
                raise ReshardError(f"{self.label()} reached a collective out of order")
            if move is not None:
                self.x = move.local(self.x)  # type: ignore[union-attr,arg-type]  # local: a CollectiveMove
            self.i, self.viewed = self.i + 1, False
        if until is not None:
            if self.i != until:
                raise ReshardError(f"{self.label()} has no step at entry {until}")
            view = schedule[until][0]
            if view is not None and not self.viewed and self.x is not None:
                self.x, self.viewed = self.x.reshape(view), True

    def skip_to(self, until: int | None, x: torch.Tensor) -> None:
        """Where :meth:`advance` from the walk's start would leave it, given the piece ``x``
        that it reached (from an earlier step of the same input: a driver's kept views)."""
        schedule = self.schedule
        self.x = x
        if until is None:
            self.i, self.viewed = len(schedule), False
        else:
            self.i, self.viewed = until, schedule[until][0] is not None

    def passed(self, x: torch.Tensor | None) -> None:
        """The communicating step the walk waited at has run and left the piece ``x``: go on to
        the next entry."""
        self.x, self.i, self.viewed, self.flying = x, self.i + 1, False, False

    def unpack_later(self, received: torch.Tensor, move: CollectiveMove) -> None:
        """The leg's last move, a gather, has run: keep its blocks (``received``) for the driver
        to unpack where the piece is kept, and go to the end, past any views after it."""
        self.x, self.unpacking, self.flying = received, move, False
        self.i, self.viewed = len(self.schedule), False


class Exchange:
    """One rank's part in a bucket of point-to-point moves, each member ``(move, x, out)``:
    its source piece (``None`` off the source mesh) and the target piece it fills (``None``
    off the target mesh). ``sends`` and ``receives`` are one flat message per peer, packed
    from the members' pieces (a message that is one contiguous box is sent from, or received
    into, the piece in place); :meth:`copy_local` copies the boxes the rank keeps, while the
    messages travel; :meth:`land` places what arrived."""

    __slots__ = ("_copies", "_placed", "receives", "sends")

    def __init__(self, members: Sequence[tuple[RankExchange, torch.Tensor | None, torch.Tensor | None]]) -> None:
        sends: dict[int, list[torch.Tensor]] = {}
        receives: dict[int, list[torch.Tensor]] = {}
        self._placed: list[tuple[RankExchange, torch.Tensor, list[tuple[int, torch.Tensor, bool]]]] = []
        self._copies: list[tuple[RankExchange, torch.Tensor, torch.Tensor]] = []
        for move, x, out in members:
            if move.sends:
                assert x is not None
                for peer, message in move.pack(x):
                    sends.setdefault(peer, []).append(message)
            if move.receives:
                assert out is not None
                buffers = move.receive_buffers(out)
                for peer, buffer, _ in buffers:
                    receives.setdefault(peer, []).append(buffer)
                self._placed.append((move, out, buffers))
            if move.copies:
                assert x is not None and out is not None
                self._copies.append((move, x, out))
        self.sends = [(peer, torch.cat(parts) if len(parts) > 1 else parts[0]) for peer, parts in sorted(sends.items())]
        self.receives = [(peer, _landing(parts), parts) for peer, parts in sorted(receives.items())]

    @property
    def peers(self) -> tuple[int, ...]:
        """The ranks this rank sends to or receives from."""
        return tuple(sorted({peer for peer, _ in self.sends} | {peer for peer, _, _ in self.receives}))

    @property
    def elements_sent(self) -> int:
        return sum(message.numel() for _, message in self.sends)

    def copy_local(self) -> None:
        for move, x, out in self._copies:
            move.copy_local(x, out)

    def land(self) -> None:
        """Cut every received message back into its members' buffers and place them."""
        for _, message, parts in self.receives:
            offset = 0
            for part in parts:
                if part.data_ptr() != message.data_ptr() + offset * message.element_size():
                    part.copy_(message[offset : offset + part.numel()])
                offset += part.numel()
        for move, out, buffers in self._placed:
            move.place(out, buffers)


class Started(Protocol):
    """A collective in flight: ``runtime.comm.collectives.PendingCollective``, or the
    simulator's emulation of one (``runtime.execution.simulate``)."""

    def wait(self, timeout: datetime.timedelta) -> torch.Tensor: ...


# How a driver starts a collective move: :func:`start_move`'s signature; and a bucket of
# point-to-point moves: :func:`start_exchange`'s.
StartMove = Callable[..., Started]
StartExchange = Callable[["Exchange"], Started]


def start_move(
    move: CollectiveMove,
    send: torch.Tensor,
    *,
    device_mesh: DeviceMesh | None,
    timeout: datetime.timedelta,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    waited_at_once: bool = False,
) -> PendingCollective:
    """Start the collective of ``move``'s step on its group (``runtime.comm.groups``, of
    ``device_mesh`` when given) from the flat buffer ``send``
    of a bucket, whose members all step as its first one does (``runtime.execution.buckets``).
    ``out``, ``workspace`` and ``waited_at_once`` as ``runtime.comm.collectives.start_collective``
    takes them. Raises ``DistributedError`` when the group or the collective fails."""
    step = move.step
    group = group_for(step.layout.mesh, (step.axis,), move.members, device_mesh, timeout=timeout)
    return start_collective(
        step.op,
        send,
        move.n,
        step.reduce_op,
        group,
        out=out,
        workspace=workspace,
        waited_at_once=waited_at_once,
    )


def record_traffic(
    moves: Sequence[CollectiveMove | RankExchange],
    *,
    tensor: str | None,
    step: int,
    itemsize: int,
    planned_bytes: int,
    started: float,
) -> None:
    """Record (``runtime.measure.stats``, while recording) one collective or point-to-point
    exchange this rank ran since ``started`` (``time.perf_counter()``): ``moves``, its members
    (a reshard's one move, a bucket's members, which all step as its first one does), sent
    ``bytes_sent`` of each (``runtime.execution.program``) with elements of ``itemsize`` bytes.
    An exchange in which this rank sends and receives nothing leaves no record."""
    if not stats.is_recording() or not moves:
        return
    first = moves[0]
    if isinstance(first, RankExchange):
        ranks = tuple(sorted({peer for move in moves for peer in move.peers}))  # type: ignore[union-attr]
        if not ranks:
            return
    else:
        ranks = first.members
    stats.record(
        stats.CommRecord(
            tensor=tensor,
            step=step,
            op=first.step.op,
            axis=first.step.axis,
            ranks=ranks,
            bytes_sent=sum(bytes_sent(move, itemsize) for move in moves),
            planned_bytes=planned_bytes,
            seconds=time.perf_counter() - started,
        )
    )


class ExchangeInFlight:
    """An :class:`Exchange` whose messages travel (:func:`start_exchange`): :meth:`wait` waits
    for them and places what arrived (``runtime.execution.run.Started``; its result is empty:
    the members' target pieces are filled)."""

    __slots__ = ("bucket", "works")

    def __init__(self, bucket: Exchange, works: list) -> None:
        self.bucket, self.works = bucket, works

    def wait(self, timeout: datetime.timedelta) -> torch.Tensor:
        wait_point_to_point(self.works, timeout)
        self.bucket.land()
        return _LANDED


_LANDED = torch.empty(0)


def start_exchange(bucket: Exchange) -> ExchangeInFlight:
    """Post every message of ``bucket`` with torch.distributed in one ``batch_isend_irecv`` and
    make the local copies while they travel. Raises ``DistributedError`` when posting fails."""
    works = post_point_to_point(bucket.sends, [(peer, message) for peer, message, _ in bucket.receives])
    bucket.copy_local()
    return ExchangeInFlight(bucket, works)


def _landing(parts: list[torch.Tensor]) -> torch.Tensor:
    """Where one peer's message lands: the one buffer itself, else a buffer the parts are cut from."""
    if len(parts) == 1:
        return parts[0]
    return parts[0].new_empty(sum(p.numel() for p in parts))
