"""Declared replication, checked where an optimizer's inputs come in (``verify_replicas=``):
the parameters when the optimizer is built, the parameters and the states held in replicated
layouts after ``load_state_dict``, the gradients declared replicated at the first step (and
every N-th with ``verify_replicas=N``). Each check is ``runtime.comm.replicas.verify_replicas``:
one pass over the pieces and a few bytes of collectives, raising ``ReplicaMismatchError`` on
every rank involved before anything changes (docs/design/failures.md, "Replicas")."""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from runtime.comm.replicas import GRADIENTS_CAUSE, PARAMETERS_CAUSE, verify_replicas
from runtime.optim.errors import OptimizerError
from runtime.optim.slots import Slot, Slots
from shardlang.layout import Layout

STATES_CAUSE = (
    "the ranks loaded different optimizer states for the same replicated piece: load every rank's "
    "state dict from the same checkpoint"
)


def replica_checks_every(value: object) -> int | None:
    """``verify_replicas=`` as how often gradients are checked after the first step: ``True``
    (the default) -> 0 (the first step only), ``False`` or ``None`` -> None (no check at all),
    N >= 1 -> every N-th step too."""
    if value is None or value is False:
        return None
    if value is True:
        return 0
    if isinstance(value, int) and value >= 1:
        return value
    raise OptimizerError(f"verify_replicas must be True, False or a number of steps >= 1, got {value!r}")


class ReplicaChecks:
    """The replica checks of one optimizer's ``slots``; ``every``: as
    :func:`replica_checks_every` returns (None: checks nothing)."""

    def __init__(self, slots: Slots, *, rank: int, timeout: datetime.timedelta, every: int | None) -> None:
        self._slots, self.rank, self.timeout, self.every = slots, rank, timeout, every
        self._grad_steps = 0  # steps whose gradients this optimizer checked (or took unchecked)

    @property
    def enabled(self) -> bool:
        return self.every is not None and dist.is_initialized() and dist.get_world_size() > 1

    def parameters(self, slots: Sequence[Slot] | None = None) -> None:
        """The ranks of every replicated axis of a parameter's layout hold the same values."""
        if not self.enabled:
            return
        pieces = [(s.name, s.local_param(), s.param_layout) for s in (self._slots if slots is None else slots)]
        self._verify(pieces, "parameters", PARAMETERS_CAUSE)

    def states(self, pieces: list[tuple[str, torch.Tensor, Layout]]) -> None:
        """The states to load (``(tensor.state, piece, layout)``, in the slots' order on every
        rank) agree where their layouts are replicated: checked before any is written
        (``StateStore.load_state_dict``), with the parameters."""
        self.parameters()
        if self.enabled:
            self._verify(pieces, "optimizer states", STATES_CAUSE)

    def gradients(self, slots: Sequence[Slot], grads: Sequence[tuple[torch.Tensor, Layout]], step: int) -> None:
        """At this optimizer's first step, and every ``every``-th after it: the gradients
        declared replicated agree. A gradient a bucket already took (``free_grads`` under
        overlap) is left out on this rank (``None``)."""
        if not self.enabled:
            return
        due = self._grad_steps == 0 or (self.every and self._grad_steps % self.every == 0)
        if due:
            pieces = [
                (slot.name, None if slot.taken is not None else grad, layout)
                for slot, (grad, layout) in zip(slots, grads, strict=True)
            ]
            self._verify(pieces, f"gradients of step {step}", GRADIENTS_CAUSE)
        self._grad_steps += 1

    def _verify(self, pieces: Sequence[tuple[str, torch.Tensor | None, Layout]], what: str, cause: str) -> None:
        verify_replicas(pieces, self.rank, what=what, cause=cause, timeout=self.timeout)
