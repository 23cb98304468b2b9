"""A step plan (``planner.step``) compiled for one rank: its legs' moves, its buckets' members and
offsets, and where every bucket's buffers lie (:func:`compile_step`); ``runtime.execution.buckets`` runs it.

A bucket of point-to-point moves (Muon's matrix moves to and from their owners) has no buffers of
its own: its members' ``RankExchange`` run as one ``runtime.execution.run.Exchange``. A
collective bucket's buffer is laid out peer-major: for a reduce_scatter or all_to_all over ``n`` ranks it
is ``[n, sum of chunks]``, row ``p`` holding every member's block for peer ``p`` one after
another; for an all_gather or all_reduce it is the members' pieces one after another. Ranks of
one group hold the same chunk sizes (``runtime.execution.program``), so their buffers agree. Where the
buffers lie, and what shares space with what, is :func:`planner.buffers.lay_out`'s (docs/memory.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import attrs
import torch

from planner.buffers import BucketUse, lay_out, shares_after
from planner.legs import Bucket, Leg
from planner.step import StepPlan
from runtime.comm.exchange import RankExchange
from runtime.errors import ReshardError
from runtime.execution.program import CollectiveMove, compile_plan
from runtime.execution.run import Entry
from runtime.memory.buffers import KeptViews
from runtime.memory.dtypes import dtype_name, torch_dtype


@attrs.frozen(eq=False)
class LegProgram:
    """A leg as one rank runs it: its moves per hop, and the shape and dtype of the piece it
    starts from. ``schedule`` is the leg's walk in order (``runtime.execution.run.LegWalk``): per
    step the view its hop starts with (on the hop's first step), its move and whether that is
    local; a hop of no steps is an entry of its view alone (no move, local). ``positions`` maps
    (hop, step) to the step's entry."""

    leg: Leg
    moves: tuple[tuple[CollectiveMove | RankExchange | None, ...], ...]
    source_shape: tuple[int, ...] | None  # None: the rank holds no piece (off the source mesh)
    dtype: torch.dtype  # the leg's, as torch names it
    schedule: tuple[Entry, ...]
    positions: Mapping[tuple[int, int], int]

    def label(self) -> str:
        """The leg in errors (``LegWalk``'s ``label``)."""
        return f"{self.leg.what} of tensor '{self.leg.tensor}'"

    def viewed_as_its_piece(self, x: torch.Tensor | None) -> bool:
        """Whether ``x`` becomes the leg's piece by the view its first hop starts with (a joined
        block, flat, into the matrix it is: ``planner.matrices``)."""
        view = self.schedule[0][0]
        shape = self.source_shape
        return (
            x is not None
            and view is not None
            and shape is not None
            and x.dtype == self.dtype
            and x.numel() == math.prod(shape) == math.prod(view)
        )

    def wrong_piece(self, x: torch.Tensor | None, rank: int) -> ReshardError:
        """The error of an input that is not the piece the leg starts from on ``rank``."""
        leg = self.leg
        source = leg.hops[0].plan
        held = "no piece" if x is None else f"a piece of {dtype_name(x.dtype)} {list(x.shape)}"
        if self.source_shape is None:
            given = f"'{source.src}' gives it none (it is not in {source.src.mesh.describe()})"
        else:
            given = f"'{source.src}' gives it {leg.dtype} {list(self.source_shape)} of {list(source.shape)}"
        return ReshardError(f"{self.label()}: rank {rank} holds {held}, but {given}")


@attrs.frozen(eq=False)
class BucketProgram:
    """A bucket as one rank runs it: per member its leg, move, chunk and offset in each peer's
    part of the buffer, and the buffer's per-peer length."""

    index: int
    bucket: Bucket
    # (leg, move, chunk, offset); of an exchange bucket (point-to-point moves) its members'
    # RankExchange (None where this rank takes no part), chunk and offset 0.
    members: tuple[tuple[int, CollectiveMove, int, int], ...]
    total: int
    per_peer: bool  # the send buffer has one row per peer (reduce_scatter, all_to_all)
    final: tuple[bool, ...]  # per member: its step is the last move of its leg (views may follow)
    positions: tuple[int, ...]  # per member: its step's entry in its leg's schedule
    # Where its result (and gloo's reduce_scatter workspace) lie in the kept buffer of its
    # dtype: (offset, elements); see :func:`_lay_out`.
    result: tuple[int, int] = (0, 0)
    workspace: tuple[int, int] | None = None
    send: int = 0  # where its send buffer starts in the shared one

    @property
    def send_numel(self) -> int:
        """Elements of the send buffer: a row per peer of ``total``, or one row."""
        return (self.members[0][1].n if self.per_peer else 1) * self.total

    def send_parts(self, send: torch.Tensor) -> list[torch.Tensor]:
        """Per member its part of the bucket's send buffer (``[n, total]`` or ``[total]``),
        shaped as its blocks (``CollectiveMove.blocks_shape``)."""
        parts = []
        for _, move, chunk, offset in self.members:
            part = send[:, offset : offset + chunk] if self.per_peer else send[offset : offset + chunk]
            parts.append(part.view(move.blocks_shape))
        return parts

    def result_parts(self, received: torch.Tensor) -> list[torch.Tensor]:
        """Per member its part of the bucket's result: of an all_gather or all_to_all the
        ``[n, chunk]`` columns, otherwise the piece after the step (``CollectiveMove.finish``,
        a view)."""
        if self.bucket.op in ("all_gather", "all_to_all"):
            gathered = received.view(self.members[0][1].n, self.total)
            return [gathered[:, offset : offset + chunk] for _, _, chunk, offset in self.members]
        return [move.finish(received[offset : offset + chunk]) for _, move, chunk, offset in self.members]


@attrs.frozen(eq=False)
class StepProgram:
    """A step plan compiled for one rank: built once per plan, as ``compile_plan`` is for a
    plan, so that the step itself only moves data."""

    plan: StepPlan
    rank: int
    legs: tuple[LegProgram, ...]
    buckets: tuple[BucketProgram, ...]
    # Per wire dtype: elements of the shared send buffer and of the kept buffer.
    send_numel: Mapping[str, int] = attrs.field(factory=dict)
    kept_numel: Mapping[str, int] = attrs.field(factory=dict)
    # Per leg whose first entry is a bucket's step: (bucket, member) (:meth:`StageRun.places`).
    opened_by: Mapping[int, tuple[int, int]] = attrs.field(factory=dict)
    # Views of the kept buffers that every step makes alike (:meth:`StageRun._memo`).
    views: KeptViews = attrs.field(factory=KeptViews, repr=False)
    # The buckets after the update launched in step() share one result region: the stage must
    # run with StageRun's ``write_to`` (compile_step's ``write_through``).
    shared_after: bool = False
    # Per stage, its buckets in order (:meth:`in_stage`: made once, not by every run).
    _by_stage: dict[str, tuple[BucketProgram, ...]] = attrs.field(factory=dict, init=False, repr=False)

    def in_stage(self, stage: str) -> tuple[BucketProgram, ...]:
        """The buckets of ``stage``, in the program's order."""
        found = self._by_stage.get(stage)
        if found is None:
            found = self._by_stage[stage] = tuple(b for b in self.buckets if b.bucket.stage == stage)
        return found


def compile_step(plan: StepPlan, rank: int, *, write_through: bool = False) -> StepProgram:
    """``rank``'s part of every leg and bucket of ``plan``. ``write_through``: the caller runs
    the stage after the update with :class:`StageRun`'s ``write_to`` (every result written where
    it is kept as soon as its bucket lands), so its buckets launched in ``step()`` may share one
    result region (:func:`_lay_out`)."""
    legs = []
    for leg in plan.legs:
        source = leg.hops[0].plan
        moves = tuple(compile_plan(hop.plan, rank) for hop in leg.hops)
        legs.append(
            LegProgram(
                leg,
                moves,
                source.src.rank_piece(source.shape, rank).shape if rank in source.src.mesh.ranks else None,
                torch_dtype(leg.dtype),
                *_schedule(leg, moves),
            )
        )
    buckets, opened_by = [], {}
    for index, bucket in enumerate(plan.buckets):
        members, final, offset = [], [], 0
        positions = tuple(legs[m.leg].positions[(m.hop, m.step)] for m in bucket.members)
        for m, position in zip(bucket.members, positions, strict=True):
            if position == 0:
                opened_by[m.leg] = (index, len(members))
            final.append(all(later is None for _, later, _ in legs[m.leg].schedule[position + 1 :]))
            move = legs[m.leg].moves[m.hop][m.step]
            if bucket.op == "point_to_point":  # an exchange: no buffers of the bucket's own
                if move is not None and not isinstance(move, RankExchange):
                    leg = plan.legs[m.leg]
                    raise ReshardError(f"{leg.what} of tensor '{leg.tensor}' has a collective in an exchange bucket")
                members.append((m.leg, move, 0, 0))  # type: ignore[arg-type]  # None: no part in it
                continue
            if not isinstance(move, CollectiveMove):
                what = (
                    "a point-to-point step" if isinstance(move, RankExchange) else "a step on a mesh without this rank"
                )
                leg = plan.legs[m.leg]
                raise ReshardError(f"{leg.what} of tensor '{leg.tensor}' has {what}: not run in a step plan")
            members.append((m.leg, move, move.chunk, offset))
            offset += move.chunk
        per_peer = bucket.op in ("reduce_scatter", "all_to_all")
        buckets.append(BucketProgram(index, bucket, tuple(members), offset, per_peer, tuple(final), positions))
    shared = write_through and shares_after(plan)
    laid, send_numel, kept_numel = _lay_out(buckets, shared_after=shared)
    return StepProgram(plan, rank, tuple(legs), tuple(laid), send_numel, kept_numel, opened_by, shared_after=shared)


def _schedule(
    leg: Leg, moves: Sequence[Sequence[CollectiveMove | RankExchange | None]]
) -> tuple[tuple[Entry, ...], dict[tuple[int, int], int]]:
    """A leg's ``schedule`` and ``positions`` (:class:`LegProgram`)."""
    entries: list[Entry] = []
    positions: dict[tuple[int, int], int] = {}
    for h, (hop, hop_moves) in enumerate(zip(leg.hops, moves, strict=True)):
        if not hop_moves:
            entries.append((hop.view, None, True))
        for k, move in enumerate(hop_moves):
            positions[(h, k)] = len(entries)
            local = move is None or (isinstance(move, CollectiveMove) and move.is_local)  # None: not on its mesh
            entries.append((hop.view if k == 0 else None, move, local))
    return tuple(entries), positions


def _lay_out(
    buckets: Sequence[BucketProgram], *, shared_after: bool = False
) -> tuple[list[BucketProgram], dict[str, int], dict[str, int]]:
    """Every bucket placed in the kept and send buffers of its wire dtype, and per dtype their
    elements: :func:`planner.buffers.lay_out`'s placement (the one the planner's memory
    predictions size), applied to this rank's chunks."""
    uses = [
        BucketUse(b.index, b.bucket.op, b.bucket.stage, b.bucket.launch, b.bucket.dtype, _peers(b), b.total)
        for b in buckets
    ]
    layout = lay_out(uses, shared_after=shared_after)
    laid = [
        b if b.index not in layout.places else attrs.evolve(b, **attrs.asdict(layout.places[b.index], recurse=False))
        for b in buckets
    ]
    laid.sort(key=lambda b: b.index)
    return laid, layout.send_numel, layout.kept_numel


def _peers(bucket: BucketProgram) -> int:
    """The size of a collective bucket's axis (1 for an exchange, which lays out nothing)."""
    return 1 if bucket.bucket.op == "point_to_point" else bucket.members[0][1].n
