"""What the ranks are given, checked where an optimizer's inputs come in.

The tensors' layouts (:func:`agree_on_layouts`, always): when parameters are given, the ranks of
every state mesh must hold the same tensors on it, of the same shapes and dtypes in the same
layouts, since the step's collectives are sized from them. Declared replication
(``verify_replicas=``): the parameters when the optimizer is built, the parameters and the
states held in replicated layouts after ``load_state_dict``, the gradients declared replicated
at the first step (and every N-th with ``verify_replicas=N``). Each replica check is
``runtime.comm.replicas.verify_replicas``: one pass over the pieces and a few bytes of
collectives, raising ``ReplicaMismatchError`` on every rank involved before anything changes
(docs/design/failures.md, "Replicas"). The gradients' check runs no collective of its own where
it can: two int64 per class of replicas ride on the step's first commit flag
(:meth:`ReplicaChecks.flag_values`, :meth:`ReplicaChecks.settle`), the collectives that name
what differs run only on a mismatch."""

from __future__ import annotations

import datetime
import hashlib
import math
from collections.abc import Sequence

import attrs
import torch
import torch.distributed as dist

from runtime.comm.collectives import collective, default_device
from runtime.comm.groups import ranks_group
from runtime.comm.replicas import (
    GRADIENTS_CAUSE,
    PARAMETERS_CAUSE,
    Held,
    compare,
    fingerprints,
    group_digest,
    verify_replicas,
)
from runtime.errors import DistributedError
from runtime.memory.dtypes import dtype_name
from runtime.optim.errors import OptimizerError
from runtime.optim.slots import Slot, Slots, ranks_text
from shardlang.interop import is_dtensor
from shardlang.layout import Layout
from shardlang.mesh import Mesh

STATES_CAUSE = (
    "the ranks loaded different optimizer states for the same replicated piece: load every rank's "
    "state dict from the same checkpoint"
)


# What a rank holds of a tensor that the step's collectives are sized from, as compared.
_FIELDS = ("dtype", "shape", "param", "grad", "state", "states kept apart", "flat axis", "math dtype")
_MASK = (1 << 62) - 1
# The most classes of replicas (sets of ranks that must hold equal gradients) whose check rides
# on the commit flag, two int64 each (1 KiB at most); more check with their own collectives.
FOLDED_CLASSES = 64
# What a rank puts on the flag for a class it holds nothing of: the MIN all-reduce's neutral.
_NEUTRAL = (1 << 63) - 1


