"""A step's legs (routes of one or two planned reshards) and the buckets that move them
together: the types, their JSON forms, and the bucketing of one stage (``planner.step`` plans
the legs of a whole step).

**Buckets.** Every communicating step of every leg is put in a bucket: steps that run the same
collective (op, reduce op) over the same process group (mesh and mesh axis) on the same wire
dtype share one collective, each tensor's per-peer chunk packed peer-major into one buffer (as
FSDP2's ``foreach_reduce`` and Megatron's grad buffers do). Buckets are scheduled per stage
(before, then after the update) and per mesh (meshes in one global order, so ranks in several
meshes never wait on each other in a cycle). Within a mesh, a leg's steps must run in order;
the schedule repeatedly takes the collective kind whose waiting legs have the most steps left
(a weighted majority merge, the usual heuristic for the shortest common supersequence of the
legs' step sequences; legs of one pattern take one bucket per step) and runs all legs waiting
on it. A bucket holds at most ``bucket_bytes`` of buffer per rank (see
:data:`DEFAULT_BUCKET_BYTES`); a kind with more is cut into several buckets, in leg order.
Point-to-point steps are never merged (each is its own bucket).

Modeled time of a bucket: the rounds of its collective times the axis latency, plus its bytes
over the axis bandwidth, plus the cost model's per-step executor overhead (``planner.cost``):
merging ``k`` steps saves ``k - 1`` latencies and overheads.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import attrs

from planner.cost import CostModel, collective_rounds
from planner.plans import Plan
from shardlang.errors import SourcePosition
from shardlang.layout import Layout
from shardlang.mesh import Mesh, StridedRanks

# Extra buffer memory a bucket may hold per rank. 32 MiB: under the default cost model (5 us a
# round, 100 GB/s) a bucket of this size on an axis of up to 8 ranks spends under 5% of its
# time in latency, so larger buckets gain little and cost memory linearly; DDP's 25 MB and
# Megatron's 40M-element buckets are of the same order (README, "Buckets").
DEFAULT_BUCKET_BYTES = 32 * 2**20
# With overlap a bucket starts when backward has finished its last gradient, and only the
# collectives started last are not hidden behind the rest of backward: smaller buckets start
# sooner and leave less exposed, at a latency per bucket (README, "Overlap").
DEFAULT_OVERLAP_BUCKET_BYTES = 4 * 2**20

BEFORE, AFTER = "before the update", "after the update"
STAGES = (BEFORE, AFTER)
# When a bucket's collective is started (README, "Overlap"): inside ``optimizer.step()``; during
# backward, once the last gradient it packs has been accumulated; after ``step()`` returned,
# waited on before the forward that reads the parameters it brings.
IN_STEP, DURING_BACKWARD, AFTER_STEP = "in step", "during backward", "after step"
LAUNCHES = (IN_STEP, DURING_BACKWARD, AFTER_STEP)


# Of few layouts, asked for every candidate suggest prices with flat states (its mesh built once).
@functools.lru_cache(maxsize=1024)
def flat_view(layout: Layout, axis: int, rank: int) -> tuple[Layout, Layout]:
    """The 1-d layouts of ``rank``'s flattened base block: as it arrives (partial over ``axis``
    when ``layout`` is, else replicated) and as the state holds it (split over ``axis``), on
    the mesh of the rank's flat group (:func:`flat_group`)."""
    mesh = flat_group(layout.mesh, axis, rank)
    partial = tuple((a, op) for a, op in layout.partial if a == axis)
    return Layout(dims=((),), mesh=mesh, partial=partial), Layout(dims=((axis,),), mesh=mesh)


def flat_group(mesh: Mesh, axis: int, rank: int) -> Mesh:
    """The ranks of ``mesh`` along ``axis`` through ``rank``, as a mesh of the same axes with
    every other axis of size 1 (``mesh`` itself when there are no others). Ranks that differ
    along an axis the base layout splits hold different blocks, so the 1-d view of a block is
    not replicated over that axis: on the whole mesh a plan could mix pieces of different
    blocks (e.g. slice over a fast ``tp``, reduce over ``dp``, gather over ``tp``). On this mesh
    the search sees ``axis`` alone (size-1 axes drop out) and axis numbers, hence cost figures,
    stay those of ``mesh``; every rank of the group plans the same."""
    if all(n == 1 for a, n in enumerate(mesh.shape) if a != axis):
        return mesh
    coordinate = list(mesh.coordinate(rank))
    coordinate[axis] = 0
    first = mesh.rank_at(tuple(coordinate))
    shape = tuple(n if a == axis else 1 for a, n in enumerate(mesh.shape))
    if isinstance(mesh.ranks, StridedRanks):
        # A run of ranks stays a run along any axis: O(1) however large the group is.
        stride = math.prod(mesh.shape[axis + 1 :]) * mesh.ranks.step
        return Mesh(shape=shape, ranks=StridedRanks(mesh.shape[axis], first, stride), axis_names=mesh.axis_names)
    ranks = []
    for k in range(mesh.shape[axis]):
        coordinate[axis] = k
        ranks.append(mesh.rank_at(tuple(coordinate)))
    return Mesh(shape=shape, ranks=tuple(ranks), axis_names=mesh.axis_names)


