"""The matrices' part of a step plan: Muon's Newton-Schulz iterations, where each runs, what
moves it there and back, what it computes, and the buckets that run the moves together.

Where a matrix is iterated is chosen by :func:`planner.owners.place_matrices` (the choice, its
costs and the balance bound are documented there). The step plan then holds, per matrix, its
*legs*, planned reshards as the step plan's own legs are (``planner.step``), in two stages:

- to the iteration (:data:`TO`): ``update -> every rank`` for a gather (the cheapest plan from
  the pieces' layout to the replicated one), ``update -> rank k`` for owner ``k`` (the plan to
  the one-rank layout of ``k``: one point-to-point step, across meshes); flat chunks of a
  block that other axes split are first joined, ``update -> block`` (``S(a) -> R`` on the 1-d
  block: one all_gather over the flat axis), or in the gather's first hop;
- back from it (:data:`BACK`), owners only: ``result -> state``, the bf16 result from the
  owner's layout to the pieces' (the flat chunk of a joined block is then a slice of it).

The pieces' layout is the state layout; for flat chunks of a whole matrix (flat ZeRO), their
own 1-d layout of the matrix flattened; for flat chunks of a block, the block's layout.

**Buckets.** Collective steps share one collective per kind and group, as in the step plan
(:func:`planner.legs.bucket_stage`, under a :data:`WAVE_COPIES`-th of its byte cap: a rank runs
the matrices a wave of buckets at a time). The point-to-point steps of one
stage, for all matrices of one state mesh and one dtype, share one exchange: every pair of
ranks sends one message, the members' blocks for that peer one after another in member order.
Its modeled time is the busiest rank's: one latency per peer it sends to (or receives from)
plus its bytes over the link bandwidth (``planner.p2p``'s price of one step, with the members'
messages to a peer joined); its ``bytes`` are the largest a rank sends or receives.

**Estimate.** The step's matrices cost their bucketed communication plus the compute of the
busiest rank: the iteration's flops (:func:`planner.owners.newton_schulz_flops`) at
``flops_per_second``: given, else the cost model's measured rate (``CostModel.flops_per_second``,
a hints file's field that ``shardlang calibrate`` writes from timed bf16 matrix products,
``runtime.measure.flops``), else the stated :data:`planner.owners.DEFAULT_FLOPS_PER_SECOND`. The
placement itself is chosen on the unbucketed costs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from planner.cheapest import plan as plan_pair
from planner.cost import CostModel
from planner.errors import PlanError
from planner.legs import (
    Bucket,
    Hop,
    Leg,
    LegsInBuckets,
    Member,
    StepTensor,
    bucket_from_json,
    bucket_stage,
    flat_view,
    leg_from_json,
    leg_meshes,
    without_axis,
)
from planner.owners import (
    DEFAULT_FLOPS_PER_SECOND,
    PLACEMENTS,
    Matrix,
    gather_plan,
    newton_schulz_flops,
    owner_plans,
    place_matrices,
)
from planner.p2p import Links
from shardlang.dtypes import ITEMSIZE
from shardlang.layout import Layout

TO, BACK = "to the iteration", "back from the iteration"
MATRIX_STAGES = (TO, BACK)
# What a wave of matrices holds on a rank, in its buckets' bytes: the updates, the messages sent
# and received, and the whole matrices they land in (docs/memory.md); its buckets are cut at the
# step's bucket size over this, so that a step's moves stay within one bucket.
WAVE_COPIES = 4


def pieces(tensor: StepTensor) -> tuple[Layout, tuple[int, ...]]:
    """The layout and shape a matrix's pieces move in (module docstring)."""
    axis = tensor.flat_axis
    if axis is None:
        return tensor.state, tensor.shape
    if not joins(tensor):
        return Layout(dims=((axis,),), mesh=tensor.state.mesh), (math.prod(tensor.shape),)
    return tensor.base, tensor.shape


def joins(tensor: StepTensor) -> bool:
    """Whether the pieces are flat chunks of a block that other axes split."""
    return tensor.flat_axis is not None and any(without_axis(tensor.state, tensor.flat_axis).dims)


def _base_block_shape(tensor: StepTensor, rank: int) -> tuple[int, ...]:
    """The base block of ``rank`` (of the mesh's first rank where ``rank`` is not in it)."""
    mesh = tensor.state.mesh
    return tensor.base.rank_piece(tensor.shape, rank if rank in mesh.ranks else mesh.ranks[0]).shape


