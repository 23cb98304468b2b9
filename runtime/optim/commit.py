"""The commit point of a step: the flag the ranks agree on, what commits a staged step, and
what the last committed step did (docs/memory.md, "The commit point").

:class:`CommitFlag` is the one agreement of a step: one bounded all-reduce of a flag over the
ranks of the stepped tensors' meshes, so that every rank commits or none does. The same
all-reduce carries a digest of what each rank is stepping (:class:`StepIdentity`: the step
number, every group's hyperparameters, the ``zero_grad()`` calls since the last step), so that
a rank with another learning rate, or one that skipped a ``step()``, is named on every rank and
nothing commits; and, where it can, the check of the gradients declared replicated
(``runtime.optim.replica_checks``: a digest and its negation per class of replicas), so that
the check costs no collective of its own (docs/design/failures.md, "Replicas").
"""

from __future__ import annotations

import datetime
import hashlib
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from runtime.comm.collectives import PendingCollective, collective, default_device, start_collective
from runtime.comm.groups import ranks_group
from runtime.errors import DistributedError
from runtime.measure import stats
from runtime.optim.records import StepTraffic
from runtime.optim.slots import ranks_text

if TYPE_CHECKING:
    from runtime.optim.replica_checks import ReplicaChecks
    from runtime.optim.slots import Slot

# How long a rank whose step failed waits to tell the others (see CommitFlag.agree).
FAILURE_NOTICE = datetime.timedelta(seconds=2)
# The flag, the digest and its negation: an all-reduce with min gives every rank the lowest
# flag and the lowest and highest digest. The step's first flag carries the gradients' replica
# check after them (ReplicaChecks.flag_elements more).
FLAG_ELEMENTS = 3
# The flag's values, the lowest wins: the stage failed; it ran but its gradients hold a NaN or
# an inf; it ran.
FAILED, NONFINITE, READY = 0, 1, 2
_MASK = (1 << 62) - 1
# What a param group holds that is not a hyperparameter (the names are checked with the plan).
_NOT_HYPER = ("params", "param_names")


@attrs.frozen(eq=False)
class Finite:
    """Whether the gradients a rank steps are finite: ``ok``, a 0-d bool tensor on their device
    (the commit flag carries it), and ``names``, called only where some rank's are not: what
    this rank finds, ``(where, tensor, "NaN" or "inf")`` per gradient, ``where`` being
    ``"reduced"`` (as the step takes it, in its state layout) or ``"own"`` (this rank's own
    gradient, before the reduction, where the rank still holds it)."""

    ok: torch.Tensor
    names: Callable[[], list[tuple[str, str, str]]]


@attrs.frozen(eq=False)
class Staged:
    """A step run on this rank without changing anything: ``commit`` makes it take effect;
    ``abandon``, when another rank failed it, waits out the collectives it left in flight
    (``prefetch_params``' gathers), whose buffers the next step reuses; ``finite``: whether
    the gradients it steps are finite (None: not asked, a step skipped for them)."""

    commit: Callable[[], None]
    abandon: Callable[[], None] = lambda: None
    finite: Finite | None = None


@attrs.define
class LastStep:
    """What the last committed step did: its traffic, its gradients' norm (with
    ``max_grad_norm``, ``skip_nonfinite`` or ``clip_grad_norm_``), whether it was skipped for a
    NaN or inf in them, and the seconds it spent blocked on its buckets' collectives."""

    traffic: StepTraffic = attrs.field(factory=StepTraffic)
    grad_norm: torch.Tensor | None = None
    skipped: bool = False
    wait_seconds: float = 0.0


@attrs.define(eq=False)
class Agreement:
    """A flag posted and not yet waited on (:meth:`CommitFlag.post`): :meth:`agreed` waits for
    it (at most ``wait``, once) and says whether every rank of ``members`` was ready;
    ``pending`` is None where there is nothing to wait for (one rank, no flag), ``ok`` then the
    answer."""

    ok: bool
    members: tuple[int, ...]
    pending: PendingCollective | None = None
    wait: datetime.timedelta = datetime.timedelta(0)
    # Why the flag did not arrive (a peer died or timed out), where it did not: then no rank
    # can tell whether the others finished their step.
    missing: str | None = None

    def agreed(self) -> bool:
        if self.pending is None:
            return self.ok
        pending, self.pending = self.pending, None
        try:
            self.ok = int(pending.wait(self.wait)[0]) == READY
        except DistributedError as e:
            self.ok, self.missing = False, e.message
        return self.ok


