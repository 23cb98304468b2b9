"""Where each matrix's Newton-Schulz iteration runs (Muon): on every rank of its state mesh
after an all-gather (*gather*), or on one *owner* rank that receives it whole and sends the
result back (a plan to a one-rank layout and one back: point-to-point, across meshes).

The cost of a choice. Communication is priced by the planner's own plans under the tensor's
cost model (``Plan.total_seconds``): the cheapest plan from the state layout to the
replicated layout for a gather, to the owner's one-rank layout and back for an owner (in
bf16 on the way back, as the iteration's result is). Compute is the iteration's flops
(:func:`newton_schulz_flops`) at ``flops_per_second`` (:data:`DEFAULT_FLOPS_PER_SECOND`, a
stated rate until one is calibrated on the machine). A choice's estimate
(:attr:`OwnerPlan.estimate`) is the sum of every matrix's moves, each priced alone (the moves
run one after another) plus the largest compute load of any rank (the iterations of different
ranks run at once): a gathered matrix loads every rank of its mesh, an owned one only its
owner. That is what the choice compares; the step's modeled time, its moves bucketed as they
run, is the matrix plan's (``planner.matrices.MatrixPlan.comm_seconds`` and ``seconds``), the
one home of those figures.

The choice (``placement="auto"``): matrices by decreasing flops (ties: name), each takes the
option that makes the estimate least so far (ties: gather), an owner being the least loaded
rank of its mesh (ties: the lowest rank); as that greedy pass can settle on gathers too early,
the result is the least estimate of all gathers, all owners and the greedy pass (ties in that
order). With ``placement="owner"`` every matrix has an owner, chosen as above: that is LPT
(Graham 1969), whose largest load is within ``4/3 - 1/(3m)`` of the least possible on one mesh
of ``m`` ranks, and in any case at most the mean load plus the largest single matrix's compute
(:func:`owner_load_bound`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import attrs

from planner.cheapest import plan
from planner.cost import CostModel
from planner.plans import Plan
from shardlang.layout import Layout
from shardlang.mesh import Mesh

# Newton-Schulz flops per second assumed for one rank: bf16 matrix products on a few CPU cores.
DEFAULT_FLOPS_PER_SECOND = 1e11
PLACEMENTS = ("auto", "gather", "owner")


def newton_schulz_flops(shape: tuple[int, int], steps: int) -> int:
    """Flops of ``steps`` quintic iterations on an ``a x b`` matrix (the short side ``m``
    first, as torch transposes a tall one): per iteration ``X X^T`` and ``B X`` cost ``2 m^2 n``
    each, ``A^2`` (``addmm`` of the Gram matrix) ``2 m^3``."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m**3)


def owner_layout(rank: int, ndim: int, mesh_axes: int = 1) -> Layout:
    """The whole tensor on ``rank`` alone, on a mesh of ``mesh_axes`` axes of one rank (as many
    as the state mesh has, so that a cost model with a figure per axis prices both)."""
    return Layout(dims=((),) * ndim, mesh=Mesh(shape=(1,) * mesh_axes, ranks=(rank,)))


def replicated(layout: Layout) -> Layout:
    return Layout(dims=((),) * len(layout.dims), mesh=layout.mesh)


@functools.lru_cache(maxsize=1024)
def gather_plan(layout: Layout, shape: tuple[int, ...], dtype: str, cost: CostModel) -> Plan:
    """The cheapest plan that puts the whole tensor on every rank of ``layout``'s mesh."""
    return plan(layout, replicated(layout), shape, dtype, cost)


@functools.lru_cache(maxsize=1024)
def owner_plans(layout: Layout, owner: int, shape: tuple[int, ...], dtype: str, cost: CostModel) -> tuple[Plan, Plan]:
    """The cheapest plans that move the tensor whole to ``owner`` and its bf16 result back."""
    whole = owner_layout(owner, len(shape), layout.mesh.ndim)
    return plan(layout, whole, shape, dtype, cost), plan(whole, layout, shape, "bf16", cost)


