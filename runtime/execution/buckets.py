"""Running a stage of a step program (``runtime.execution.step_program``): one collective per bucket.

Every leg of the stage starts from the rank's piece of its tensor and walks its hops' steps in
order; local steps (slice, partial, an axis of one rank) run on the leg alone, and each
communicating step waits for its bucket. Each member packs its (padded) blocks straight into its
columns of the bucket's buffer (``CollectiveMove.send_into``: the same padding as an unbucketed
reshard, so uneven, empty and nested pieces stay exact), the collective runs once, and each
member's result is a view of its columns (``CollectiveMove.finish``). A bucket of point-to-point
moves (Muon's matrices to and from their owners: ``runtime.execution.matrix_moves``) runs as one
``runtime.execution.run.Exchange``, one message per peer; there a leg may hold no piece on a
rank (``None``: off its source or target mesh).

Memory: with ``buffers`` (a :class:`~runtime.memory.buffers.Scratch` kept by the caller between steps)
the buckets use the kept and send buffers where the program lays them out
(``planner.buffers.lay_out``: one send buffer shared by the buckets of a stage run in
``step()``, a few slots of it for those started during backward, results in the kept buffer).
Without it every bucket allocates both. Results are views of bucket results or of the inputs (a
leg that never communicates returns a view of its input), valid until the next run with the
same ``buffers``: callers copy what they keep, or give ``write_to``.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
from collections.abc import Callable, KeysView, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from planner.buffers import IN_FLIGHT
from planner.legs import AFTER, DURING_BACKWARD, IN_STEP
from runtime.comm.exchange import RankExchange
from runtime.errors import DistributedError, ReshardError
from runtime.execution.names import Names, StepNames
from runtime.execution.program import CollectiveMove
from runtime.execution.ranges import profiled, profiling
from runtime.execution.run import (
    Exchange,
    LegWalk,
    Started,
    StartExchange,
    StartMove,
    record_traffic,
    start_exchange,
    start_move,
)
from runtime.execution.step_program import BucketProgram, StepProgram
from runtime.measure import stats
from runtime.memory.buffers import Scratch
from shardlang.dtypes import ITEMSIZE
from shardlang.errors import ShardlangError


def run_stage(
    program: StepProgram,
    stage: str,
    inputs: Mapping[int, torch.Tensor],
    *,
    device_meshes: Mapping[str, DeviceMesh | None],
    timeout: datetime.timedelta,
    buffers: Scratch | None = None,
    start: StartMove | None = None,
    exchange: StartExchange | None = None,
    direct: bool = False,
) -> dict[int, torch.Tensor | None]:
    """Every leg of ``stage`` (keys of ``inputs``: indices into the plan's legs) run from its
    input to its piece in the leg's target layout (:class:`StageRun`, given every input at
    once: nothing is sent before every input has been checked)."""
    run = StageRun(
        program,
        stage,
        device_meshes=device_meshes,
        timeout=timeout,
        buffers=buffers,
        start=start,
        exchange=exchange,
        direct=direct,
    )
    try:
        if direct:  # a reshard's one leg, run as the executor runs it
            return {0: run.run_one(inputs[0])}
        run.feed(inputs)
        return run.finish()
    except ShardlangError:
        run.drain()
        raise


class StageRun:
    """One stage of a step program, run as its inputs arrive: :meth:`feed` gives legs their
    inputs and starts, in the plan's order, every bucket whose legs all have theirs; each
    bucket's collective runs asynchronously until :meth:`finish` waits for all of them (within
    one ``timeout``) and returns every leg's piece in its target layout. Ranks of a group start
    their buckets in the same order whatever order their inputs arrive in, so collectives always
    match. After an error, :meth:`drain` waits out what is in flight, so nothing is left
    running.

    Legs in ``deliver`` are not among the results of :meth:`finish` and :meth:`wait_for`:
    :meth:`write` puts them where they are kept, unpacking a final gather straight from the
    bucket's result (one copy instead of two, and no new tensor per step). Legs in ``stable``
    get the same tensor as input every step (a parameter, a kept buffer): their local steps'
    views and their blocks are made once and kept (with kept ``buffers``).

    ``write_to`` (per leg, the tensor its result is kept in) makes those legs delivered and
    writes each result there as soon as its bucket lands, before the next bucket of the stage
    starts: a program compiled with ``write_through`` lets the buckets after the update share
    one result region, so the stage holds one bucket's results, not all of them.

    ``names`` names the buckets in errors and records and gives their groups' DeviceMesh:
    :class:`StepNames` (the legs' tensors) unless given; a reshard gives its call's
    (``runtime.execution.reshard_program.ReshardNames``).

    ``start`` starts a bucket's collective: ``runtime.execution.run.start_move`` (torch.distributed)
    unless given, and ``exchange`` a bucket of point-to-point moves (``start_exchange``); the
    simulator (``runtime.execution.simulate.simulate_step``) gives its emulations.
    ``each_within``: every wait is bounded by ``timeout`` on its own, as a reshard's are (and
    its errors name that timeout), not all of the stage's within one. ``direct`` (a reshard's
    program: one leg, each bucket of one member): each bucket sends as the move does alone
    (``CollectiveMove.send``: from the piece itself where its blocks are runs of its memory, an
    all_reduce in place on a piece an earlier bucket made, else packed into ``buffers``' send
    buffer) and its result is allocated per run, not laid out in the kept buffer; so a reshard
    copies what the planner's copy table prices (``planner/copies.py``) and holds no buffer the
    size of its piece beyond the move's own (docs/design.md, "One executor").

    Raises :class:`DistributedError` naming the bucket when its collective fails, and
    :class:`ReshardError` for an input of the wrong shape or dtype."""

    def __init__(
        self,
        program: StepProgram,
        stage: str,
        *,
        device_meshes: Mapping[str, DeviceMesh | None],
        timeout: datetime.timedelta,
        buffers: Scratch | None = None,
        deliver: frozenset[int] = frozenset(),
        stable: frozenset[int] = frozenset(),
        write_to: Mapping[int, torch.Tensor] | None = None,
        start: StartMove | None = None,
        device: torch.device | None = None,
        names: Names | None = None,
        exchange: StartExchange | None = None,
        each_within: bool = False,
        direct: bool = False,
    ) -> None:
        self._each_within, self._direct = each_within, direct
        self.program, self.stage, self.timeout, self._start_move = program, stage, timeout, start
        self._start_exchange_with = exchange or start_exchange
        self._device = device  # where an exchange's pieces land on a rank that sends none
        self._write_to = dict(write_to) if write_to else {}
        if program.shared_after and stage == AFTER and buffers is not None and not write_to:
            raise ReshardError("a step program compiled to write through is run without write_to")
        if write_to:
            deliver = deliver | frozenset(write_to)
        self._names = names if names is not None else StepNames(program, device_meshes)
        self._buffers, self._deliver = buffers, deliver
        self._stable = stable if buffers is not None else frozenset()
        self._buckets = program.in_stage(stage)
        self._next = 0  # the next bucket to start
        self._given = 0  # its members up to this one have their inputs (feed)
        self._walks: dict[int, LegWalk] = {}
        self._in_flight: list[tuple[BucketProgram, Started, float]] = []
        # Per exchange in flight: each member's walk and the piece it lands in, and its moves.
        self._landing: dict[int, tuple[list[tuple[LegWalk, torch.Tensor | None]], list[RankExchange]]] = {}
        self.waited = 0.0  # seconds spent blocked waiting for collectives
        # Legs whose input a started bucket has packed: the stage reads it no more.
        self.packed: set[int] = set()
        # ``direct``: legs whose piece a bucket of this run made (an all_reduce may reduce it in place).
        self._owned: set[int] = set()

    @property
    def started(self) -> int:
        """Buckets started so far."""
        return self._next

    @property
    def legs(self) -> KeysView[int]:
        """The legs given their input so far (a live view: membership is a lookup)."""
        return self._walks.keys()

    def feed(self, inputs: Mapping[int, torch.Tensor]) -> None:
        """Give legs their inputs (each once); starts every bucket that became ready."""
        legs, walks = self.program.legs, self._walks
        for i, x in inputs.items():
            program = legs[i]
            if x is None or x.shape != program.source_shape or x.dtype != program.dtype:
                if x is None and program.source_shape is None:  # a rank off the leg's source mesh
                    continue
                if program.viewed_as_its_piece(x):
                    continue
                raise program.wrong_piece(x, self.program.rank)
        for i, x in inputs.items():  # given only once every input is checked
            program = legs[i]
            walks[i] = LegWalk(program.schedule, x, program.label)
        while self._next < len(self._buckets):
            bucket = self._buckets[self._next]
            # Members before ``_given`` have their inputs: each feed looks on from there, so a
            # bucket's members are looked up once in all, not once per feed (one per gradient
            # hook under overlap).
            members, given = bucket.members, self._given
            while given < len(members) and members[given][0] in walks:
                given += 1
            self._given = given
            if given < len(members):
                return
            self._start(bucket)
            self._next, self._given = self._next + 1, 0

    def run_one(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """Run a ``direct`` program's one leg from ``x`` (checked by the caller: a reshard's
        piece, ``None`` off its source mesh), each bucket waited on before the next starts, as
        they would be (each holds the leg's piece), and return its piece in the target layout."""
        program = self.program.legs[0]
        walk = self._walks[0] = LegWalk(program.schedule, x, program.label)
        traced = profiling()  # else no profiler ranges: a small reshard's time is mostly Python's
        for bucket in self._buckets:
            if traced:
                self._start(bucket)
                self._next += 1
                self._wait_oldest(None)
                continue
            if bucket.bucket.op == "point_to_point":
                self._start_exchange(bucket)
            else:
                self._send_and_start(bucket)
            self._next += 1
            self._finish(*self._in_flight.pop(), None)
        walk.advance()
        return walk.x

    def finish(self) -> dict[int, torch.Tensor]:
        """Start the buckets not yet started (every input must have been given), wait for all,
        and return every leg's result."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        for bucket in self._buckets[self._next :]:
            missing = [self.program.plan.legs[leg] for leg, *_ in bucket.members if leg not in self._walks]
            if missing:
                leg = missing[0]
                raise ReshardError(f"{leg.what} of tensor '{leg.tensor}' was given no input")
            self._start(bucket, deadline)
            self._next, self._given = self._next + 1, 0
        while self._in_flight:
            self._wait_oldest(deadline)
        if self._write_to:  # legs that never communicate
            self._write(self._write_to)
            self._write_to.clear()
        out = {}
        for i, walk in self._walks.items():
            if walk.i < len(walk.schedule):  # most legs are at their end already
                self._advance(i, walk, None)
            if i not in self._deliver:
                out[i] = walk.x
        return out

    def wait_for(self, legs: Sequence[int]) -> dict[int, torch.Tensor]:
        """Wait for the buckets in flight (oldest first) until ``legs`` have passed all of
        theirs (every bucket of the stage must have been started), and return their results."""
        self._wait(legs)
        out = {}
        for leg in legs:
            walk = self._walks[leg]
            walk.advance()
            out[leg] = walk.x
        return out

    def write(self, outs: Mapping[int, torch.Tensor]) -> None:
        """Wait as :meth:`wait_for` does for the legs of ``outs`` (legs in ``deliver``) and
        write each one's result into its tensor."""
        self._wait(list(outs))
        self._write(outs)

    def _write(self, outs: Mapping[int, torch.Tensor]) -> None:
        """Write the results of the legs of ``outs``, every bucket of theirs waited on, into
        their tensors (:meth:`write`)."""
        targets, sources = [], []
        for leg, out in outs.items():
            walk = self._walks[leg]
            walk.advance()
            unpacking, x = walk.unpacking, walk.x
            if unpacking is None:
                copies = [(out, x)]
            elif out.shape == unpacking.after or out.is_contiguous():  # viewed as the gather's result
                held = (x, out.data_ptr(), out.shape, out.stride())
                copies = self._memo(("write", leg), held, unpacking.finish_copies, x, out)
            else:
                copies = [(out, unpacking.finish(x).reshape(out.shape))]
            for target, source in copies:
                if not _same_memory(target, source):  # updated where it lies (one rank holds it all)
                    targets.append(target)
                    sources.append(source)
        if targets:
            torch._foreach_copy_(targets, sources)

    def _wait(self, legs: Sequence[int]) -> None:
        deadline = time.monotonic() + self.timeout.total_seconds()
        while self._in_flight and any(self._walks[leg].flying for leg in legs):
            self._wait_oldest(deadline)

    def places(self, legs: Sequence[int], device: torch.device) -> dict[int, torch.Tensor]:
        """Where to write the inputs of ``legs`` so that the all_gather they start with sends
        them from there: per leg whose first step is an all_gather of this stage with unpadded
        blocks, the view of its part of the gather's own row of its result (its send buffer:
        ``_lay_out``), in the shape the leg starts from. An input fed from its place is not
        copied (one copy less per gathered byte: an optimizer writes its new parameters there).
        Other legs are left out, and so are all without kept ``buffers`` (on ``device``); an
        input fed from a place that has since moved is copied, as any other."""
        if self._buffers is None:
            return {}
        held = (tuple(legs), device, self._buffers.allocations)
        return self._memo(("places", 0), held, self._places, legs, device)[0]

    def _places(self, legs: Sequence[int], device: torch.device) -> list[dict[int, torch.Tensor]]:
        assert self._buffers is not None
        program, places = self.program, {}
        for leg in legs:
            opened = program.opened_by.get(leg)
            if opened is None:
                continue
            bucket = program.buckets[opened[0]]
            _, move, chunk, offset = bucket.members[opened[1]]
            leg_program = program.legs[leg]
            if bucket.bucket.op != "all_gather" or bucket.bucket.stage != self.stage or chunk == 0:
                continue
            if chunk != math.prod(leg_program.source_shape):  # padded blocks: packed by a copy
                continue
            kept = self._buffers.take("kept", program.kept_numel[bucket.bucket.dtype], leg_program.dtype, device)
            start, numel = bucket.result
            part = kept[start : start + numel].view(move.n, bucket.total)[move.position, offset : offset + chunk]
            place = part.view(leg_program.source_shape)
            view = leg_program.schedule[0][0]
            blocks = move.send_blocks(place.reshape(view) if view is not None else place)
            if blocks is not None and blocks.data_ptr() == part.data_ptr():
                places[leg] = place
        return [places]

    def source_shape(self, leg: int) -> tuple[int, ...]:
        """The shape of the piece leg ``leg`` starts from on this rank."""
        return self.program.legs[leg].source_shape

    def drain(self) -> None:
        """Wait out every collective in flight (within ``timeout``), ignoring failures."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        for _, pending, _ in self._in_flight:
            with contextlib.suppress(DistributedError):
                pending.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        self._in_flight.clear()

    def _start(self, bucket: BucketProgram, deadline: float | None = None) -> None:
        # Buckets of a step share their send buffer and workspace, so one runs at a time; any
        # bucket waits for one in flight that holds the previous step of one of its legs.
        launch = bucket.bucket.launch
        while self._in_flight and (
            launch == IN_STEP
            or (launch == DURING_BACKWARD and len(self._in_flight) >= IN_FLIGHT)
            or any(self._walks[leg].flying for leg, *_ in bucket.members)
        ):
            self._wait_oldest(deadline)
        with profiled(self.stage, lambda: f"start {self.bucket_text(bucket)}"):
            if bucket.bucket.op == "point_to_point":
                self._start_exchange(bucket)
            elif self._direct:
                self._send_and_start(bucket)
            else:
                self._pack_and_start(bucket)

    def _start_exchange(self, bucket: BucketProgram) -> None:
        """Post a bucket of point-to-point moves as one :class:`~runtime.execution.run.Exchange`
        (one message per peer), each member walked to its move first."""
        posts, landing = [], []
        for position, (leg, move, _, _) in zip(bucket.positions, bucket.members, strict=True):
            walk = self._walks[leg]
            walk.advance(position)
            if move is None:  # this rank takes no part: it holds nothing of the leg from here
                landing.append((walk, None))
                continue
            out = None
            if move.after is not None:
                device = walk.x.device if walk.x is not None else self._device or torch.device("cpu")
                out = torch.empty(move.after, dtype=self.program.legs[leg].dtype, device=device)
            posts.append((move, walk.x, out))
            landing.append((walk, out))
        messages = Exchange(posts)  # type: ignore[arg-type]
        started = time.perf_counter()
        try:
            pending = self._start_exchange_with(messages)
        except DistributedError as e:  # the members keep their pieces, as a collective's do
            raise DistributedError(f"{self.bucket_text(bucket)} failed: {e.message}") from e
        for walk, _ in landing:
            walk.x, walk.flying = None, True
        self._landing[bucket.index] = (landing, [move for move, _, _ in posts])
        self._in_flight.append((bucket, pending, started))

    def _pack_and_start(self, bucket: BucketProgram) -> None:
        """Pack the bucket's members into its send buffer and start its collective."""
        program, buffers = self.program, self._buffers
        first_leg, first, _, _ = bucket.members[0]
        n, op, total = first.n, bucket.bucket.op, bucket.total
        sample = self._walks[first_leg].x
        shape = (n, total) if bucket.per_peer else (total,)
        out = workspace = None
        if buffers is None:
            if op == "all_gather":
                out = torch.empty(n * total, dtype=sample.dtype, device=sample.device)
                send = out.view(n, total)[first.position]  # in place (_lay_out)
            else:
                send = torch.empty(shape, dtype=sample.dtype, device=sample.device)
        else:
            dtype = bucket.bucket.dtype
            kept = buffers.take("kept", program.kept_numel[dtype], sample.dtype, sample.device)
            start, numel = bucket.result
            out = kept[start : start + numel]
            if op == "all_reduce":  # reduces in place: its send buffer is its result
                send = out.view(shape)
            elif op == "all_gather":  # sends from its own row of its result (_lay_out)
                send = out.view(n, total)[first.position]
            else:
                send = buffers.take("send", program.send_numel[dtype], sample.dtype, sample.device)
                send = send[bucket.send : bucket.send + bucket.send_numel].view(shape)
            if bucket.workspace is not None:
                workspace = kept[bucket.workspace[0] : bucket.workspace[0] + bucket.workspace[1]]
        # Members that need no padding are written with one copy call for the whole bucket.
        targets, sources, walks = [], [], []
        parts = self._memo(
            ("send", bucket.index), (send.data_ptr(), send.shape), BucketProgram.send_parts, bucket, send
        )
        for position, (leg, move, _, _), part in zip(bucket.positions, bucket.members, parts, strict=True):
            walk = self._walks[leg]
            walks.append(walk)
            self._advance(leg, walk, position)
            if leg in self._stable:
                blocks = self._memo(("blocks", leg), (walk.x,), _blocks, move, walk.x)[0]
            else:
                blocks = move.send_blocks(walk.x)
            if blocks is None:
                move.send_into(walk.x, part)
            elif blocks.data_ptr() != part.data_ptr() or blocks.stride() != part.stride():
                targets.append(part)
                sources.append(blocks)
            # else the input was written where it is sent from (:meth:`places`)
        if targets:
            torch._foreach_copy_(targets, sources)
        self._post(bucket, first, send.view(-1), out, workspace, None)
        for walk in walks:
            walk.x, walk.flying = None, True  # the piece is in the buffer now
        self.packed.update(leg for leg, *_ in bucket.members)

    def _send_and_start(self, bucket: BucketProgram) -> None:
        """Start a ``direct`` bucket's collective (its one member's move) from what
        ``CollectiveMove.send`` makes of the piece, its result allocated by the collective."""
        (leg, move, _, _), walk = bucket.members[0], self._walks[bucket.members[0][0]]
        walk.advance(bucket.positions[0])
        buffers = self._buffers
        send = move.send(walk.x, writable=leg in self._owned, scratch=buffers)
        workspace = None
        if buffers is not None and move.step.op == "reduce_scatter":  # gloo's blocks land here
            workspace = buffers.take("blocks", send.numel(), send.dtype, send.device)
        self._post(bucket, move, send, None, workspace, walk)
        self.packed.add(leg)

    def _post(
        self,
        bucket: BucketProgram,
        first: CollectiveMove,
        send: torch.Tensor,
        out: torch.Tensor | None,
        workspace: torch.Tensor | None,
        walk: LegWalk | None,
    ) -> None:
        """Start the collective of ``bucket`` (its members' moves step as ``first`` does) from
        the flat ``send``; ``walk``, its one member's (a ``direct`` bucket), is in flight from here."""
        started = time.perf_counter()
        try:
            pending = (self._start_move or start_move)(
                first,
                send,
                device_mesh=self._names.mesh_of(bucket),
                timeout=self.timeout,
                out=out,
                workspace=workspace,
                waited_at_once=bucket.bucket.launch == IN_STEP,  # runtime.comm.collectives: waited within step()
            )
        except (DistributedError, ReshardError) as e:
            # The members keep their pieces: the bucket is started again by the next feed() or
            # finish(), so that the peers' collective is matched (docs/design/failures.md).
            raise type(e)(f"{self.bucket_text(bucket)} failed: {e.message}") from e
        if walk is not None:
            walk.x, walk.flying = None, True  # sent: the next bucket's result is its piece
        self._in_flight.append((bucket, pending, started))

    def _wait_oldest(self, deadline: float | None) -> None:
        bucket, pending, started = self._in_flight.pop(0)
        with profiled(self.stage, lambda: f"wait {self.bucket_text(bucket)}"):
            self._finish(bucket, pending, started, deadline)

    def _finish(self, bucket: BucketProgram, pending: Started, started: float, deadline: float | None) -> None:
        """Wait for the bucket's collective and hand each member its result."""
        if deadline is None or self._each_within:
            left = self.timeout
        else:
            left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        blocked = time.perf_counter()
        try:
            received = pending.wait(left)
        except DistributedError as e:
            raise DistributedError(f"{self.bucket_text(bucket)} failed: {e.message}") from e
        finally:
            self.waited += time.perf_counter() - blocked
        op = bucket.bucket.op
        if op == "point_to_point":
            landing, moves = self._landing.pop(bucket.index)
            for walk, out in landing:
                walk.passed(out)
            if self._direct:  # the pieces landed in new tensors
                self._owned.update(leg for leg, *_ in bucket.members)
            self._record(bucket, moves, started)
            return
        if stats.is_recording():
            self._record(bucket, [move for _, move, _, _ in bucket.members], started)
        if self._direct:  # a result of its own (_send_and_start): its views are made anew
            leg, move, _, _ = bucket.members[0]
            self._walks[leg].passed(move.finish(received))
            self._owned.add(leg)
            return
        rows = op in ("all_gather", "all_to_all")
        held = (received.data_ptr(), received.shape)
        mine = self._memo(("result", bucket.index), held, BucketProgram.result_parts, bucket, received)
        for (leg, move, _, _), final, part in zip(bucket.members, bucket.final, mine, strict=True):
            walk = self._walks[leg]
            if not rows:
                walk.passed(part)  # already the piece after the step (a view)
            elif final and leg in self._deliver:
                walk.unpack_later(part, move)  # unpacked by write(), into where it is kept
            else:
                walk.passed(move.finish(part))
        if self._write_to:  # written out before the next bucket reuses the region (write_through)
            # Only the legs this bucket ends: a leg of two gathers is written after its second.
            ended = [leg for (leg, *_), final in zip(bucket.members, bucket.final, strict=True) if final]
            done = {leg: self._write_to.pop(leg) for leg in ended if leg in self._write_to}
            self._write(done)

    def _advance(self, leg: int, walk: LegWalk, until: int | None) -> None:
        """``walk.advance(until)``; for a stable leg at its start, from the pieces an earlier
        step's advance of the same input made."""
        if leg in self._stable and walk.i == 0:
            kept = self._memo(("advance", leg), (walk.x, until), _advanced_view, walk, until)
            if kept is not None:  # else the walk advanced, and what it reached is not a view
                walk.skip_to(until, kept[0])
        else:
            walk.advance(until)

    def _memo(
        self, key: tuple[str, int], held: tuple[object, ...], make: Callable[..., list | None], *args: object
    ) -> Any:  # what ``make`` returns: a list, or None where it is allowed to (KeptViews)
        """Views that every step makes alike from the same buffers (a bucket's places in its
        send buffer and its result, a final gather's copies into a parameter): made once and
        kept on the program while ``held`` (what they view) is the same. Python's per-view cost
        on a model of many small tensors is most of a step's time otherwise. Without kept
        ``buffers`` every step has new ones, so nothing is kept."""
        if self._buffers is None:
            return make(*args)
        return self.program.views.get(key, held, make, *args)

    def bucket_text(self, bucket: BucketProgram) -> str:
        """The bucket as errors and profiler ranges name it (``runtime.execution.names``):
        ``bucket 2 of 5 (reduce_scatter over dp of 'w1', 'b1')`` in a step."""
        return self._names.text(bucket)

    def _record(self, bucket: BucketProgram, moves: Sequence[CollectiveMove | RankExchange], started: float) -> None:
        if stats.is_recording():  # the names are made only then
            tensor, step = self._names.record(bucket)
            planned, itemsize = bucket.bucket.bytes, ITEMSIZE[bucket.bucket.dtype]
            record_traffic(moves, tensor=tensor, step=step, itemsize=itemsize, planned_bytes=planned, started=started)


def _advanced_view(walk: LegWalk, until: int | None) -> list[torch.Tensor] | None:
    """``walk.advance(until)``'s piece when it is a view of the walk's input (a reshape of a
    strided input copies), else ``None``."""
    x = walk.x
    walk.advance(until)
    return [walk.x] if walk.x.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else None


def _blocks(move: CollectiveMove, x: torch.Tensor) -> list[torch.Tensor | None]:
    return [move.send_blocks(x)]


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of the same elements (a copy between them would change
    nothing, and cost a read and a write of them all)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