def without_axis(layout: Layout, axis: int) -> Layout:
    """``layout``'s dims with ``axis`` taken out (the base of flat sharding over ``axis``)."""
    return Layout(dims=tuple(tuple(a for a in axes if a != axis) for axes in layout.dims), mesh=layout.mesh)


@attrs.frozen
class StepTensor:
    """What the step plan needs of one tensor: its whole shape, layouts, dtypes (language
    names: ``f32``, ``bf16``), the states kept in a layout of their own, the flat axis (an
    index into the state mesh) and whether the step fetches the parameter's state-layout shard
    (no fp32 master yet). ``cost`` is the model its reshards are planned under."""

    name: str
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(x) for x in s))
    param: Layout
    grad: Layout
    state: Layout
    param_dtype: str = "f32"
    grad_dtype: str = "f32"
    state_dtype: str = "f32"
    own_states: tuple[tuple[str, Layout], ...] = ()
    flat_axis: int | None = None
    fetch_param: bool = True
    cost: CostModel = attrs.field(factory=CostModel)
    # Where a spec file declares the tensor (errors point there).
    position: SourcePosition | None = attrs.field(default=None, eq=False)

    @property
    def base(self) -> Layout:
        """The layout of the block the rank's state covers (flat: before it is cut)."""
        return self.state if self.flat_axis is None else without_axis(self.state, self.flat_axis)


@attrs.frozen
class Hop:
    """One planned reshard of a leg; ``view`` is the local shape the piece is viewed as before
    it (``None``: as it comes)."""

    plan: Plan
    view: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"view": None if self.view is None else list(self.view), "plan": self.plan.to_json()}


@attrs.frozen
class Leg:
    """One route of one tensor: ``what`` is ``grad -> state``, ``param -> state``,
    ``state.X -> state``, ``state -> state.X`` or ``state -> param``; ``dtype`` is what travels."""

    tensor: str
    what: str
    stage: str
    dtype: str
    hops: tuple[Hop, ...]

    @functools.cached_property  # read per stage of every choice suggest prices
    def communicating(self) -> tuple[tuple[int, int], ...]:
        """``(hop, step)`` of every step that communicates, in order."""
        return tuple(
            (h, k) for h, hop in enumerate(self.hops) for k, step in enumerate(hop.plan.steps) if _communicates(step)
        )

    @property
    def total_bytes(self) -> int:
        return sum(hop.plan.total_bytes for hop in self.hops)

    @property
    def total_seconds(self) -> float:
        return sum(hop.plan.total_seconds for hop in self.hops)

    def to_json(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "leg": self.what,
            "stage": self.stage,
            "dtype": self.dtype,
            "hops": [h.to_json() for h in self.hops],
        }


def _communicates(step: Any) -> bool:
    """A step that moves data between ranks: not local, and on an axis of more than one rank."""
    if step.op in ("slice", "partial"):
        return False
    return step.axis is None or step.layout.mesh.shape[step.axis] > 1


@attrs.frozen
class Member:
    """One step of one leg inside a bucket: ``leg`` indexes ``StepPlan.legs``."""

    leg: int
    hop: int
    step: int

    def to_json(self) -> dict[str, int]:
        return {"leg": self.leg, "hop": self.hop, "step": self.step}


