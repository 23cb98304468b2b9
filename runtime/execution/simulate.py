"""Execute a plan for every rank at once, in one process, with real tensors.

:func:`simulate_step` runs a compiled step program (``runtime.execution.step_program``: an
optimizer step's buckets) as a step does: every rank's stage is run by the bucket runner itself
(``runtime.execution.buckets.StageRun``, on kept buffers of its own), one thread per rank, and
only the starting of each bucket's collective is replaced: a group's ``k``-th collective meets
once all its members have posted theirs (as a process group matches them), and each member's
result is written where the runner asked (its ``out``, in place for an all_reduce). A bucket of
point-to-point moves posts its messages on the same board; a receiver copies each one from its
sender's, in the order the pair posted them.

:func:`simulate` runs a reshard's plan the same way, compiled as the executor compiles it
(``runtime.execution.reshard_program``: a program of one leg, a bucket per communicating step):
the same padding, blocks and trimming. A point-to-point step may hand the tensor to another
mesh: pieces come in keyed by the source mesh's ranks and go out keyed by the target mesh's.
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from planner.legs import BEFORE
from planner.plans import Plan
from runtime.errors import DistributedError, ReshardError
from runtime.execution.buckets import run_stage
from runtime.execution.program import CollectiveMove
from runtime.execution.reshard_program import compile_reshard
from runtime.execution.run import Exchange
from runtime.execution.step_program import StepProgram
from runtime.memory.buffers import Scratch
from runtime.memory.dtypes import dtype_name
from runtime.memory.pieces import check_pieces, reduce_stacked


def simulate(plan: Plan, pieces_by_rank: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every rank's piece in ``plan.dst``, keyed by the ranks of the target mesh, given every
    rank's piece in ``plan.src``, keyed by the ranks of the source mesh (each with the piece
    shape ``plan.src`` gives it). No result shares memory with an input or another result."""
    check_pieces(pieces_by_rank, plan.src, plan.shape)
    like = next(iter(pieces_by_rank.values()))
    if dtype_name(like.dtype) != plan.dtype:
        raise ReshardError(
            f"the plan {plan.src} -> {plan.dst} is for {plan.dtype} but the pieces are {dtype_name(like.dtype)}"
        )
    ranks = (*plan.src.mesh.ranks, *(r for r in plan.dst.mesh.ranks if r not in plan.src.mesh.ranks))
    programs = {rank: compile_reshard(plan, rank) for rank in ranks}
    inputs = {rank: {0: pieces_by_rank.get(rank)} for rank in ranks}  # None: off the source mesh
    done = simulate_step(programs, BEFORE, inputs, direct=True)  # type: ignore[arg-type]
    # None: only in the source mesh, the rank sent and holds nothing.
    return {rank: legs[0] for rank, legs in done.items() if legs[0] is not None}


def _collective(move: CollectiveMove, sends: list[torch.Tensor]) -> list[torch.Tensor]:
    """What each member of a group receives from the collective of ``move``'s step (a tensor
    of its own: results never share memory)."""
    op, n = move.step.op, move.n
    if op == "all_gather":
        gathered = torch.cat(sends)
        return [gathered.clone() for _ in range(n)]
    if op == "all_to_all":
        blocks = [s.view(n, -1) for s in sends]
        return [torch.cat([b[i] for b in blocks]) for i in range(n)]
    reduced = reduce_stacked(torch.stack(sends), move.step.reduce_op)
    if op == "all_reduce":
        return [reduced.clone() for _ in range(n)]
    return [block.clone() for block in reduced.view(n, -1)]


def simulate_step(
    programs: Mapping[int, StepProgram],
    stage: str,
    inputs: Mapping[int, Mapping[int, torch.Tensor]],
    *,
    kept_buffers: bool = True,
    timeout: float = 30.0,
    direct: bool = False,
) -> dict[int, dict[int, torch.Tensor]]:
    """Per rank, its legs' pieces after ``stage`` (``planner.legs.BEFORE`` or ``AFTER``) of its
    step program (``programs``: every rank's, compiled from its own step plan), given per rank
    its legs' inputs (leg index -> piece, as ``runtime.execution.buckets.run_stage`` takes them).
    ``kept_buffers``: each rank's buckets use kept buffers laid out as in a step
    (``runtime.execution.step_program``), else fresh ones. Raises the error of the rank that
    failed first (its peers stop waiting for it); a collective whose members do not all post
    theirs within ``timeout`` seconds is a :class:`DistributedError`. No result shares memory
    with an input or a buffer. ``direct``: the programs are a reshard's, run as the executor
    runs them (``runtime.execution.buckets.StageRun``'s ``direct``)."""
    board = _Board()
    wait = datetime.timedelta(seconds=timeout)

    def run(rank: int) -> dict[int, torch.Tensor]:
        try:
            done = run_stage(
                programs[rank],
                stage,
                inputs[rank],
                device_meshes={},
                timeout=wait,
                buffers=Scratch() if kept_buffers else None,
                start=board.start,
                exchange=functools.partial(board.exchange, rank),
                direct=direct,
            )
        except BaseException:
            board.fail(rank)  # the peers stop waiting for this rank's collectives
            raise
        return {leg: None if x is None else x.clone(memory_format=torch.contiguous_format) for leg, x in done.items()}

    with ThreadPoolExecutor(max_workers=max(len(programs), 1)) as pool:
        futures = {rank: pool.submit(run, rank) for rank in programs}
    if board.first is not None:
        futures[board.first].result()  # raises
    return {rank: future.result() for rank, future in futures.items()}