def _join_hop(tensor: StepTensor, rank: int) -> Hop:
    """``S(a) -> R`` on the rank's base block flattened: the chunks joined into the block."""
    assert tensor.flat_axis is not None
    mesh = tensor.state.mesh
    whole, split = flat_view(tensor.base, tensor.flat_axis, rank if rank in mesh.ranks else mesh.ranks[0])
    n = math.prod(_base_block_shape(tensor, rank))
    return Hop(plan_pair(split, whole, (n,), tensor.state_dtype, tensor.cost))


@attrs.frozen
class MatrixStep:
    """One matrix's iteration: its whole shape, where it runs (``owner`` ``None``: gathered
    on every rank of its state mesh), its flops and their time at the plan's rate, and its legs
    (indices into :attr:`MatrixPlan.legs`, in the order they run)."""

    name: str
    shape: tuple[int, int]
    owner: int | None
    flops: int
    compute_seconds: float
    legs: tuple[int, ...]

    @property
    def mode(self) -> str:
        return "gather" if self.owner is None else f"owner {self.owner}"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "owner": self.owner,
            "flops": self.flops,
            "compute_seconds": self.compute_seconds,
            "legs": list(self.legs),
        }


@attrs.frozen
class MatrixPlan(LegsInBuckets):
    """The matrices' iterations of one step as ``rank`` runs them: per matrix its placement
    and legs, the buckets of the legs' communicating steps (to the iteration, then back), the
    compute load of every rank, and the estimate (module docstring)."""

    rank: int
    placement: str
    flops_per_second: float
    matrices: tuple[MatrixStep, ...]
    legs: tuple[Leg, ...]
    buckets: tuple[Bucket, ...]
    loads: tuple[tuple[int, float], ...]

    def of(self, name: str) -> MatrixStep:
        return next(m for m in self.matrices if m.name == name)

    def legs_of(self, name: str) -> tuple[Leg, ...]:
        return tuple(self.legs[i] for i in self.of(name).legs)

    @property
    def comm_seconds(self) -> float:
        """Modeled time of the moves, bucketed."""
        return sum(b.seconds for b in self.buckets)

    @property
    def compute_seconds(self) -> float:
        """The busiest rank's iterations."""
        return max((load for _, load in self.loads), default=0.0)

    @property
    def seconds(self) -> float:
        return self.comm_seconds + self.compute_seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "placement": self.placement,
            "flops_per_second": self.flops_per_second,
            "matrices": [m.to_json() for m in self.matrices],
            "legs": [leg.to_json() for leg in self.legs],
            "buckets": [b.to_json() for b in self.buckets],
            "loads": [[rank, load] for rank, load in self.loads],
            "total_bytes": self.total_bytes,
            "comm_seconds": self.comm_seconds,
            "unbucketed_seconds": self.unbucketed_seconds,
            "collectives": self.collectives,
            "unbucketed_collectives": self.unbucketed_collectives,
            "compute_seconds": self.compute_seconds,
            "seconds": self.seconds,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MatrixPlan:
        """Read back what :meth:`to_json` wrote (errors as ``StepPlan.from_json`` raises them)."""
        legs = tuple(leg_from_json(leg) for leg in data["legs"])
        meshes = leg_meshes(legs)
        return cls(
            rank=int(data["rank"]),
            placement=str(data["placement"]),
            flops_per_second=float(data["flops_per_second"]),
            matrices=tuple(
                MatrixStep(
                    name=str(m["name"]),
                    shape=(int(m["shape"][0]), int(m["shape"][1])),
                    owner=None if m["owner"] is None else int(m["owner"]),
                    flops=int(m["flops"]),
                    compute_seconds=float(m["compute_seconds"]),
                    legs=tuple(int(i) for i in m["legs"]),
                )
                for m in data["matrices"]
            ),
            legs=legs,
            buckets=tuple(bucket_from_json(b, meshes) for b in data["buckets"]),
            loads=tuple((int(r), float(load)) for r, load in data["loads"]),
        )


