"""Completing the small partial sums of an optimizer step in as few all-reduces as possible.

Every sum says over which mesh axes it is partial and along which axes its value is the same
on every rank (replicated). The sums of one phase that need the same process group travel in
one buffer, one all-reduce per group. A sum may also ride a larger group of its mesh when the
extra axes are ones its value is replicated along: the ranks at coordinate 0 on the extra
axes add the value, the others add zeros, and the result is the same. So a row normaliser
(partial over the row axes, replicated over the column axes) shares the all-reduce of the
per-matrix totals (partial over both).
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Sequence

import attrs
import torch

from planner.statistics import group_sums, phase_sums
from runtime.comm.collectives import collective
from runtime.comm.groups import axis_ranks, ranks_group
from runtime.errors import DistributedError
from runtime.measure.stats import CommRecord, is_recording, record
from runtime.memory.buffers import KeptViews, Scratch
from runtime.optim.flat import as_flat, pieces_of
from runtime.optim.shards import Axes, StateShard
from shardlang.mesh import Mesh


@attrs.frozen
class SumSpec:
    """A partial sum of ``numel`` elements of ``dtype``, over ``axes`` of ``mesh``, taken by
    the optimizer state of tensor ``owner``."""

    mesh: Mesh
    axes: Axes
    numel: int
    dtype: torch.dtype
    owner: str
    replicated: Axes = frozenset()


@attrs.frozen
class Collective:
    """One all-reduce: the group of ``mesh`` along ``axes``, and the sums it carries as
    ``(index into the phase's sums, masked)``; a masked sum is sent as zeros."""

    mesh: Mesh
    axes: tuple[int, ...]
    dtype: torch.dtype
    members: tuple[tuple[int, bool], ...]
    numel: int

    @property
    def group_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)

    @property
    def bytes(self) -> int:
        """Bytes sent per rank: the cost model's all_reduce row (``planner.cost``) applied
        to the whole group: ``2 (n-1) ceil(E/n) itemsize``."""
        n = self.group_size
        return 2 * (n - 1) * -(-self.numel // n) * self.dtype.itemsize


def plan_collectives(sums: Sequence[SumSpec], rank: int) -> tuple[Collective, ...]:
    """The all-reduces that complete ``sums`` on ``rank``, in an order every rank shares
    (``planner.statistics.group_sums``: the planner sizes their buffers by the same choice)."""
    return tuple(
        Collective(
            mesh=sums[members[0][0]].mesh,
            axes=axes,
            dtype=dtype,  # type: ignore[arg-type]
            members=tuple(members),
            numel=sum(sums[i].numel for i, _ in members),
        )
        for axes, dtype, members in group_sums(sums, rank)
    )


def phase_sum_specs(
    shard: StateShard, optimizer: str, dtype: torch.dtype, owner: str
) -> tuple[tuple[SumSpec, ...], ...]:
    """Per phase, the sums the math of ``optimizer`` (``came``, ``adafactor``) completes for a
    tensor's ``shard`` (``planner.statistics.phase_sums``), taken by tensor ``owner``."""
    mesh = shard.layout.mesh
    return tuple(
        tuple(
            SumSpec(mesh=mesh, axes=axes, numel=numel, dtype=dtype, owner=owner, replicated=replicated)
            for axes, numel, replicated in phase
        )
        for phase in phase_sums(shard, optimizer)
    )


class SumReducer:
    """Runs the all-reduces of :func:`plan_collectives` on the runtime's process groups
    (``runtime.comm.groups``) and collective layer (bounded waits), recording each in
    the runtime's communication log like any reshard collective."""

    def __init__(self, rank: int, timeout: datetime.timedelta) -> None:
        self.rank = rank
        self.timeout = timeout
        # Per phase, the last sums planned and their all-reduces, each with its ranks and the
        # tensors it serves: every step asks alike (the specs are the same objects).
        self._plans: dict[str, tuple[tuple[SumSpec, ...], tuple[Collective, ...], list]] = {}
        # Per phase and all-reduce, its buffer and the sums' views of it, kept between steps.
        self._buffers = Scratch()
        self._views = KeptViews()

    def reduced(self, phase: str) -> bool:
        """Whether it has completed sums of ``phase``, whose buffers it keeps
        (``planner.statistics.sum_buffer_bytes`` sizes them)."""
        return phase in self._plans

    def _planned(self, sums: Sequence[SumSpec], phase: str) -> tuple[tuple[Collective, ...], list]:
        key = tuple(sums)
        kept = self._plans.get(phase)
        if kept is None or kept[0] != key:
            collectives = plan_collectives(key, self.rank)
            routes = [
                (axis_ranks(c.mesh, c.axes, self.rank), sorted({key[i].owner for i, _ in c.members}))
                for c in collectives
            ]
            kept = self._plans[phase] = (key, collectives, routes)
        return kept[1], kept[2]

    def reduce(
        self, sums: Sequence[SumSpec], values: Sequence[torch.Tensor], phase: str
    ) -> tuple[list[torch.Tensor], tuple[Collective, ...]]:
        """``values`` completed (sums that need no communication come back as they are; the
        others as views of a buffer kept for the next step, valid until then), and the
        all-reduces that did it."""
        out = list(values)
        collectives, routes = self._planned(sums, phase)
        for k, (c, (ranks, owners)) in enumerate(zip(collectives, routes, strict=True)):
            shapes = tuple(values[i].shape for i, _ in c.members)
            first = values[c.members[0][0]]
            buffer = self._buffers.take(f"{phase} {k}", sum(math.prod(s) for s in shapes), c.dtype, first.device)
            views = self._views.get((phase, k), (buffer.data_ptr(), shapes), pieces_of, buffer, shapes)
            if any(masked for _, masked in c.members):
                buffer.zero_()
            sent = [(view, values[i]) for (i, masked), view in zip(c.members, views, strict=True) if not masked]
            # Values that lie one after another in their memory (a run's per-tensor sums
            # computed into one buffer) go in one copy, not one per value.
            flat = as_flat([value for _, value in sent])
            if flat is not None and flat.numel() == buffer.numel():
                buffer.copy_(flat)
            else:
                torch._foreach_copy_([view for view, _ in sent], [value for _, value in sent])
            started = time.perf_counter()
            try:
                group = ranks_group(ranks, timeout=self.timeout)
                buffer = collective("all_reduce", buffer, c.group_size, "sum", group, self.timeout)
            except DistributedError as e:
                axes = ",".join(c.mesh.axis_label(a) for a in c.axes)
                raise DistributedError(
                    f"the all-reduce of {phase} over mesh axes ({axes}) of {c.mesh.describe()}, for tensors "
                    f"{', '.join(repr(o) for o in owners)}: {e.message}"
                ) from e
            if is_recording():
                record(
                    CommRecord(
                        tensor=",".join(owners),
                        step=0,
                        op="all_reduce",
                        axis=c.axes[0],
                        ranks=ranks,
                        bytes_sent=c.bytes,
                        planned_bytes=c.bytes,
                        seconds=time.perf_counter() - started,
                    )
                )
            for (i, _), view in zip(c.members, views, strict=True):
                out[i] = view
        return out, collectives
