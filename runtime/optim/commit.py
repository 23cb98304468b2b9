"""The commit point of a step: the flag the ranks agree on, what commits a staged step, and
what the last committed step did (docs/memory.md, "The commit point").

:class:`CommitFlag` is the one agreement of a step: one bounded all-reduce of a flag over the
ranks of the stepped tensors' meshes, so that every rank commits or none does. The same
all-reduce carries a digest of what each rank is stepping (:class:`StepIdentity`: the step
number, every group's hyperparameters, the ``zero_grad()`` calls since the last step), so that
a rank with another learning rate, or one that skipped a ``step()``, is named on every rank and
nothing commits.
"""

from __future__ import annotations

import datetime
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from runtime.comm.collectives import collective, default_device
from runtime.comm.groups import ranks_group
from runtime.errors import DistributedError
from runtime.measure import stats
from runtime.optim.records import StepTraffic
from runtime.optim.slots import ranks_text

if TYPE_CHECKING:
    from runtime.optim.slots import Slot

# How long a rank whose step failed waits to tell the others (see CommitFlag.agree).
FAILURE_NOTICE = datetime.timedelta(seconds=2)
# The flag, the digest and its negation: an all-reduce with min gives every rank the lowest
# flag and the lowest and highest digest.
FLAG_ELEMENTS = 3
_MASK = (1 << 62) - 1
# What a param group holds that is not a hyperparameter (the names are checked with the plan).
_NOT_HYPER = ("params", "param_names")


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


class StepIdentity:
    """What every rank must agree it is stepping: the step number of the tensors stepped, every
    param group's hyperparameters (``param_groups``: the optimizer's own list, read at each
    step), and how many times ``zero_grad()`` ran since the last step agreed on (``zero_grads``,
    counted by the optimizer): a rank that skipped a ``step()`` but not its ``zero_grad()``
    pairs its next step with the others' and is caught by that count."""

    def __init__(self, param_groups: Sequence[Mapping[str, Any]]) -> None:
        self._groups = param_groups
        self.zero_grads = 0

    def of(self, slots: Sequence[Slot]) -> dict[str, Any]:
        steps = [s.step for s in slots]
        groups = [{k: _value(v) for k, v in g.items() if k not in _NOT_HYPER} for g in self._groups]
        return {"step": (min(steps) + 1, max(steps) + 1), "zero_grad": self.zero_grads, "groups": groups}


def _value(value: Any) -> Any:
    """A hyperparameter as compared: a small tensor by its values (an ``lr`` tensor)."""
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.numel() <= 8 else (tuple(value.shape), str(value.dtype))
    return value


def _digest(summary: Mapping[str, Any]) -> int:
    """A 62-bit digest of a step's identity (floats by their exact repr)."""
    return int.from_bytes(hashlib.blake2b(repr(summary).encode(), digest_size=8).digest(), "little") & _MASK


def disagreement(members: Sequence[int], summaries: Sequence[Mapping[str, Any]]) -> str:
    """The error of ranks that step different things: the ranks that differ from the most
    common identity, with what differs."""
    counts: dict[str, int] = {}
    for summary in summaries:
        counts[repr(summary)] = counts.get(repr(summary), 0) + 1
    common = next(s for s in summaries if counts[repr(s)] == max(counts.values()))
    lines = []
    for rank, summary in zip(members, summaries, strict=True):
        if summary == common:
            continue
        what = []
        if summary["step"] != common["step"]:
            what.append(f"runs step {_steps(summary['step'])} (the others {_steps(common['step'])})")
        if summary["zero_grad"] != common["zero_grad"]:
            what.append(
                f"called zero_grad() {summary['zero_grad']} times since the last step (the others "
                f"{common['zero_grad']}): it skipped a step() (or zeroed its gradients on its own)"
            )
        if len(summary["groups"]) != len(common["groups"]):
            what.append(f"has {len(summary['groups'])} param groups (the others {len(common['groups'])})")
        else:
            for i, (mine, theirs) in enumerate(zip(summary["groups"], common["groups"], strict=True)):
                for key in sorted(set(mine) | set(theirs), key=str):
                    if mine.get(key) != theirs.get(key):
                        what.append(f"has {key}={mine.get(key)!r} in group {i} (the others {theirs.get(key)!r})")
        lines.append(f"rank {rank} " + ", ".join(what))
    return "; ".join(lines)