class StepIdentity:
    """What every rank must agree it is stepping: the step number of the tensors stepped, every
    param group's hyperparameters (``param_groups``: the optimizer's own list, read at each
    step), how many times ``zero_grad()`` ran since the last step agreed on (``zero_grads``,
    counted by the optimizer), and how many backward passes made the gradients stepped: the
    most accumulations into one stepped tensor's gradient since the last step agreed on or
    ``zero_grad()``, counted by gradient hooks (:meth:`hook`). A rank that skipped a ``step()``
    but not its ``zero_grad()`` pairs its next step with the others' and is caught by the
    ``zero_grad()`` count; one that skipped both steps gradients of two backward passes where
    the others step one, and is caught by that count."""

    def __init__(self, param_groups: Sequence[Mapping[str, Any]]) -> None:
        self._groups = param_groups
        self.zero_grads = 0
        self.accumulated: dict[int, int] = {}  # per slot index (_count)

    def hook(self, slots: Sequence[Slot]) -> None:
        """Count the gradient accumulations of ``slots`` (a gradient set by hand, or by FSDP2's
        reduce-scatter, counts none: equal on every rank, as it should be)."""
        me = weakref.ref(self)  # the hooks outlive the optimizer: they keep nothing alive
        for slot in slots:
            param = slot.param
            if param.requires_grad and param.is_leaf:
                param.register_post_accumulate_grad_hook(partial(_count, me, slot.index))

    def fresh(self) -> None:
        """The gradients start afresh (``zero_grad()``, or a step agreed on)."""
        self.accumulated.clear()

    def of(self, slots: Sequence[Slot]) -> dict[str, Any]:
        steps = [s.step for s in slots]
        groups = [{k: _value(v) for k, v in g.items() if k not in _NOT_HYPER} for g in self._groups]
        backwards = max(self.accumulated.get(s.index, 0) for s in slots)
        return {
            "step": (min(steps) + 1, max(steps) + 1), "zero_grad": self.zero_grads, "backward": backwards,
            "groups": groups,
        }  # fmt: skip


