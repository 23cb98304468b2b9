"""Agreement between the ranks of a save or load: each phase runs on every rank, then every
rank learns how every rank fared (short messages all-gathered over the default process group,
every wait bounded by ``runtime.comm.collectives``), and all of them raise if any failed. A rank that
cannot hear from the others raises too, saying what it left behind. A single process (no
process group) is a world of one."""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from runtime.checkpoint.errors import CheckpointError
from runtime.comm.collectives import collective, default_device
from runtime.errors import DistributedError
from shardlang.errors import ShardlangError

MESSAGE_BYTES = 1024  # longer messages lose their middle (their ends say what failed and what it left)
_FAILED = "!"  # a message starting with this reports an error


def rank_and_size() -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def all_or_none(
    phase: Callable[[], object],
    *,
    payload: str = "",
    timeout: datetime.timedelta,
    what: str,
    outcome: str,
    cleanup: Callable[[], None] | None = None,
    lost: Callable[[], str] | None = None,
) -> list[str]:
    """Run this rank's ``phase``, then every rank's ``payload`` in rank order. If ``phase``
    failed on any rank, every rank runs ``cleanup`` and raises a :class:`CheckpointError`
    naming the failed ranks and their errors, and ``outcome`` (what that left behind; empty
    when the errors say it). If the ranks cannot exchange their messages (a peer died or did
    not arrive within ``timeout``), this rank runs ``cleanup`` and raises a
    :class:`CheckpointError` ending with ``lost()`` (default: ``outcome``)."""
    cause = None
    try:
        phase()
    except Exception as e:  # any failure: the peers must hear of it, not wait for this rank
        cause = e
    try:
        messages = _exchange(_FAILED + _describe(cause) if cause is not None else payload, timeout)
    except DistributedError as e:
        if cleanup is not None:
            cleanup()
        mine = f"{_describe(cause)}, and " if cause is not None else ""
        said = lost() if lost is not None else outcome
        if said and said in mine:  # the error already says it
            said = ""
        raise CheckpointError(f"{what}: {mine}the ranks lost touch ({e.message}){_then(said)}") from (
            cause if cause is not None else e
        )
    failed = {rank: text[len(_FAILED) :] for rank, text in enumerate(messages) if text.startswith(_FAILED)}
    if failed:
        if cleanup is not None:
            cleanup()
        rank = rank_and_size()[0]
        if rank in failed:
            raise CheckpointError(f"{what}: {failed[rank]}{_then(outcome)}") from cause
        reasons = "; ".join(f"rank {r}: {text}" for r, text in sorted(failed.items()))
        raise CheckpointError(f"{what} failed on another rank ({reasons}){_then(outcome)}")
    return messages


def _then(outcome: str) -> str:
    return f"; {outcome}" if outcome else ""


def _describe(error: Exception) -> str:
    return error.message if isinstance(error, ShardlangError) else f"{type(error).__name__}: {error}"


def _exchange(message: str, timeout: datetime.timedelta) -> list[str]:
    if not dist.is_initialized():
        return [message]
    body = message.encode()
    if len(body) > MESSAGE_BYTES:
        half = (MESSAGE_BYTES - 5) // 2
        body = body[:half] + b" ... " + body[-half:]
    send = torch.zeros(MESSAGE_BYTES + 2, dtype=torch.uint8)
    send[0], send[1] = len(body) // 256, len(body) % 256
    send[2 : 2 + len(body)] = torch.tensor(list(body), dtype=torch.uint8)
    size = dist.get_world_size()
    received = collective("all_gather", send.to(default_device()), size, None, dist.group.WORLD, timeout).cpu()
    out = []
    for block in received.view(size, MESSAGE_BYTES + 2):
        length = int(block[0]) * 256 + int(block[1])
        out.append(bytes(block[2 : 2 + length].tolist()).decode(errors="replace"))
    return out
