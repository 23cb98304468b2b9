"""The collective layer: one call per collective kind, flat contiguous buffers, bounded waits.

Everything backend-specific stays here; the executor above only names the collective. Each
collective is issued asynchronously and its work handle waited on with a timeout, so a peer
that died or never arrives surfaces as a :class:`DistributedError` instead of a hang.
``timeout_of`` reads the ``timeout=`` that every communicating entry point takes (``reshard``,
the sharded optimizers, checkpoints), default :data:`DEFAULT_TIMEOUT`.

Point-to-point messages (``post_point_to_point``, ``wait_point_to_point``) go between global
ranks of the default process group through ``batch_isend_irecv``, all of a step's messages in
one batch; waiting on them shares ONE deadline, so a step waits at most ``timeout`` however
many messages it has. On gloo a timed-out receive also closes the connection to that peer.

On gloo a reduce_scatter runs as an all_to_all followed by a local reduction of the ``n``
received blocks: gloo's own reduce_scatter costs as much as an all-reduce of the whole buffer
(2-4.5x slower than all_to_all plus the local sum for 256 KiB-16 MiB buffers on 4 CPU ranks, measured
with ``bench/bench_collectives.py``), while the all_to_all sends exactly the ring
reduce_scatter's ``(n-1)`` blocks.

On gloo an all_gather of a result of :data:`GATHER_MESSAGES_BYTES` or more over a group of at
most :data:`GATHER_MESSAGES_MAX_RANKS` ranks that its caller waits on before returning
(``waited_at_once``) runs as point-to-point messages: each rank sends its block to every peer at
once and receives theirs straight into their rows of the result. A rank posts ``2 (n - 1)``
messages from Python for it, so in larger groups each step's work would grow with the ranks
(docs/memory.md, "At scale"); there gloo's ring, whose rounds run in its own threads, is kept.
gloo's own all_gather is a ring of ``n - 1`` rounds, one after another, and took 1.35-1.9x as
long for results of 1-16 MiB on 4 CPU ranks (``bench/bench_collectives.py``, docs/benchmarks); below
1 MiB the two were level or the ring faster, depending on the run. The messages carry a tag of
their own (:data:`GATHER_TAG`), so that they never match a plan's point-to-point messages.
Unlike a collective's work, which gloo's worker thread holds and finishes, a message's work is
its caller's: one started while ``torch.profiler`` ran and waited on after it stopped crashed
the process every time here (torch 2.13; gloo's ring did so once in about 20 rounds of 4 ranks,
a hazard of any work left in flight across the profiler's stop), hence messages only for a
gather waited on at once, never for one left in flight across its caller's return (buckets
started during backward, gathers prefetched after a step). And one dropped before it completes
cancels its message, so that later messages between the same ranks no longer match: the works
of a gather's messages are kept here (:data:`_MESSAGES_IN_FLIGHT`) until they complete,
whatever its caller does, and let go once waited on (a completed work kept until the process
exits, after ``destroy_process_group``, aborted it there now and then).

On NCCL with CUDA tensors a wait is stream-ordered (``Work.wait()`` without a timeout): the
current stream waits for the collective's stream and the host goes on queueing work, as DDP
and FSDP2 wait. With a timeout NCCL would block the host until the collective completes, a
synchronization per bucket. A peer that never arrives is then caught by the process group's
own timeout (NCCL's watchdog), which the runtime sets to the caller's ``timeout`` where it
creates groups (``runtime.comm.groups``). A buffer a collective still reads or writes is reused
only after its wait: the wait orders the reuse after the collective on the GPU too
(docs/gpu.md).

``avg`` is computed as a sum followed by a division by the group size on every backend:
gloo lacks ``ReduceOp.AVG`` on some builds and for some collectives, and the sum-then-divide
result is the same on all of them. An integer tensor cannot be averaged (rejected earlier).
"""

from __future__ import annotations

import datetime
import time
import weakref
from collections.abc import Callable

import attrs
import torch
import torch.distributed as dist

from runtime.errors import DistributedError
from shardlang.errors import ShardlangError

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