def agree_on_layouts(slots: Sequence[Slot], timeout: datetime.timedelta) -> None:
    """The ranks of every state mesh hold the same tensors on it, of the same shapes and dtypes,
    in the same layouts: one all-reduce (min) of a digest and its negation per state mesh, in
    the meshes' order; only where they differ the ranks exchange what they hold, and every rank
    of that mesh raises :class:`OptimizerError` naming the tensors and ranks. So ranks given
    different specs or models fail when the parameters are given, with ``verify=False`` too,
    not at a collective of mismatched sizes (which gloo answers by aborting the process)."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return
    # Keyed by the meshes' ranks objects, which are equal (and hash alike) where the ranks
    # are: a run of ranks hashes in O(1), where a tuple of them per tensor walked them all.
    by_mesh: dict[Sequence[int], list[tuple[str, ...]]] = {}
    for slot in slots:
        if slot.shard is not None:
            by_mesh.setdefault(slot.state_layout.mesh.ranks, []).append(_held(slot))
    found = []
    for members in sorted(by_mesh):  # ordered as the tuples of their ranks, alike on every rank
        if len(members) < 2:
            continue
        held = by_mesh[members]
        digest = int.from_bytes(hashlib.blake2b(repr(held).encode(), digest_size=8).digest(), "little") & _MASK
        flag = torch.tensor([digest, -digest], dtype=torch.int64, device=default_device())
        try:
            group = ranks_group(members, timeout=timeout)
            agreed = collective("all_reduce", flag, len(members), "min", group, timeout).tolist()
            if agreed[0] != -agreed[1]:
                told: list[list[tuple[str, ...]] | None] = [None] * len(members)
                dist.all_gather_object(told, held, group=group)
                found.append(_differences(members, told))
        except (DistributedError, RuntimeError) as e:
            raise OptimizerError(
                f"the ranks {ranks_text(members)} could not compare their tensors' layouts: {e}"
            ) from None
    if found:
        raise OptimizerError(
            "; ".join(found) + ": give every rank the same spec and model (the step's collectives are sized from them)"
        )


def _held(slot: Slot) -> tuple[str, ...]:
    own = ", ".join(f"{k}: {lay}" for k, lay in sorted(slot.own_layouts.items()))
    grad = "its gradient's" if slot.grad_layout is None else str(slot.grad_layout)
    return (
        slot.name, dtype_name(slot.param.dtype), str(list(slot.shape)), str(slot.param_layout), grad,
        str(slot.state_layout), own or "none", str(slot.flat_axis), dtype_name(slot.dtype),
    )  # fmt: skip


def _differences(members: tuple[int, ...], told: Sequence[Sequence[tuple[str, ...]] | None]) -> str:
    """The tensors the ranks hold differently: per tensor, the ranks by what they hold of it."""
    names: dict[str, None] = {}
    per_rank = []
    for held in told:
        mine = {entry[0]: entry[1:] for entry in held or ()}
        per_rank.append(mine)
        names.update(dict.fromkeys(mine))
    lines = []
    for name in names:
        holders: dict[tuple[str, ...] | None, list[int]] = {}
        for rank, mine in zip(members, per_rank, strict=True):
            holders.setdefault(mine.get(name), []).append(rank)
        if len(holders) < 2:
            continue
        entries = [entry for entry in holders if entry is not None]
        differ = [i for i in range(len(_FIELDS)) if len({entry[i] for entry in entries}) > 1]
        sides = []
        for entry, ranks in holders.items():
            what = "not held" if entry is None else ", ".join(f"{_FIELDS[i]} {entry[i]}" for i in differ) or "held"
            sides.append(f"{what} on ranks {ranks_text(ranks)}")
        lines.append(f"'{name}': " + " vs ".join(sides))
    shown = "; ".join(lines[:5]) + (f"; and {len(lines) - 5} more" if len(lines) > 5 else "")
    return f"the ranks {ranks_text(members)} hold different tensors or layouts: {shown}"


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


@attrs.frozen
class _Fold:
    """Where the gradients' check rides on the commit flag: ``classes`` classes of replicas,
    this rank's class per group of replicas (``place``: keyed as :data:`Held`)."""

    classes: int
    place: dict[tuple[Mesh, tuple[int, ...]], int]