@attrs.frozen
class Bucket:
    """One collective of the step: ``members`` are the leg steps it runs together, in the
    order their chunks lie in each peer's part of the buffer. ``bytes`` are sent per rank (the
    members' planned bytes), ``buffer_bytes`` the larger of the buffers a rank passes in or gets
    back, ``seconds`` the modeled time of the one collective."""

    stage: str
    op: str
    mesh: Mesh
    axis: int | None
    reduce_op: str | None
    dtype: str
    members: tuple[Member, ...]
    bytes: int
    buffer_bytes: int
    seconds: float
    launch: str = IN_STEP

    def describe(self) -> str:
        """``reduce_scatter(axis=dp, op=avg) f32``: the collective and its wire dtype."""
        args = [] if self.axis is None else [f"axis={self.mesh.axis_label(self.axis)}"]
        if self.reduce_op is not None:
            args.append(f"op={self.reduce_op}")
        return f"{self.op}({', '.join(args)}) {self.dtype}"

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "op": self.op,
            "mesh": self.mesh.describe(),
            "axis": self.axis,
            "reduce_op": self.reduce_op,
            "dtype": self.dtype,
            "members": [m.to_json() for m in self.members],
            "bytes": self.bytes,
            "buffer_bytes": self.buffer_bytes,
            "seconds": self.seconds,
            "launch": self.launch,
        }


class LegsInBuckets:
    """The totals of a plan whose ``legs`` move in ``buckets`` (a step plan, and its matrices'
    part in ``planner.matrices``): bytes and collectives as bucketed, and the time and
    collectives were every step its own."""

    __slots__ = ()
    legs: tuple[Leg, ...]
    buckets: tuple[Bucket, ...]

    @property
    def total_bytes(self) -> int:
        return sum(b.bytes for b in self.buckets)

    @property
    def unbucketed_seconds(self) -> float:
        """Modeled time were every step its own collective (the legs' plans summed)."""
        return sum(leg.total_seconds for leg in self.legs)

    @property
    def collectives(self) -> int:
        """Collectives (and exchanges) run: one per bucket."""
        return len(self.buckets)

    @property
    def unbucketed_collectives(self) -> int:
        return sum(len(leg.communicating) for leg in self.legs)


def leg_from_json(data: Mapping[str, Any]) -> Leg:
    """A leg of :meth:`Leg.to_json`."""
    return Leg(
        tensor=str(data["tensor"]),
        what=str(data["leg"]),
        stage=str(data["stage"]),
        dtype=str(data["dtype"]),
        hops=tuple(
            Hop(Plan.from_json(h["plan"]), None if h["view"] is None else tuple(h["view"])) for h in data["hops"]
        ),
    )


def leg_meshes(legs: Iterable[Leg]) -> dict[str, Mesh]:
    """Every mesh the legs' plans start from or step on, by its text (buckets name theirs so)."""
    meshes = {}
    for leg in legs:
        for hop in leg.hops:
            meshes[hop.plan.src.mesh.describe()] = hop.plan.src.mesh
            meshes.update((step.layout.mesh.describe(), step.layout.mesh) for step in hop.plan.steps)
    return meshes


def bucket_from_json(data: Mapping[str, Any], meshes: Mapping[str, Mesh]) -> Bucket:
    """A bucket of :meth:`Bucket.to_json`, its mesh one of ``meshes`` (:func:`leg_meshes`)."""
    return Bucket(
        stage=str(data["stage"]),
        op=str(data["op"]),
        mesh=meshes[data["mesh"]],
        axis=None if data["axis"] is None else int(data["axis"]),
        reduce_op=data["reduce_op"],
        dtype=str(data["dtype"]),
        members=tuple(Member(int(m["leg"]), int(m["hop"]), int(m["step"])) for m in data["members"]),
        bytes=int(data["bytes"]),
        buffer_bytes=int(data["buffer_bytes"]),
        seconds=float(data["seconds"]),
        launch=_launch(data["launch"]),
    )


def _launch(value: object) -> str:
    if value not in LAUNCHES:
        raise ValueError(f"a bucket's launch is one of {', '.join(LAUNCHES)}, not {value!r}")
    return str(value)


# --- building it -----------------------------------------------------------------------------
def bucket_stage(
    legs: Sequence[Leg],
    stage: str,
    costs: Mapping[str, CostModel],
    cap: int,
    *,
    reverse: bool,
    skip: Collection[int] = (),
    launch: str = IN_STEP,
) -> Iterable[Bucket]:
    """The buckets of one stage (see the module doc), mesh by mesh in one global order; the
    legs in reverse order when ``reverse``; the legs ``skip`` (indices) left out; each started
    at ``launch``."""
    for merged in stage_rounds(legs, stage, costs, reverse=reverse, skip=skip):
        for part in merged.cut(cap):
            yield _bucket(legs, stage, part, costs, launch)


# A step in a round: (leg, hop, step index, the step, its buffer bytes); a Member is made of the
# first three only for the buckets built, not for the many a price merely cuts.
RoundStep = tuple[int, int, int, Any, int]