GATHER_TAG = 7  # the tag of an all_gather's messages on gloo (module docstring)
GATHER_MESSAGES_BYTES = 2**20  # gloo all_gathers of results this large run as messages
GATHER_MESSAGES_MAX_RANKS = 8  # ... over groups of at most this many ranks (measured on 4)
# The works of gathers' messages not known to be complete (module docstring), oldest first.
_MESSAGES_IN_FLIGHT: list[dist.Work] = []
_GLOO: weakref.WeakKeyDictionary[dist.ProcessGroup, bool] = weakref.WeakKeyDictionary()  # see _is_gloo

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@attrs.frozen(eq=False)
class PendingCollective:
    """A collective in flight (:func:`start_collective`): :meth:`wait` gives its flat result.
    On gloo a reduce_scatter is in flight as its all_to_all; the local reduction of the
    received blocks runs in :meth:`wait`."""

    op: str
    received: torch.Tensor
    n: int
    reduce_op: str | None
    works: tuple[dist.Work, ...]  # one, or on gloo an all_gather's messages
    blocks: torch.Tensor | None = None  # gloo's reduce_scatter: the blocks the all_to_all receives
    stream_ordered: bool = False  # NCCL on CUDA: waiting orders the streams, the host goes on

    def wait(self, timeout: datetime.timedelta) -> torch.Tensor:
        """Wait at most ``timeout`` (for all of its works together); raises
        :class:`DistributedError` past it or when a peer failed."""
        deadline = time.monotonic() + timeout.total_seconds()
        for work in self.works:
            try:
                if self.stream_ordered:
                    work.wait()
                else:
                    wait(work, datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError as e:
                raise DistributedError(_reason(e, timeout)) from e
        if _MESSAGES_IN_FLIGHT and self.op == "all_gather":
            # A gather's messages, complete: let them go now. Kept until the process exits,
            # after destroy_process_group, a work aborted it at exit ("terminate called").
            done = {id(work) for work in self.works}
            _MESSAGES_IN_FLIGHT[:] = [work for work in _MESSAGES_IN_FLIGHT if id(work) not in done]
        if self.blocks is not None:
            _reduce_blocks(self.blocks.view(self.n, -1), self.reduce_op, self.received)
        if self.reduce_op == "avg" and self.received.numel():
            self.received.div_(self.n)
        return self.received


def start_collective(
    op: str,
    send: torch.Tensor,
    n: int,
    reduce_op: str | None,
    group: dist.ProcessGroup,
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    waited_at_once: bool = False,
) -> PendingCollective:
    """Start ``op`` (all_gather, reduce_scatter, all_reduce, all_to_all) on the flat buffer
    ``send`` over ``group`` of ``n`` ranks (all_reduce works in place on ``send``; the others
    write ``out`` when given). ``workspace`` (of ``send``'s size) is where gloo's
    reduce_scatter receives its blocks. ``send``, ``out`` and ``workspace`` must not be touched
    until the collective has been waited on. Ranks of one group always pass buffers of equal
    size; empty buffers skip the collective on all of them alike. An all_gather may run in place:
    ``send`` the rank's own row of ``out`` (as NCCL allows, and FSDP2 gathers), which saves
    copying the block there. ``waited_at_once``: the caller waits on it before it returns, which
    lets a gloo all_gather run as messages (module docstring)."""
    sizes = {"all_gather": n * send.numel(), "reduce_scatter": send.numel() // n, "all_to_all": send.numel()}
    if op == "all_reduce":
        received = send
    elif op not in sizes:
        raise ValueError(f"not a collective: {op}")
    else:
        received = send.new_empty(sizes[op]) if out is None else out
    if send.numel() == 0:
        return PendingCollective(op, received, n, reduce_op, ())
    blocks = None
    gloo = _is_gloo(group)
    try:
        big = received.numel() * received.element_size() >= GATHER_MESSAGES_BYTES
        # gloo's messages send from host memory: CUDA tensors take its collective (docs/gpu.md).
        few = n <= GATHER_MESSAGES_MAX_RANKS
        if op == "all_gather" and gloo and waited_at_once and big and few and not send.is_cuda:
            works = _all_gather_messages(received, send, group)
        elif op == "all_gather":
            works = [all_gather_single(received, send, group=group, async_op=True)]
        elif op == "reduce_scatter" and gloo:
            blocks = send.new_empty(send.numel()) if workspace is None else workspace
            works = [dist.all_to_all_single(blocks, send, group=group, async_op=True)]
        elif op == "reduce_scatter":
            works = [reduce_scatter_single(received, send, op=_REDUCE_OPS[reduce_op], group=group, async_op=True)]
        elif op == "all_reduce":
            works = [dist.all_reduce(received, op=_REDUCE_OPS[reduce_op], group=group, async_op=True)]
        else:
            works = [dist.all_to_all_single(received, send, group=group, async_op=True)]
    except RuntimeError as e:
        raise DistributedError(_reason(e, None)) from e
    return PendingCollective(op, received, n, reduce_op, tuple(works), blocks, not gloo and send.is_cuda)


def gather_messages_from(group: dist.ProcessGroup | None = None, *, ranks: int | None = None) -> int | None:
    """The result bytes from which an all_gather over ``group`` (default: the default group's
    backend), of ``ranks`` ranks when given, waited on at once runs as messages, not the
    backend's own (module docstring); None where it never does (not gloo, or more than
    :data:`GATHER_MESSAGES_MAX_RANKS` ranks). ``runtime.measure.calibrate`` fits a regime from there
    (docs/calibration.md)."""
    if ranks is not None and ranks > GATHER_MESSAGES_MAX_RANKS:
        return None
    return GATHER_MESSAGES_BYTES if dist.get_backend(group) == "gloo" else None


def _is_gloo(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` runs on gloo, asked of torch once per group (``dist.get_backend``
    checks its arguments on every call, and every collective of every step asks)."""
    gloo = _GLOO.get(group)
    if gloo is None:
        gloo = _GLOO[group] = dist.get_backend(group) == "gloo"
    return gloo


def _all_gather_messages(received: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup) -> list[dist.Work]:
    """gloo's all_gather as messages (module docstring): this rank's block into its own row
    of ``received`` and to every peer, every peer's block into its row, all posted at once."""
    _MESSAGES_IN_FLIGHT[:] = [work for work in _MESSAGES_IN_FLIGHT if not work.is_completed()]
    me, n = group.rank(), group.size()
    rows = received.view(n, -1)
    if rows[me].data_ptr() != send.data_ptr():  # else in place: the block is in its row already
        rows[me].copy_(send)
    # The process group's own calls, which dist.isend and dist.irecv make after checks that
    # these buffers pass by construction (the checks were a quarter of this function's time).
    works = []
    for peer in range(n):
        if peer != me:
            works.append(group.send([send], peer, GATHER_TAG))
            works.append(group.recv([rows[peer]], peer, GATHER_TAG))
    _MESSAGES_IN_FLIGHT.extend(works)
    return works


def collective(
    op: str,
    send: torch.Tensor,
    n: int,
    reduce_op: str | None,
    group: dist.ProcessGroup,
    timeout: datetime.timedelta,
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`start_collective`, waited on at most ``timeout``: the flat result."""
    pending = start_collective(op, send, n, reduce_op, group, out=out, workspace=workspace, waited_at_once=True)
    return pending.wait(timeout)


def _reduce_blocks(blocks: torch.Tensor, reduce_op: str | None, out: torch.Tensor) -> None:
    """Reduce the ``[n, chunk]`` blocks every peer sent into ``out`` (``avg`` as a sum: the
    caller divides)."""
    if reduce_op in ("sum", "avg"):
        torch.sum(blocks, 0, out=out)
    elif reduce_op == "max":
        torch.amax(blocks, 0, out=out)
    else:
        torch.amin(blocks, 0, out=out)


PeerBuffers = list[tuple[int, torch.Tensor]]  # (global peer rank, flat contiguous buffer)


def post_point_to_point(sends: PeerBuffers, receives: PeerBuffers) -> list[tuple[str, dist.Work]]:
    """Start every send and receive of one step; returns each message's work handle with what it
    is (``"the receive from rank 3"``)."""
    ops = [(f"the send to rank {peer}", dist.P2POp(dist.isend, buffer, peer)) for peer, buffer in sends]
    ops += [(f"the receive from rank {peer}", dist.P2POp(dist.irecv, buffer, peer)) for peer, buffer in receives]
    if not ops:
        return []
    try:
        works = dist.batch_isend_irecv([op for _, op in ops])
    except RuntimeError as e:
        raise DistributedError(f"posting the messages failed: {_reason(e, None)}") from e
    return [(what, work) for (what, _), work in zip(ops, works, strict=True)]


def wait_point_to_point(works: list[tuple[str, dist.Work]], timeout: datetime.timedelta) -> None:
    """Wait for every message of a step, all within one ``timeout``."""
    deadline = time.monotonic() + timeout.total_seconds()
    for what, work in works:
        left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        try:
            wait(work, left)
        except RuntimeError as e:
            raise DistributedError(f"{what}: {_reason(e, timeout)}") from e


def default_device() -> torch.device:
    """Where a rank that holds no piece yet allocates what it receives: the current CUDA device
    when the default process group runs NCCL, else the CPU."""
    if dist.is_initialized() and "nccl" in dist.get_backend() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def timeout_of(
    timeout: float | datetime.timedelta | None, error: Callable[[str], ShardlangError]
) -> datetime.timedelta:
    """``timeout`` (seconds or a timedelta) as a timedelta, ``None`` as :data:`DEFAULT_TIMEOUT`;
    anything else (not positive, not a number) raises ``error(message)``."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    try:
        wait = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=float(timeout))
    except (TypeError, ValueError, OverflowError):
        wait = None
    if wait is None or wait <= datetime.timedelta(0):
        raise error(f"timeout must be positive (seconds or a timedelta), got {timeout!r}")
    return wait


def wait(work: dist.Work, timeout: datetime.timedelta) -> None:
    """Wait for ``work`` at most ``timeout``; raises RuntimeError (from torch) past it."""
    if not work.wait(timeout):
        raise RuntimeError("the collective did not complete")


def _reason(error: RuntimeError, timeout: datetime.timedelta | None) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if timeout is not None and ("timed out" in text.lower() or "timeout" in text.lower()):
        return f"timed out after {timeout.total_seconds():g} s (a peer did not arrive): {text}"
    return f"a peer failed: {text}"