def _steps(steps: tuple[int, int]) -> str:
    return str(steps[0]) if steps[0] == steps[1] else f"{steps[0]}..{steps[1]}"


class CommitFlag:
    """The commit point: one bounded all-reduce of a flag over the ranks of the meshes of the
    tensors stepped (``all_ranks_commit``), ``flags`` per step (2 for an update in place: one
    before its math, one after it)."""

    def __init__(
        self, *, timeout: datetime.timedelta, enabled: bool, flags: int, identity: StepIdentity | None = None
    ) -> None:
        self.timeout, self.enabled, self._flags, self.identity = timeout, enabled, flags, identity
        self._flag: torch.Tensor | None = None  # reduced in place
        # Why the last agreement failed, where the ranks told it (they step different things).
        self.why: str | None = None

    def traffic(self, members: Sequence[int]) -> tuple[int, int]:
        """Bytes and collectives of a step's flags (the cost model's all_reduce row for
        :data:`FLAG_ELEMENTS` int64: ``2 (n-1)`` times that sent)."""
        n = len(members)
        if not self.enabled or n < 2 or not dist.is_initialized():
            return 0, 0
        return self._flags * 2 * (n - 1) * 8 * FLAG_ELEMENTS, self._flags

    def agree(self, members: tuple[int, ...], *, ok: bool, slots: Sequence[Slot] | None = None) -> bool:
        """Whether every rank of ``members`` finished its step: a rank that cannot reach the
        others counts as failed. A rank that failed only tells the others, and waits for them
        briefly (:data:`FAILURE_NOTICE`): whether it reaches them or not, none of them commits,
        since success needs every rank's flag. With ``slots`` (the step's first flag) every
        rank must also step the same :class:`StepIdentity`, or none commits and :attr:`why`
        names the ranks that differ."""
        self.why = None
        if not self.enabled or len(members) < 2 or not dist.is_initialized():
            return ok
        if self._flag is None:
            self._flag = torch.empty(FLAG_ELEMENTS, dtype=torch.int64, device=default_device())
        summary = self.identity.of(slots) if self.identity is not None and slots else None
        digest = 0 if summary is None else _digest(summary)
        flag = self._flag.copy_(torch.tensor([1 if ok else 0, digest, -digest], dtype=torch.int64))
        wait = self.timeout if ok else min(self.timeout, FAILURE_NOTICE)
        started = time.perf_counter()
        try:
            group = ranks_group(members, timeout=self.timeout)
            agreed = collective("all_reduce", flag, len(members), "min", group, wait).tolist()
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
                    bytes_sent=2 * (n - 1) * 8 * FLAG_ELEMENTS,
                    planned_bytes=2 * (n - 1) * 8 * FLAG_ELEMENTS,
                    seconds=time.perf_counter() - started,
                )
            )
        if agreed[0] != 1:
            return False
        if agreed[1] != -agreed[2]:  # the lowest digest is not the highest
            self.why = self._named(members, group, summary)
            return False
        if self.identity is not None and summary is not None:
            self.identity.zero_grads = 0
        return True

    def _named(self, members: tuple[int, ...], group: Any, summary: dict[str, Any] | None) -> str:
        """Only where the digests differ (every rank sees it): the ranks exchange what they
        step and name those that differ."""
        summaries: list[Any] = [None] * len(members)
        try:
            dist.all_gather_object(summaries, summary, group=group)
        except (RuntimeError, ValueError) as e:
            return f"was refused: the ranks {ranks_text(members)} step different things (naming them failed: {e})"
        refused = f"was refused: the ranks {ranks_text(members)} step different things"
        if any(s is None for s in summaries):
            return refused
        return f"{refused}: {disagreement(members, summaries)}"