@attrs.frozen
class Round:
    """One round of the weighted majority merge (module doc): the steps of one collective kind
    that run next, in leg order, each as (member, step, its buffer bytes). A bucket cap cuts it
    into buckets (:meth:`cut`), point-to-point steps (``alone``) one each; the rounds do not
    depend on the cap, so a step priced under many caps is merged once."""

    alone: bool
    members: tuple[RoundStep, ...]

    def cut(self, cap: int) -> Iterable[list[RoundStep]]:
        """The round's buckets under ``cap``: at most ``cap`` buffer bytes each (a larger
        step alone), in order."""
        part: list[RoundStep] = []
        held = 0
        for member in self.members:
            size = member[4]
            if part and (held + size > cap or self.alone):
                yield part
                part, held = [], 0
            part.append(member)
            held += size
        yield part


def stage_rounds(
    legs: Sequence[Leg],
    stage: str,
    costs: Mapping[str, CostModel],
    *,
    reverse: bool,
    skip: Collection[int] = (),
) -> list[Round]:
    """The rounds of one stage (:func:`bucket_stage` cuts them into buckets), mesh by mesh in
    one global order."""
    chains: dict[tuple, list[tuple[int, list[tuple[int, int]]]]] = {}
    for index, leg in enumerate(legs):
        if leg.stage != stage or index in skip:
            continue
        steps = leg.communicating
        if not steps:
            continue
        first_hop, first_step = steps[0]
        mesh = leg.hops[first_hop].plan.steps[first_step].layout.mesh
        chains.setdefault(_mesh_key(mesh), []).append((index, list(steps)))
    out: list[Round] = []
    for key in sorted(chains):
        out += _merge(legs, chains[key][::-1] if reverse else chains[key], costs)
    return out


@attrs.frozen(eq=False)
class Merged:
    """The rounds of the stages ``rounds`` names (:func:`stage_rounds`, not reversed) over
    ``legs`` with ``costs``: what pricing a choice's step and bucketing it can share."""

    legs: Sequence[Leg]
    costs: Mapping[str, CostModel]
    rounds: Mapping[str, Sequence[Round]]

    def over(self, legs: Sequence[Leg], costs: Mapping[str, CostModel]) -> bool:
        """Whether ``legs`` are its legs (the same objects, in order) and ``costs`` its costs."""
        same = len(legs) == len(self.legs) and all(a is b for a, b in zip(legs, self.legs, strict=True))
        return same and costs == self.costs


def rounds_price(
    legs: Sequence[Leg], rounds: Iterable[Round], costs: Mapping[str, CostModel], cap: int
) -> tuple[float, int]:
    """The buckets ``cap`` cuts ``rounds`` into, without building them: the sum of their
    seconds (added in order, as summing :func:`bucket_stage`'s buckets' does) and the largest
    bucket buffer."""
    seconds, largest = 0.0, 0
    for merged in rounds:
        for part in merged.cut(cap):
            seconds += _bucket_seconds(legs, part, costs, sum(step.bytes for _, _, _, step, _ in part))
            largest = max(largest, sum(size for *_, size in part))
    return seconds, largest


def _mesh_key(mesh: Mesh) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return mesh.shape, mesh.ranks


def _kind(leg: Leg, where: tuple[int, int], cost: CostModel) -> tuple:
    """What a step must share with others to run in one collective with them."""
    step = leg.hops[where[0]].plan.steps[where[1]]
    if step.op == "point_to_point":  # never merged
        return (1, step.op, id(step), leg.dtype)
    return (0, step.op, step.axis, step.reduce_op or "", leg.dtype, _mesh_key(step.layout.mesh), cost)