class ReplicaChecks:
    """The replica checks of one optimizer's ``slots``; ``every``: as
    :func:`replica_checks_every` returns (None: checks nothing)."""

    def __init__(self, slots: Slots, *, rank: int, timeout: datetime.timedelta, every: int | None) -> None:
        self._slots, self.rank, self.timeout, self.every = slots, rank, timeout, every
        self._grad_steps = 0  # steps whose gradients this optimizer checked (or took unchecked)
        # Set by the commit flag that carries the gradients' check (runtime.optim.commit).
        self.on_flag = False
        self._fold_of: tuple[int, _Fold | None] | None = None  # per number of slots (add_param_group)
        self._pending: tuple[Held, str] | None = None  # the fingerprints of a step due, to compare
        self._told: tuple[Held, str] | None = None  # those the last flag carried

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
        overlap) is left out on this rank (``None``). Where the check rides on the commit flag
        (:meth:`_fold`) the fingerprints are taken now and compared by the step's first flag
        (:meth:`flag_values`, :meth:`settle`); elsewhere now, with collectives of their own."""
        if not self.enabled:
            return
        due = self._grad_steps == 0 or (self.every and self._grad_steps % self.every == 0)
        if due:
            pieces = [
                (slot.name, None if slot.taken is not None else grad, layout)
                for slot, (grad, layout) in zip(slots, grads, strict=True)
            ]
            if self._fold() is not None:  # compared by the commit flag (flag_values, settle)
                self._pending = (fingerprints(pieces, self.rank), f"gradients of step {step}")
            else:
                self._verify(pieces, f"gradients of step {step}", GRADIENTS_CAUSE)
        self._grad_steps += 1

    def flag_elements(self) -> int:
        """The int64 the gradients' check adds to the step's first commit flag: two per class
        of replicas on every step, checked or not, so that the flag has one size on every rank
        whatever each one counts (0: checked with collectives of their own)."""
        fold = self._fold()
        return 0 if fold is None else 2 * fold.classes

    def flag_values(self, device: torch.device) -> torch.Tensor:
        """What this rank adds to the step's first flag (:meth:`flag_elements` int64), reduced
        with MIN: per class ``v`` and ``~v``, ``v`` the digest of the group's fingerprints
        (``runtime.comm.replicas.group_digest``) where this rank is of the class and its step is
        checked, the neutral ``INT64_MAX`` twice elsewhere. After the MIN, a class whose members
        all sent the same ``v`` holds ``v`` and ``~v``; one whose members differ holds
        ``min(v)`` and ``~max(v)`` (:meth:`settle`)."""
        fold = self._fold()
        assert fold is not None
        values = torch.full((2 * fold.classes,), _NEUTRAL, dtype=torch.int64, device=device)
        self._told, self._pending = self._pending, None
        if self._told is None:
            return values
        held = self._told[0]
        missing = [key for key in held if key not in fold.place]
        if missing:  # the layouts are the declared ones (_fold), on the mesh _fold placed
            raise OptimizerError(f"the gradients' replica check has no place on the commit flag for {missing}")
        if held:
            where = torch.tensor([2 * fold.place[key] for key in held], dtype=torch.int64, device=device)
            digests = torch.stack([group_digest(entries, device) for entries in held.values()])
            values[where] = digests
            values[where + 1] = torch.bitwise_not(digests)
        return values

    def settle(self, reduced: Sequence[int]) -> None:
        """After the flag's MIN (``reduced``: what :meth:`flag_values` added, reduced): where a
        class's members sent different digests (every rank sees every class, so all decide
        alike), every rank runs the check's own collectives on the fingerprints it sent, which
        name the tensors, axes and ranks (``runtime.comm.replicas.compare``), raising
        :class:`ReplicaMismatchError` on every rank; the step is then not counted, as when the
        check raised before the flag."""
        told, self._told = self._told, None
        pairs = zip(reduced[0::2], reduced[1::2], strict=True)
        if all(low == ~high_not or low == high_not == _NEUTRAL for low, high_not in pairs):
            return
        held, what = told if told is not None else ({}, "gradients")
        try:
            compare(held, self.rank, what=what, cause=GRADIENTS_CAUSE, timeout=self.timeout)
        except DistributedError:
            self._grad_steps -= 1
            raise

    def _fold(self) -> _Fold | None:
        """Where the gradients' check rides on the commit flag, or None where it cannot and
        runs its own collectives (docs/design/failures.md, "Replicas"): no commit flag
        (``all_ranks_commit=False``); a DTensor parameter, whose gradient's layout is known only
        at the step (each rank from its own DTensor), so the classes could differ between ranks;
        gradients or states on several meshes (the flag's ranks are those of the state meshes:
        a class must lie within them, and each rank must place the same classes); more than
        :data:`FOLDED_CLASSES` classes. The same on every rank: the layouts are declared and
        agreed on (:func:`agree_on_layouts`)."""
        if self._fold_of is None or self._fold_of[0] != len(self._slots):
            self._fold_of = (len(self._slots), self._placed() if self.on_flag and self.enabled else None)
        return self._fold_of[1]

    def _placed(self) -> _Fold | None:
        layouts = [slot.grad_layout for slot in self._slots]
        if not layouts or any(lay is None for lay in layouts) or any(is_dtensor(s.param) for s in self._slots):
            return None
        mesh = layouts[0].mesh  # type: ignore[union-attr]
        ranks = mesh.ranks  # runs of ranks: `in` and `==` cost nothing per rank (shardlang.mesh)
        if self.rank not in ranks or any(
            lay.mesh != mesh or s.state_layout.mesh.ranks != ranks  # type: ignore[union-attr]
            for s, lay in zip(self._slots, layouts, strict=True)
        ):
            return None
        place: dict[tuple[Mesh, tuple[int, ...]], int] = {}
        classes = 0
        coordinate = mesh.coordinate(self.rank)
        for layout in layouts:
            axes = layout.replicated_axes()  # type: ignore[union-attr]
            if (mesh, axes) in place or not any(mesh.shape[a] > 1 for a in axes):
                continue
            # This rank's class: its coordinate on the other axes, row-major.
            others = [a for a in range(mesh.ndim) if a not in axes]
            index = 0
            for a in others:
                index = index * mesh.shape[a] + coordinate[a]
            place[(mesh, axes)] = classes + index
            classes += math.prod(mesh.shape[a] for a in others)
            if classes > FOLDED_CLASSES:
                return None
        return _Fold(classes, place) if classes else None  # none: nothing to compare

    def _verify(self, pieces: Sequence[tuple[str, torch.Tensor | None, Layout]], what: str, cause: str) -> None:
        verify_replicas(pieces, self.rank, what=what, cause=cause, timeout=self.timeout)