@attrs.frozen
class Matrix:
    """One matrix to orthogonalise: its name, the layout its pieces move in and the shape that
    layout divides (the state layout and the matrix's shape; the 1-d layout of flat chunks and
    the matrix flattened; for flat chunks of a block, the block's layout, ``flat_seconds`` then
    pricing the chunks' all-gather into it), the update's dtype and the flops of its iteration."""

    name: str
    shape: tuple[int, ...]
    layout: Layout
    dtype: str
    flops: int
    flat_seconds: float = 0.0
    cost: CostModel = attrs.field(factory=CostModel)

    @property
    def mesh(self) -> Mesh:
        return self.layout.mesh

    def gather_seconds(self) -> float:
        return self.flat_seconds + gather_plan(self.layout, self.shape, self.dtype, self.cost).total_seconds

    def owner_seconds(self, rank: int) -> float:
        to, back = owner_plans(self.layout, rank, self.shape, self.dtype, self.cost)
        return self.flat_seconds + to.total_seconds + back.total_seconds


@attrs.frozen
class Placement:
    """Where one matrix's iteration runs: ``owner`` ``None`` for a gather."""

    name: str
    owner: int | None
    move_seconds: float  # this matrix's moves priced alone, not bucketed (module docstring)
    compute_seconds: float

    def __str__(self) -> str:
        where = "gather" if self.owner is None else f"owner {self.owner}"
        return f"{self.name}: {where}, {self.move_seconds:.3g} s moving, {self.compute_seconds:.3g} s computing"


@attrs.frozen
class OwnerPlan:
    """Every matrix's placement, the compute load each rank ends with, and the estimate the
    choice compares (module docstring)."""

    placements: tuple[Placement, ...]
    loads: tuple[tuple[int, float], ...]
    flops_per_second: float

    @property
    def estimate(self) -> float:
        """Unbucketed moves plus the busiest rank's compute: what :func:`place_matrices`
        minimizes, not the step's modeled time (``planner.matrices.MatrixPlan.seconds``)."""
        return sum(p.move_seconds for p in self.placements) + max((load for _, load in self.loads), default=0.0)

    def of(self, name: str) -> Placement:
        return next(p for p in self.placements if p.name == name)

    def __str__(self) -> str:
        lines = [f"Newton-Schulz placement: {self.estimate:.3g} s estimated at {self.flops_per_second:.3g} flop/s"]
        return "\n".join(lines + [f"  {p}" for p in self.placements])


def place_matrices(
    matrices: Sequence[Matrix], placement: str = "auto", flops_per_second: float = DEFAULT_FLOPS_PER_SECOND
) -> OwnerPlan:
    """Each matrix's placement, chosen as the module docstring says."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if placement != "auto":
        return _greedy(matrices, placement, flops_per_second)
    candidates = [_greedy(matrices, p, flops_per_second) for p in ("gather", "owner", "auto")]
    return min(candidates, key=lambda c: c.estimate)


def _greedy(matrices: Sequence[Matrix], placement: str, flops_per_second: float) -> OwnerPlan:
    loads: dict[int, float] = {r: 0.0 for m in matrices for r in m.mesh.ranks}
    moves = 0.0
    chosen: dict[str, Placement] = {}
    for m in sorted(matrices, key=lambda m: (-m.flops, m.name)):
        compute = m.flops / flops_per_second
        ranks = tuple(m.mesh.ranks)
        owner = min(ranks, key=lambda r: (loads[r], r))
        options: list[tuple[float, Placement]] = []
        if placement != "owner":
            seconds = m.gather_seconds()
            peak = max(max(loads.values()), max(loads[r] + compute for r in ranks))
            options.append((moves + seconds + peak, Placement(m.name, None, seconds, compute)))
        if placement != "gather" and len(ranks) > 1:
            seconds = m.owner_seconds(owner)
            peak = max(max(loads.values()), loads[owner] + compute)
            options.append((moves + seconds + peak, Placement(m.name, owner, seconds, compute)))
        if not options:  # a one-rank mesh: the rank owns it, nothing moves
            options.append((moves, Placement(m.name, ranks[0], 0.0, compute)))
        _, best = min(options, key=lambda option: option[0])
        moves += best.move_seconds
        for r in ranks if best.owner is None else (best.owner,):
            loads[r] += compute
        chosen[m.name] = best
    return OwnerPlan(
        placements=tuple(chosen[m.name] for m in matrices),
        loads=tuple(sorted(loads.items())),
        flops_per_second=flops_per_second,
    )


def owner_load_bound(jobs: Sequence[float], machines: int) -> float:
    """The largest load list scheduling can leave on ``machines`` ranks: the mean plus the
    largest job (LPT, which :func:`place_matrices` runs, also stays within ``4/3 - 1/(3m)``
    of the optimum)."""
    return sum(jobs) / machines + max(jobs, default=0.0) if machines else math.inf