def _merge(
    legs: Sequence[Leg],
    chains: list[tuple[int, list[tuple[int, int]]]],
    costs: Mapping[str, CostModel],
) -> Iterable[Round]:
    """Weighted majority merge of the legs' step sequences on one mesh.

    Chains of one sequence of kinds move in step: every chain waiting on the kind a round
    takes moves on, so two that start alike stay alike. They are merged as one class,
    weighted by its count, and a round scans the classes, not the chains (a choice of layouts
    repeats a few legs over hundreds of tensors). E.g. chains ``[a, b]``, ``[c]``, ``[a, b]``
    make classes ``(a, b) x2`` at chains 0 and 2 and ``(c) x1`` at chain 1; ``a`` weighs 4, so
    the first round is chains 0 and 2 at ``a``."""
    if len(chains) == 1:  # one leg (suggest prices each tensor's alone): its steps in order
        index, steps = chains[0]
        hops = legs[index].hops
        for h, k in steps:
            step = hops[h].plan.steps[k]
            yield Round(step.op == "point_to_point", ((index, h, k, step, _buffer_bytes(step)),))
        return
    # Each step's kind, hashed once: as the number of its kind in the order the rounds below
    # first meet it (chains in order, each at its next step), which breaks ties the same way
    # everywhere; a round then compares small integers, not kinds of meshes and cost models.
    ids: dict[tuple, int] = {}
    # By the leg's identity too: a choice of layouts repeats one leg over a group's tensors.
    of_leg: dict[int, tuple[tuple[int, ...], list[tuple[int, int, Any, int]]]] = {}
    classes: dict[tuple[int, ...], list[int]] = {}  # kinds -> its chains, in order (by first chain)
    entries = []  # per chain, per step: (hop, step index, the step, its buffer bytes)
    for index, steps in chains:
        leg = legs[index]
        known = of_leg.get(id(leg))
        if known is None:
            kinds = tuple(ids.setdefault(_kind(leg, where, costs[leg.tensor]), len(ids)) for where in steps)
            held = [(h, k, step, _buffer_bytes(step)) for h, k in steps for step in [leg.hops[h].plan.steps[k]]]
            known = of_leg[id(leg)] = (kinds, held)
        classes.setdefault(known[0], []).append(len(entries))
        entries.append(known[1])
    sequences = list(classes)
    members_of = list(classes.values())
    position = [0] * len(sequences)
    order: dict[int, int] = {}
    p2p = {i for kind, i in ids.items() if kind[0] == 1}
    while True:
        waiting: dict[int, list[int]] = {}
        weight: dict[int, int] = {}
        for s, kinds in enumerate(sequences):
            if position[s] == len(kinds):
                continue
            kind = kinds[position[s]]
            order.setdefault(kind, len(order))
            waiting.setdefault(kind, []).append(s)
            weight[kind] = weight.get(kind, 0) + len(members_of[s]) * (len(kinds) - position[s])
        if not waiting:
            return
        chosen = max(waiting, key=lambda k: (weight[k], -order[k]))
        taken = waiting[chosen]
        moving = [(c, position[s]) for s in taken for c in members_of[s]]
        if len(taken) > 1:
            moving.sort()  # in chain order, as the legs come
        for s in taken:
            position[s] += 1
        yield Round(chosen in p2p, tuple((chains[c][0], *entries[c][at]) for c, at in moving))


def _buffer_bytes(step: Any) -> int:
    """The larger buffer (in or out) a rank passes to the step's collective: ``n`` padded blocks
    (all_gather, reduce_scatter, all_to_all) or the whole piece (all_reduce), from the step's
    bytes (``planner.cost``'s table)."""
    if step.axis is None:
        return step.bytes
    n = step.layout.mesh.shape[step.axis]
    if step.op == "all_reduce":
        return step.bytes // (2 * (n - 1)) * n
    return step.bytes // (n - 1) * n


def _bucket(
    legs: Sequence[Leg], stage: str, group: list[RoundStep], costs: Mapping[str, CostModel], launch: str
) -> Bucket:
    first = group[0][3]
    total = sum(step.bytes for _, _, _, step, _ in group)
    return Bucket(
        stage=stage,
        op=first.op,
        mesh=first.layout.mesh,
        axis=first.axis,
        reduce_op=first.reduce_op,
        dtype=legs[group[0][0]].dtype,
        members=tuple(Member(leg, hop, step) for leg, hop, step, _, _ in group),
        bytes=total,
        buffer_bytes=sum(size for *_, size in group),
        seconds=_bucket_seconds(legs, group, costs, total),
        launch=launch,
    )


def _bucket_seconds(legs: Sequence[Leg], group: list[RoundStep], costs: Mapping[str, CostModel], total: int) -> float:
    """The modeled time of one bucket (module doc) of ``total`` bytes."""
    first_leg, _, _, first, _ = group[0]
    if first.axis is None:  # point_to_point: its own plan's time
        return first.seconds
    cost = costs[legs[first_leg].tensor]
    # The regime of the bucket's bytes: it is one collective of them (planner.cost).
    alpha, bandwidth = cost.figures_at(first.op, first.layout.mesh, first.axis, total)
    rounds = collective_rounds(first.op, first.layout.mesh.shape[first.axis])
    # One collective: one executor overhead per bucket, as a plan pays one per step.
    return rounds * alpha + total / bandwidth + cost.overhead