def _count(identity: weakref.ref[StepIdentity], index: int, _: torch.Tensor) -> None:
    """A gradient hook: one more accumulation into slot ``index``'s gradient."""
    held = identity()
    if held is not None:
        held.accumulated[index] = held.accumulated.get(index, 0) + 1


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
        if summary["backward"] != common["backward"]:
            n = summary["backward"]
            what.append(
                f"ran {n} backward pass{'' if n == 1 else 'es'} into the gradients it steps (the others "
                f"{common['backward']}): a rank that skips a step() and its zero_grad() steps two iterations' "
                "gradients at its next step() (every rank must run as many backward passes per step)"
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


def nonfinite_text(told: Sequence[tuple[int | None, Sequence[tuple[str, str, str]] | None]]) -> str:
    """The error of a step whose gradients are not finite, from what each rank found
    (:attr:`Finite.names`; rank None: a step of this rank alone): each gradient with the ranks
    where it holds a NaN or inf, as stepped and, where known, before the reduction."""
    parts = []
    for where, lead in (("reduced", "the gradients hold NaN or inf: "), ("own", "before the reduction, ")):
        holders: dict[tuple[str, str], list[int | None]] = {}
        for rank, findings in told:
            for at, name, kind in findings or ():
                if at == where:
                    holders.setdefault((name, kind), []).append(rank)
        named = [f"'{name}' ({kind}{_on(ranks)})" for (name, kind), ranks in holders.items()]
        if named:
            more = f" and {len(named) - 5} more" if len(named) > 5 else ""
            parts.append(lead + ", ".join(named[:5]) + more)
    if not parts:
        parts.append("the gradients' norm or sums overflow, though no element is NaN or inf")
    return (
        "; ".join(parts) + ": pass skip_nonfinite=True to skip such steps (with a warning), or find where "
        "it comes from (a NaN loss, too high a learning rate)"
    )


def _on(ranks: Sequence[int | None]) -> str:
    known = [r for r in ranks if r is not None]
    if not known:
        return ""
    return f" on rank {known[0]}" if len(known) == 1 else f" on ranks {ranks_text(known)}"


def _steps(steps: tuple[int, int]) -> str:
    return str(steps[0]) if steps[0] == steps[1] else f"{steps[0]}..{steps[1]}"


class CommitFlag:
    """The commit point: one bounded all-reduce of a flag over the ranks of the meshes of the
    tensors stepped (``all_ranks_commit``), ``flags`` per step (2 for an update in place: one
    before its math, :meth:`agree`, and one after it, :meth:`post`, of the flag alone). With
    ``replicas``, the first flag of a step also compares the gradients declared replicated,
    where they can ride on it (:meth:`ReplicaChecks.flag_values`)."""

    def __init__(
        self,
        *,
        timeout: datetime.timedelta,
        enabled: bool,
        flags: int,
        identity: StepIdentity | None = None,
        replicas: ReplicaChecks | None = None,
    ) -> None:
        self.timeout, self.enabled, self._flags, self.identity = timeout, enabled, flags, identity
        self.replicas = replicas if enabled else None
        if self.replicas is not None:
            self.replicas.on_flag = True
        self._flag: torch.Tensor | None = None  # reduced in place
        self._posted: torch.Tensor | None = None  # the flag after the commit point, in flight till agreed
        # Why the last agreement failed, where the ranks told it (they step different things).
        self.why: str | None = None
        # The error of the last agreement refused for the replicas' check (ReplicaMismatchError
        # on every rank), to raise once the step is abandoned.
        self.refusal: DistributedError | None = None

    @property
    def flags(self) -> int:
        """Agreements per step: 2 for an update in place, else 1."""
        return self._flags

    def traffic(self, members: Sequence[int]) -> tuple[int, int]:
        """Bytes and collectives of a step's flags (the cost model's all_reduce row for
        :data:`FLAG_ELEMENTS` int64 and the replicas' on the first, one int64 on the second:
        ``2 (n-1)`` times that sent)."""
        n = len(members)
        if not self.enabled or n < 2 or not dist.is_initialized():
            return 0, 0
        return (FLAG_ELEMENTS + self._carried() + self._flags - 1) * 2 * (n - 1) * 8, self._flags

    def _carried(self) -> int:
        """The int64 the first flag of a step carries for the replicas' check."""
        return 0 if self.replicas is None else self.replicas.flag_elements()

    def agree(
        self,
        members: tuple[int, ...],
        *,
        ok: bool,
        slots: Sequence[Slot] | None = None,
        finite: Finite | None = None,
    ) -> bool:
        """Whether every rank of ``members`` finished its step: a rank that cannot reach the
        others counts as failed. A rank that failed only tells the others, and waits for them
        briefly (:data:`FAILURE_NOTICE`): whether it reaches them or not, none of them commits,
        since success needs every rank's flag. With ``slots`` (the step's first flag) every
        rank must also step the same :class:`StepIdentity`, and with ``finite`` hold finite
        gradients, or none commits and :attr:`why` says which ranks differ or which gradients
        are not finite. The first flag (``slots`` given, on a failed rank too) also carries the
        replicas' check: where the gradients declared replicated differ, none commits and
        :attr:`refusal` is the ``ReplicaMismatchError`` to raise."""
        self.why, self.refusal = None, None
        if not self.enabled or len(members) < 2 or not dist.is_initialized():
            if ok and finite is not None and not bool(finite.ok):
                self.why = f"was refused: {nonfinite_text([(None, finite.names())])}"
                return False
            return ok
        carried = self._carried() if slots is not None else 0
        size = FLAG_ELEMENTS + carried
        if self._flag is None:
            self._flag = torch.empty(FLAG_ELEMENTS, dtype=torch.int64, device=default_device())
        # With the replicas' check, a flag of this step only, not kept: what the optimizer holds
        # stays its memory report, to the 24 bytes of the kept flag.
        flag = self._flag if not carried else self._flag.new_empty(size)
        summary = self.identity.of(slots) if ok and self.identity is not None and slots else None
        digest = 0 if summary is None else _digest(summary)
        flag[:FLAG_ELEMENTS].copy_(torch.tensor([READY if ok else FAILED, digest, -digest], dtype=torch.int64))
        if carried:
            assert self.replicas is not None
            flag[FLAG_ELEMENTS:].copy_(self.replicas.flag_values(flag.device))
        if ok and finite is not None:  # on the gradients' device: read with the flag, no sync of its own
            flag[:1] -= finite.ok.logical_not().to(device=flag.device, dtype=torch.int64)
        wait = self.timeout if ok else min(self.timeout, FAILURE_NOTICE)
        started = time.perf_counter()
        try:
            group = ranks_group(members, timeout=self.timeout)
            agreed = collective("all_reduce", flag, len(members), "min", group, wait).tolist()
        except DistributedError:
            return False
        if stats.is_recording():
            _record(members, size, time.perf_counter() - started)
        if agreed[0] == FAILED:
            return False
        if agreed[0] == NONFINITE or agreed[1] != -agreed[2]:  # or the lowest digest is not the highest
            self.why = self._named(members, group, summary, finite)
            return False
        if carried:
            assert self.replicas is not None
            try:  # every rank sees every class: all run the check's own collectives, or none
                self.replicas.settle(agreed[FLAG_ELEMENTS:])
            except DistributedError as e:
                self.refusal = e
                return False
        if self.identity is not None and summary is not None:
            self.identity.zero_grads = 0
            self.identity.fresh()
        return True

    def post(self, members: tuple[int, ...], *, ok: bool) -> Agreement:
        """Start the all-reduce of a flag alone (the second, after the commit point) and return
        without waiting: the step's gathers are done, so the next step can start while it runs
        (docs/design/failures.md, "Where the commit point lies"). Waited on with
        :meth:`Agreement.agreed` before the next flag: at once by a rank that failed (bounded
        by :data:`FAILURE_NOTICE`), at their next step by the others."""
        if not self.enabled or len(members) < 2 or not dist.is_initialized():
            return Agreement(ok, members)
        if self._posted is None:
            self._posted = torch.empty(1, dtype=torch.int64, device=default_device())
        self._posted.fill_(READY if ok else FAILED)
        wait = self.timeout if ok else min(self.timeout, FAILURE_NOTICE)
        started = time.perf_counter()
        try:
            group = ranks_group(members, timeout=self.timeout)
            pending = start_collective("all_reduce", self._posted, len(members), "min", group)
        except DistributedError as e:
            return Agreement(False, members, missing=e.message)
        if stats.is_recording():  # a collective of this step, its seconds the posting's
            _record(members, 1, time.perf_counter() - started)
        return Agreement(ok, members, pending, wait)

    def _named(
        self, members: tuple[int, ...], group: Any, summary: dict[str, Any] | None, finite: Finite | None
    ) -> str:
        """Only where the digests differ or a gradient is not finite (every rank sees it): the
        ranks exchange what they step and what is not finite, and name it."""
        told: list[Any] = [None] * len(members)
        findings = None if finite is None else finite.names()
        try:
            dist.all_gather_object(told, (summary, findings), group=group)
        except (RuntimeError, ValueError) as e:
            return f"was refused: the ranks {ranks_text(members)} disagree (naming what failed: {e})"
        summaries = [s for s, _ in told]
        if any(s is None for s in summaries):
            return f"was refused: the ranks {ranks_text(members)} step different things"
        if any(s != summaries[0] for s in summaries):
            refused = f"was refused: the ranks {ranks_text(members)} step different things"
            return f"{refused}: {disagreement(members, summaries)}"
        return f"was refused: {nonfinite_text([(r, f) for r, (_, f) in zip(members, told, strict=True)])}"


def _record(members: Sequence[int], size: int, seconds: float) -> None:
    """A flag's all-reduce of ``size`` int64 in the collective records (``runtime.measure.stats``)."""
    n = len(members)
    sent = 2 * (n - 1) * 8 * size
    stats.record(
        stats.CommRecord(
            tensor=None, step=0, op="all_reduce", axis=None, ranks=tuple(members), bytes_sent=sent,
            planned_bytes=sent, seconds=seconds,
        )
    )  # fmt: skip