def _matrix(tensor: StepTensor, ns_steps: int) -> Matrix:
    """What :func:`place_matrices` needs of a matrix; the join priced on the mesh's first
    rank's block, so that every rank of the mesh chooses alike."""
    layout, shape = pieces(tensor)
    flat_seconds = 0.0
    if joins(tensor):
        flat_seconds = _join_hop(tensor, tensor.state.mesh.ranks[0]).plan.total_seconds
    return Matrix(
        name=tensor.name,
        shape=shape,
        layout=layout,
        dtype=tensor.state_dtype,
        flops=newton_schulz_flops((tensor.shape[0], tensor.shape[1]), ns_steps),
        flat_seconds=flat_seconds,
        cost=tensor.cost,
    )


def plan_matrices(
    tensors: Sequence[StepTensor],
    rank: int,
    *,
    ns_steps: Mapping[str, int] | int = 5,
    placement: str = "auto",
    flops_per_second: float | None = None,
    bucket_bytes: int,
) -> MatrixPlan:
    """The matrix plan of ``rank`` for the 2-d ``tensors`` (in the order every rank gives
    them): placed per state mesh (every rank of a mesh steps the same matrices), legs and
    buckets as the module docstring says. ``ns_steps`` per tensor name or for all;
    ``flops_per_second`` defaults to the rate the first tensor's cost model carries (a hints
    file's ``flops_per_second``, measured by ``shardlang calibrate``), else
    :data:`DEFAULT_FLOPS_PER_SECOND`. The buckets are cut at ``bucket_bytes`` over
    :data:`WAVE_COPIES`: a rank runs the matrices a wave of buckets at a time
    (``runtime.execution.matrix_moves``), and a wave holds about that many copies of its bytes."""
    if placement not in PLACEMENTS:
        raise PlanError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    for t in tensors:
        if len(t.shape) != 2:
            raise PlanError(f"tensor '{t.name}': a Newton-Schulz iteration needs a matrix, not {list(t.shape)}")
    rate = flops_per_second if flops_per_second is not None else _calibrated_rate(tensors)
    steps = {t.name: ns_steps if isinstance(ns_steps, int) else ns_steps[t.name] for t in tensors}
    by_mesh: dict[tuple, list[StepTensor]] = {}
    for t in tensors:
        by_mesh.setdefault(_mesh_key(t.state), []).append(t)
    owners: dict[str, int | None] = {}
    loads: dict[int, float] = {}
    for group in by_mesh.values():
        placed = place_matrices([_matrix(t, steps[t.name]) for t in group], placement, rate)
        for p in placed.placements:
            owners[p.name] = p.owner
        loads.update(placed.loads)
    legs: list[Leg] = []
    matrices = []
    for t in tensors:
        owner = owners[t.name] if len(t.state.mesh.ranks) > 1 else None  # one rank: nothing moves
        start = len(legs)
        legs += _legs(t, owner, rank)
        flops = newton_schulz_flops((t.shape[0], t.shape[1]), steps[t.name])
        matrices.append(
            MatrixStep(t.name, (t.shape[0], t.shape[1]), owner, flops, flops / rate, tuple(range(start, len(legs))))
        )
    costs = {t.name: t.cost for t in tensors}
    exchanged = {i for i, leg in enumerate(legs) if _exchanges(leg)}
    cap = max(1, bucket_bytes // WAVE_COPIES)
    buckets = list(bucket_stage(legs, TO, costs, cap, reverse=False, skip=exchanged))
    for stage in MATRIX_STAGES:
        buckets += _exchange_buckets(legs, [i for i in sorted(exchanged) if legs[i].stage == stage], costs, cap)
    return MatrixPlan(
        rank=rank,
        placement=placement,
        flops_per_second=rate,
        matrices=tuple(matrices),
        legs=tuple(legs),
        buckets=tuple(buckets),
        loads=tuple(sorted(loads.items())),
    )


def _calibrated_rate(tensors: Sequence[StepTensor]) -> float:
    """The first tensor's cost model's measured rate (``shardlang calibrate``), else the stated one."""
    rate = tensors[0].cost.flops_per_second if tensors else None
    return DEFAULT_FLOPS_PER_SECOND if rate is None else rate


def _mesh_key(layout: Layout) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return layout.mesh.shape, layout.mesh.ranks


def _legs(tensor: StepTensor, owner: int | None, rank: int) -> list[Leg]:
    layout, shape = pieces(tensor)
    name, dtype = tensor.name, tensor.state_dtype
    view = _base_block_shape(tensor, rank) if joins(tensor) else None
    if owner is None:
        hops = (_join_hop(tensor, rank),) if joins(tensor) else ()
        gather = Hop(gather_plan(layout, shape, dtype, tensor.cost), view)
        return [Leg(name, "update -> every rank", TO, dtype, (*hops, gather))]
    to, back = owner_plans(layout, owner, shape, dtype, tensor.cost)
    legs = [Leg(name, "update -> block", TO, dtype, (_join_hop(tensor, rank),))] if joins(tensor) else []
    legs.append(Leg(name, f"update -> rank {owner}", TO, dtype, (Hop(to, view),)))
    legs.append(Leg(name, "result -> state", BACK, "bf16", (Hop(back),)))
    for leg in legs[-2:]:
        if any(step.op not in ("point_to_point", "slice") for step in leg.hops[0].plan.steps):
            raise PlanError(f"tensor '{name}': the move to its owner is not point-to-point: {leg.hops[0].plan}")
    return legs


def _exchanges(leg: Leg) -> bool:
    return any(step.op == "point_to_point" for hop in leg.hops for step in hop.plan.steps)


def _exchange_buckets(
    legs: Sequence[Leg], indices: Sequence[int], costs: Mapping[str, CostModel], cap: int
) -> list[Bucket]:
    """The point-to-point steps of ``indices`` (legs of one stage, one such step each), one
    exchange per state mesh and dtype, cut at ``cap`` bytes in leg order."""
    groups: dict[tuple, list[int]] = {}
    for i in indices:
        (hop,) = legs[i].hops
        state = hop.plan.src if legs[i].stage == TO else hop.plan.dst
        groups.setdefault((_mesh_key(state), legs[i].dtype), []).append(i)
    buckets = []
    for key in sorted(groups):
        cut: list[int] = []
        for i in groups[key]:
            if cut and _exchange_bucket(legs, [*cut, i], costs).bytes > cap:
                buckets.append(_exchange_bucket(legs, cut, costs))
                cut = []
            cut.append(i)
        buckets.append(_exchange_bucket(legs, cut, costs))
    return buckets


def _exchange_bucket(legs: Sequence[Leg], members: Sequence[int], costs: Mapping[str, CostModel]) -> Bucket:
    """One exchange of the members' point-to-point steps, priced per rank (module docstring)."""
    first = legs[members[0]]
    (hop,) = first.hops
    mesh = (hop.plan.src if first.stage == TO else hop.plan.dst).mesh
    itemsize = ITEMSIZE[first.dtype]
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    latency: dict[tuple[int, int], float] = {}  # one per pair of ranks
    seconds: dict[tuple[int, bool], float] = {}  # (rank, receiving): bytes over bandwidth
    chosen = []
    for i in members:
        (hop,) = legs[i].hops
        k, step = next((k, s) for k, s in enumerate(hop.plan.steps) if s.op == "point_to_point")
        chosen.append(Member(i, 0, k))
        links = Links(costs[legs[i].tensor], hop.plan.src.mesh, step.layout.mesh)
        for t in step.transfers:
            if t.src_rank == t.dst_rank or t.box.numel == 0:
                continue
            link, nbytes = links.between(t.src_rank, t.dst_rank), t.box.numel * itemsize
            sent[t.src_rank] = sent.get(t.src_rank, 0) + nbytes
            received[t.dst_rank] = received.get(t.dst_rank, 0) + nbytes
            pair = (t.src_rank, t.dst_rank)
            latency[pair] = max(latency.get(pair, 0.0), link.alpha)
            for end in ((t.src_rank, False), (t.dst_rank, True)):
                seconds[end] = seconds.get(end, 0.0) + nbytes / link.bandwidth
    ranks = set(sent) | set(received)

    def busy(rank: int) -> float:
        out = sum(a for (s, _), a in latency.items() if s == rank)
        into = sum(a for (_, r), a in latency.items() if r == rank)
        return max(out, into) + max(seconds.get((rank, False), 0.0), seconds.get((rank, True), 0.0))

    most = max((max(sent.get(r, 0), received.get(r, 0)) for r in ranks), default=0)
    return Bucket(
        stage=first.stage,
        op="point_to_point",
        mesh=mesh,
        axis=None,
        reduce_op=None,
        dtype=first.dtype,
        members=tuple(chosen),
        bytes=most,
        buffer_bytes=most,
        seconds=max((busy(r) for r in ranks), default=0.0),
    )
