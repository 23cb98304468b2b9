"""The commit point of a step: the flag the ranks agree on, what commits a staged step, and
what the last committed step did (docs/memory.md, "The commit point").

:class:`CommitFlag` is the one agreement of a step: one bounded all-reduce of a flag over the
ranks of the stepped tensors' meshes, so that every rank commits or none does.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.distributed as dist

from runtime.comm.collectives import collective, default_device
from runtime.comm.groups import ranks_group
from runtime.errors import DistributedError
from runtime.measure import stats
from runtime.optim.records import StepTraffic

# How long a rank whose step failed waits to tell the others (see CommitFlag.agree).
FAILURE_NOTICE = datetime.timedelta(seconds=2)
@attrs.frozen(eq=False)
class Staged:
    """A step run on this rank without changing anything: ``commit`` makes it take effect;
    ``abandon``, when another rank failed it, waits out the collectives it left in flight
    (``prefetch_params``' gathers), whose buffers the next step reuses."""

    commit: Callable[[], None]
    abandon: Callable[[], None] = lambda: None


@attrs.define
class LastStep:
    """What the last committed step did: its traffic, its gradients' norm (with
    ``max_grad_norm``, ``skip_nonfinite`` or ``clip_grad_norm_``), whether it was skipped for a
    NaN or inf in them, and the seconds it spent blocked on its buckets' collectives."""

    traffic: StepTraffic = attrs.field(factory=StepTraffic)
    grad_norm: torch.Tensor | None = None
    skipped: bool = False
    wait_seconds: float = 0.0


class CommitFlag:
    """The commit point: one bounded all-reduce of a flag over the ranks of the meshes of the
    tensors stepped (``all_ranks_commit``), ``flags`` per step (2 for an update in place: one
    before its math, one after it)."""

    def __init__(self, *, timeout: datetime.timedelta, enabled: bool, flags: int) -> None:
        self.timeout, self.enabled, self._flags = timeout, enabled, flags
        self._flag: torch.Tensor | None = None  # reduced in place

    def traffic(self, members: Sequence[int]) -> tuple[int, int]:
        """Bytes and collectives of a step's flags (the cost model's all_reduce row for one
        int32: ``2 (n-1)`` elements sent)."""
        n = len(members)
        if not self.enabled or n < 2 or not dist.is_initialized():
            return 0, 0
        return self._flags * 2 * (n - 1) * 4, self._flags

    def agree(self, members: tuple[int, ...], *, ok: bool) -> bool:
        """Whether every rank of ``members`` finished its step: a rank that cannot reach the
        others counts as failed. A rank that failed only tells the others, and waits for them
        briefly (:data:`FAILURE_NOTICE`): whether it reaches them or not, none of them commits,
        since success needs every rank's flag."""
        if not self.enabled or len(members) < 2 or not dist.is_initialized():
            return ok
        if self._flag is None:
            self._flag = torch.empty(1, dtype=torch.int32, device=default_device())
        flag = self._flag.fill_(1 if ok else 0)
        wait = self.timeout if ok else min(self.timeout, FAILURE_NOTICE)
        started = time.perf_counter()
        try:
            group = ranks_group(members, timeout=self.timeout)
            agreed = collective("all_reduce", flag, len(members), "min", group, wait)
        except DistributedError:
            return False
        if stats.is_recording():
            n = len(members)
            stats.record(
                stats.CommRecord(
                    tensor=None,
                    step=0,
                    op="all_reduce",
                    axis=None,
                    ranks=members,
                    bytes_sent=2 * (n - 1) * 4,
                    planned_bytes=2 * (n - 1) * 4,
                    seconds=time.perf_counter() - started,
                )
            )
        return bool(agreed.item() == 1)