class _Meeting:
    """A group's ``k``-th collective: what each member posted (its move, send buffer and the
    buffer its result goes to), and once every member has, whether it ran (``error``: why not)."""

    __slots__ = ("error", "met", "posts")

    def __init__(self) -> None:
        self.posts: dict[int, tuple[CollectiveMove, torch.Tensor, torch.Tensor]] = {}
        self.met = False
        self.error: str | None = None

    def run(self, members: tuple[int, ...]) -> None:
        """Emulate the collective over the members' send buffers, into their result buffers."""
        posts = [self.posts[r] for r in members]
        first = posts[0][0]
        kinds = {(move.step.op, move.step.reduce_op, send.numel()) for move, send, _ in posts}
        if len(kinds) > 1:
            what = ", ".join(
                f"rank {r}: {m.step.op} of {x.numel()}" for r, (m, x, _) in zip(members, posts, strict=True)
            )
            self.error = f"the ranks {list(members)} posted different collectives ({what})"
            return
        for (_, _, received), result in zip(posts, _collective(first, [x.view(-1) for _, x, _ in posts]), strict=True):
            received.copy_(result.view(-1))
        self.met = True


class _Board:
    """Where the ranks' threads post their collectives (:meth:`start`, with
    ``runtime.execution.run.start_move``'s signature); a group's ``k``-th collective is emulated
    when its last member posts, under the lock, into every member's result buffer."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._meetings: dict[tuple[tuple[int, ...], int], _Meeting] = {}
        self._count: dict[tuple[int, tuple[int, ...]], int] = {}
        self.first: int | None = None  # the rank that failed first
        # Point-to-point messages posted and not yet received: (sender, receiver, k-th of the pair).
        self._messages: dict[tuple[int, int, int], torch.Tensor] = {}

    def start(
        self, move: CollectiveMove, send: torch.Tensor, *, out: torch.Tensor | None = None, **_: object
    ) -> _Posted:
        rank, members, op = move.members[move.position], move.members, move.step.op
        if op == "all_reduce":
            received = send  # reduced in place, as runtime.comm.collectives does
        elif out is not None:
            received = out
        else:
            size = {"all_gather": move.n * send.numel(), "reduce_scatter": send.numel() // move.n}
            received = send.new_empty(size.get(op, send.numel()))
        with self._lock:
            k = self._count.get((rank, members), 0)
            self._count[(rank, members)] = k + 1
            meeting = self._meetings.setdefault((members, k), _Meeting())
            meeting.posts[rank] = (move, send, received)
            if len(meeting.posts) == move.n:
                meeting.run(members)
                self._lock.notify_all()
        return _Posted(self, meeting, rank)

    def exchange(self, rank: int, bucket: Exchange) -> _Exchanged:
        """Post ``rank``'s messages of ``bucket`` (``runtime.execution.run.start_exchange``'s
        signature, less the rank) and make its local copies."""
        with self._lock:
            for peer, message in bucket.sends:
                k = self._count.get((rank, (rank, peer)), 0)
                self._count[(rank, (rank, peer))] = k + 1
                self._messages[(rank, peer, k)] = message
            self._lock.notify_all()
            expected = []
            for peer, buffer, _ in bucket.receives:
                k = self._count.get((rank, (peer, rank)), 0)
                self._count[(rank, (peer, rank))] = k + 1
                expected.append((peer, buffer, k))
        bucket.copy_local()
        return _Exchanged(self, rank, bucket, expected)

    def fail(self, rank: int) -> None:
        with self._lock:
            if self.first is None:
                self.first = rank
            self._lock.notify_all()

    def wait(self, meeting: _Meeting, rank: int, timeout: datetime.timedelta) -> torch.Tensor:
        with self._lock:
            self._lock.wait_for(
                lambda: meeting.met or meeting.error is not None or self.first is not None, timeout.total_seconds()
            )
        if meeting.error is not None:
            raise DistributedError(meeting.error)
        move, _, received = meeting.posts[rank]
        if not meeting.met:
            why = f"rank {self.first} failed" if self.first is not None else f"within {timeout.total_seconds():g} s"
            raise DistributedError(
                f"the simulated {move.step.op} over ranks {list(move.members)} was not met by every member ({why})"
            )
        return received


class _Posted:
    """One rank's collective on the board (``runtime.execution.run.Started``)."""

    __slots__ = ("_board", "_meeting", "_rank")

    def __init__(self, board: _Board, meeting: _Meeting, rank: int) -> None:
        self._board, self._meeting, self._rank = board, meeting, rank

    def wait(self, timeout: datetime.timedelta) -> torch.Tensor:
        return self._board.wait(self._meeting, self._rank, timeout)


class _Exchanged:
    """One rank's exchange on the board (``runtime.execution.run.Started``): :meth:`wait` copies
    every message it expects from its sender's once posted, then places them."""

    __slots__ = ("_board", "_bucket", "_expected", "_rank")

    def __init__(
        self, board: _Board, rank: int, bucket: Exchange, expected: list[tuple[int, torch.Tensor, int]]
    ) -> None:
        self._board, self._rank, self._bucket, self._expected = board, rank, bucket, expected

    def wait(self, timeout: datetime.timedelta) -> torch.Tensor:
        board = self._board
        keys = [(peer, self._rank, k) for peer, _, k in self._expected]
        with board._lock:
            board._lock.wait_for(
                lambda: all(key in board._messages for key in keys) or board.first is not None,
                timeout.total_seconds(),
            )
            missing = [key[0] for key in keys if key not in board._messages]
            if missing:
                why = f"within {timeout.total_seconds():g} s" if board.first is None else f"rank {board.first} failed"
                raise DistributedError(f"no simulated message of ranks {missing} came to rank {self._rank} ({why})")
            for (_, buffer, _), key in zip(self._expected, keys, strict=True):
                buffer.copy_(board._messages.pop(key))
        self._bucket.land()
        return torch.empty(0)
