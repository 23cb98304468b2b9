"""A plan compiled for one rank: what the rank does at every step, with its piece geometry.

Both executors run these moves: the distributed one (``runtime.execution.executor``) with real
collectives between ``send`` and ``finish``, the in-process one (``runtime.execution.simulate``) with
the collectives emulated over every rank's buffers. So the padding and trimming that the
simulator checks are the runtime's own.

Geometry follows the language's chunking rule through ``Layout.piece``. Within one group of
a step (the ranks that differ only on the step's mesh axis) every rank has the same piece
lengths on all dims but the moving one, so a group pads to its own chunk size
(``ceil(L / n)`` of the piece being split or joined), never more than the mesh-wide padded
size the cost model counts, and equal to it on the rank at coordinate 0.

A plan may change meshes at a ``point_to_point`` step (``runtime.comm.exchange``): the steps
before it run on the source mesh, the steps after it on the target mesh. A rank's program
has one entry per step: a :class:`CollectiveMove` for a step on a mesh the rank is in, an
:class:`~runtime.comm.exchange.RankExchange` for a point-to-point step it sends or receives in (or
sits next to), ``None`` where it takes no part.
"""

from __future__ import annotations

import functools
import math

import attrs
import torch

from planner.plans import Plan, Step
from runtime.comm.exchange import RankExchange, compile_exchange
from runtime.comm.groups import axis_ranks
from runtime.errors import ReshardError
from runtime.memory.buffers import Scratch
from runtime.memory.dtypes import torch_dtype
from runtime.memory.packing import blocks_fit, crop, pack, unpack, unpack_copies
from shardlang.layout import padded_length
from shardlang.mesh import RankGroup


@attrs.frozen
class CollectiveMove:
    """One rank's part in one step of a plan.

    ``before``/``after`` are the rank's piece shapes around the step; ``start`` is where the
    new piece begins inside the old one along ``step.dim`` (slice); ``block`` is the padded
    block the rank exchanges with each peer (collectives); ``members`` are the ranks of its
    group along the step's axis in coordinate order, ``position`` its own index there.
    """

    index: int
    step: Step
    members: RankGroup
    position: int
    before: tuple[int, ...]
    after: tuple[int, ...]
    start: int
    block: tuple[int, ...]

    @property
    def n(self) -> int:
        return len(self.members)

    @property
    def is_local(self) -> bool:
        """No communication: slice, partial, and any step on an axis of size 1."""
        return self.step.op in ("slice", "partial") or self.n == 1

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """The rank's piece after a local step (a view of ``x``, or zeros)."""
        if self.n == 1:
            return x
        if self.step.op == "slice":
            return x.narrow(self.step.dim, self.start, self.after[self.step.dim])
        # partial: sum keeps the value at coordinate 0 and zeros elsewhere; avg, max and
        # min keep the value everywhere (see runtime.memory.pieces.shard).
        if self.step.reduce_op == "sum" and self.position != 0:
            return torch.zeros_like(x, memory_format=torch.contiguous_format)
        return x

    def send(self, x: torch.Tensor, *, writable: bool, scratch: Scratch | None = None) -> torch.Tensor:
        """The flat, contiguous buffer this rank contributes to the collective: a view of ``x``
        where its blocks are runs of its memory (:meth:`send_blocks`), else its blocks packed
        into ``scratch``'s ``"send"`` buffer when given (kept between calls, ``runtime.memory.buffers``)
        or a new one. For all_reduce it is reduced in place: ``x`` itself when ``writable``,
        else a copy."""
        if self.step.op == "all_reduce":
            return (x.contiguous() if writable else x.clone(memory_format=torch.contiguous_format)).view(-1)
        blocks = self.send_blocks(x)
        if blocks is not None:
            return blocks.view(-1)
        numel = math.prod(self.blocks_shape)
        out = x.new_empty(numel) if scratch is None else scratch.take("send", numel, x.dtype, x.device)
        self.send_into(x, out)
        return out

    @property
    def chunk(self) -> int:
        """Elements this rank puts in the collective per peer (all_gather: in all; all_reduce:
        its whole piece), which every rank of its group shares."""
        return math.prod(self.before) if self.step.op == "all_reduce" else math.prod(self.block)

    def send_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Write this rank's contribution into ``out``, its part of a bucket buffer: ``[n,
        chunk]`` for reduce_scatter and all_to_all (one row per peer), ``[chunk]`` otherwise."""
        op, dim = self.step.op, self.step.dim
        if op == "all_gather":
            pack(x, dim, 1, self.block, out=out.view(1, *self.block))
        elif op == "reduce_scatter":
            pack(x, dim, self.n, self.block, out=out.view(self.n, *self.block))
        elif op == "all_to_all":
            pack(x, self.step.to_dim, self.n, self.block, out=out.view(self.n, *self.block))
        else:
            out.view(self.before).copy_(x)

    @functools.cached_property
    def blocks_shape(self) -> tuple[int, ...]:
        """The shape :meth:`send_blocks` gives this rank's contribution in."""
        if self.step.op == "all_gather":
            return (1, *self.block)
        if self.step.op in ("reduce_scatter", "all_to_all"):
            return (self.n, *self.block)
        return self.before

    @functools.cached_property
    def _unpadded(self) -> bool:
        """Whether a contiguous piece of shape ``before`` is its blocks as they lie in memory
        (:func:`~runtime.memory.packing.blocks_fit`), so that sending it is one copy."""
        if self.step.op == "all_reduce":
            return True
        dim = self.step.to_dim if self.step.op == "all_to_all" else self.step.dim
        return blocks_fit(self.before, dim, 1 if self.step.op == "all_gather" else self.n, self.block)

    def send_blocks(self, x: torch.Tensor) -> torch.Tensor | None:
        """This rank's contribution as a view of ``x`` (of shape ``before``), shaped as
        :meth:`send_into` writes it, when writing it is one copy (no padding, ``x`` contiguous;
        all_reduce: always); else ``None``."""
        if self.step.op == "all_reduce":
            return x
        if not self._unpadded or not x.is_contiguous():
            return None
        return x.view(self.blocks_shape)

    def finish(self, received: torch.Tensor) -> torch.Tensor:
        """The rank's piece after the step, from the collective's result: flat, or for
        all_gather and all_to_all a ``[n, chunk]`` part of a bucket's result."""
        op = self.step.op
        if op == "all_reduce":
            return received.view(self.after)
        if op == "reduce_scatter":
            return crop(received.view(self.block), self.after)
        return unpack(received.view(self.n, *self.block), self.step.dim, self.after)

    def finish_copies(self, received: torch.Tensor, out: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The copies (target view of ``out``; source view of ``received``) that write the
        rank's piece after the step into ``out`` straight from the collective's result, as
        :meth:`finish` gives it but without a copy between: views only, so that a bucket's copies
        can be made in one call. ``out`` has the shape ``after``, or is contiguous with as many
        elements (a parameter whose leg views the piece after the step in its own shape)."""
        if tuple(out.shape) != self.after:
            out = out.view(self.after)
        if self.step.op in ("all_gather", "all_to_all"):
            return unpack_copies(received.view(self.n, *self.block), self.step.dim, out)
        return [(out, self.finish(received))]


def _padded_block_shape(step: Step, before: tuple[int, ...], after: tuple[int, ...], n: int) -> tuple[int, ...]:
    block = list(before)
    if step.op == "all_gather":
        block[step.dim] = padded_length(after[step.dim], (n,))
    elif step.op == "reduce_scatter":
        block[step.dim] = padded_length(before[step.dim], (n,))
    elif step.op == "all_to_all":
        block[step.dim] = padded_length(after[step.dim], (n,))
        block[step.to_dim] = padded_length(before[step.to_dim], (n,))
    return tuple(block)


def check_reducible(plan: Plan) -> None:
    """A :class:`ReshardError` if the plan averages an integer tensor (no exact result), or
    takes a max or min of complex values (which have no order)."""
    dtype = torch_dtype(plan.dtype)
    if dtype.is_complex:
        ordered = [op for layout in (plan.src, plan.dst) for op in layout.partial_ops.values() if op in ("max", "min")]
        if ordered:
            raise ReshardError(
                f"complex values have no order: a '{ordered[0]}' partial of {plan.dtype} means nothing "
                f"({plan.src} -> {plan.dst})"
            )
    if not (dtype.is_floating_point or dtype.is_complex):
        for step in plan.steps:
            if step.reduce_op == "avg" and step.op != "partial":
                raise ReshardError(
                    f"cannot average a tensor of {plan.dtype} exactly ({plan.src} -> {plan.dst}); "
                    "use a sum and divide, or a float dtype"
                )


@functools.lru_cache(maxsize=4096)
def compile_plan(plan: Plan, rank: int) -> tuple[CollectiveMove | RankExchange | None, ...]:
    """``rank``'s part in every step of ``plan``, one entry per step (``None`` where the rank
    is not in the step's mesh)."""
    check_reducible(plan)
    layouts = plan.layouts()
    if not layouts[-1].mesh.same_geometry(plan.dst.mesh):
        raise ReshardError(
            f"the plan {plan.src} -> {plan.dst} ends on {layouts[-1].mesh.describe()}, not on the target's mesh; "
            "only a point_to_point step changes meshes"
        )
    moves: list[CollectiveMove | RankExchange | None] = []
    for index, step in enumerate(plan.steps):
        if step.op == "point_to_point":
            moves.append(compile_exchange(plan, index, rank))
            continue
        mesh = step.layout.mesh
        if not layouts[index].mesh.same_geometry(mesh):
            raise ReshardError(
                f"step {index + 1} of {len(plan.steps)} ({step.describe()}) goes from {layouts[index].mesh.describe()} "
                f"to {mesh.describe()}; only a point_to_point step changes meshes"
            )
        if rank not in mesh.ranks:
            moves.append(None)
            continue
        coordinate = mesh.coordinate(rank)
        old = layouts[index].piece(plan.shape, coordinate)
        new = step.layout.piece(plan.shape, coordinate)
        before, after = old.shape, new.shape
        members = axis_ranks(mesh, (step.axis,), rank)
        start = new[step.dim][0] - old[step.dim][0] if step.op == "slice" else 0
        moves.append(
            CollectiveMove(
                index=index,
                step=step,
                members=members,
                position=coordinate[step.axis],
                before=before,
                after=after,
                start=start,
                block=_padded_block_shape(step, before, after, len(members)),
            )
        )
    return tuple(moves)


def bytes_sent(move: CollectiveMove | RankExchange, itemsize: int) -> int:
    """Bytes this rank sends in the step: for a collective under the standard (ring)
    algorithms, counted from the buffers it really passes (the cost model's formulas applied to
    actual sizes); for a point-to-point step, the boxes it sends to other ranks."""
    if isinstance(move, RankExchange):
        return move.elements_sent * itemsize
    if move.is_local:
        return 0
    n = move.n
    if move.step.op == "all_reduce":
        return 2 * (n - 1) * padded_length(math.prod(move.before), (n,)) * itemsize
    return (n - 1) * math.prod(move.block) * itemsize
