"""Point-to-point plans: checked against element sets counted by hand, brute-force sender choices
and a cost model written here from its documentation.

The references share no code with ``planner/``: a rank's piece is the set of flat indices that
``torch.chunk`` gives on an index tensor (nested splits chunk again), mesh coordinates are
unravelled here, and the lower bound, the transfers' coverage and the step's time are computed
from those sets.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import Counter
from functools import cache

import pytest
import torch

import planner
from planner import cheapest
from planner.holdings import Blocks, holder_count
from planner.p2p import point_to_point_plan
from planner.plans import Plan
from shardlang import Layout, Mesh, parse_layout
from shardlang.errors import ShardlangError

L = parse_layout
ITEMSIZE = {"f32": 4, "bf16": 2, "f64": 8}


# --- the independent reference ----------------------------------------------------------
def coordinate(mesh: Mesh, rank: int) -> tuple[int, ...]:
    flat, coord = mesh.ranks.index(rank), []
    for size in reversed(mesh.shape):
        coord.append(flat % size)
        flat //= size
    return tuple(reversed(coord))


@cache
def flat_piece(layout: Layout, shape: tuple[int, ...], rank: int) -> frozenset[int]:
    """The flat indices of the global tensor that ``rank`` holds, by torch.chunk."""
    coord = coordinate(layout.mesh, rank)
    x = torch.arange(math.prod(shape)).reshape(shape)
    for d, axes in enumerate(layout.dims):
        for a in axes:
            chunks = torch.chunk(x, layout.mesh.shape[a], dim=d) if x.shape[d] else ()
            x = chunks[coord[a]] if coord[a] < len(chunks) else x.narrow(d, 0, 0)
    return frozenset(x.flatten().tolist())


def box_set(box, shape: tuple[int, ...]) -> frozenset[int]:
    x = torch.arange(math.prod(shape)).reshape(shape)
    return frozenset(x[tuple(slice(lo, hi) for lo, hi in box)].flatten().tolist())


def holds_final_values(layout: Layout) -> bool:
    return all(layout.mesh.shape[a] == 1 for a, _ in layout.partial)


def lower_bound_by_hand(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int) -> int:
    worst = 0
    for rank in dst.mesh.ranks:
        need = flat_piece(dst, shape, rank)
        if rank in src.mesh.ranks and holds_final_values(src):
            need = need - flat_piece(src, shape, rank)
        worst = max(worst, len(need) * itemsize)
    return worst


def volumes(transfers, shape, itemsize) -> tuple[Counter, Counter]:
    sent, received = Counter(), Counter()
    for t in transfers:
        if t.src_rank != t.dst_rank:
            n = len(box_set(t.box, shape)) * itemsize
            sent[t.src_rank] += n
            received[t.dst_rank] += n
    return sent, received


def largest_volume(sent: Counter, received: Counter) -> int:
    return max((max(sent[r], received[r]) for r in set(sent) | set(received)), default=0)


def check_exchange(before: Layout, after: Layout, step, shape: tuple[int, ...], itemsize: int) -> None:
    """The contract of a point_to_point step, checked with sets of flat indices."""
    assert step.op == "point_to_point" and step.axis is None and step.layout == after
    assert not before.partial and not after.partial
    arriving: dict[int, list[frozenset[int]]] = {r: [] for r in after.mesh.ranks}
    for t in step.transfers:
        part = box_set(t.box, shape)
        assert part, f"empty transfer {t}"
        assert t.src_rank in before.mesh.ranks and t.dst_rank in after.mesh.ranks
        assert part <= flat_piece(before, shape, t.src_rank), f"{t}: the sender does not hold it"
        assert part <= flat_piece(after, shape, t.dst_rank), f"{t}: the receiver does not need it"
        if t.src_rank != t.dst_rank and t.dst_rank in before.mesh.ranks:
            assert not part & flat_piece(before, shape, t.dst_rank), f"{t}: the receiver's own data on the wire"
        arriving[t.dst_rank].append(part)
    for rank, parts in arriving.items():
        need = flat_piece(after, shape, rank)
        assert sum(len(p) for p in parts) == len(need) and frozenset().union(*parts) == need, rank
    sent, received = volumes(step.transfers, shape, itemsize)
    assert step.bytes == largest_volume(sent, received)
    assert max(received.values(), default=0) == lower_bound_by_hand(before, after, shape, itemsize)


def exchanges(plan: Plan):
    """(state before, step) of every point_to_point step of a plan."""
    states = plan.layouts()
    return [(states[i], s) for i, s in enumerate(plan.steps) if s.op == "point_to_point"]


def seconds_by_hand(before: Layout, after: Layout, step, shape, itemsize, cost: planner.CostModel) -> float:
    """The documented model: per rank max(sum alpha sent, received) + max(sum bytes/beta sent,
    received), links the slowest differing axis (one mesh) or the slowest of both meshes."""

    def per_axis(value, mesh):
        return (value,) * mesh.ndim if isinstance(value, float) else value

    one_mesh = before.mesh.shape == after.mesh.shape and before.mesh.ranks == after.mesh.ranks
    alphas = per_axis(cost.alpha, after.mesh) + ((per_axis(cost.alpha, before.mesh)) if not one_mesh else ())
    betas = per_axis(cost.bandwidth, after.mesh) + ((per_axis(cost.bandwidth, before.mesh)) if not one_mesh else ())
    totals: dict[int, list[float]] = {}
    for t in step.transfers:
        if t.src_rank == t.dst_rank:
            continue
        if one_mesh:
            a, b = coordinate(after.mesh, t.src_rank), coordinate(after.mesh, t.dst_rank)
            axes = [i for i in range(after.mesh.ndim) if a[i] != b[i]]
            alpha, beta = max(alphas[i] for i in axes), min(betas[i] for i in axes)
        else:
            alpha, beta = max(alphas), min(betas)
        n = len(box_set(t.box, shape)) * itemsize
        totals.setdefault(t.src_rank, [0.0] * 4)
        totals.setdefault(t.dst_rank, [0.0] * 4)
        totals[t.src_rank][0] += alpha
        totals[t.src_rank][2] += n / beta
        totals[t.dst_rank][1] += alpha
        totals[t.dst_rank][3] += n / beta
    return max((max(x[0], x[1]) + max(x[2], x[3]) for x in totals.values()), default=0.0)


# --- random cases -----------------------------------------------------------------------
MESHES = [(2,), (3,), (4,), (2, 2), (2, 3), (3, 1), (2, 2, 2), (4, 2)]
LENGTHS = (0, 1, 2, 3, 5, 7, 8, 10, 13)


def random_mesh(rng: random.Random) -> Mesh:
    shape = rng.choice(MESHES)
    ranks = rng.sample(range(12), math.prod(shape))
    if rng.random() < 0.4:
        ranks.sort()
    return Mesh(shape, ranks)


def random_layout(rng: random.Random, mesh: Mesh, ndim: int, partial: bool) -> Layout:
    dims: list[list[int]] = [[] for _ in range(ndim)]
    pending = []
    for axis in rng.sample(range(mesh.ndim), mesh.ndim):  # random nesting order
        r = rng.random()
        if partial and r < 0.3:
            pending.append((axis, rng.choice(("sum", "avg"))))
        elif r < 0.75:
            dims[rng.randrange(ndim)].append(axis)
    return Layout(dims=dims, mesh=mesh, partial=pending)


def random_case(rng: random.Random, *, partial: bool, same_mesh: bool):
    src_mesh = random_mesh(rng)
    dst_mesh = src_mesh if same_mesh else random_mesh(rng)
    ndim = rng.randint(1, 2)
    shape = tuple(rng.choice(LENGTHS) for _ in range(ndim))
    return (
        random_layout(rng, src_mesh, ndim, partial),
        random_layout(rng, dst_mesh, ndim, partial and rng.random() < 0.5),
        shape,
        rng.choice(("f32", "bf16")),
    )


# --- the cases, counted by hand -------------------------------------------------
def test_swap_on_2x2_takes_a_quarter_by_messages_and_half_by_collectives():
    shape, n = (64, 64), 64 * 64 * 4
    src, dst = L("S0,S1 over mesh[2,2]"), L("S1,S0 over mesh[2,2]")
    # Ranks (0,0) and (1,1) keep their block; (0,1) and (1,0) swap theirs: a quarter each.
    need = {r: flat_piece(dst, shape, r) - flat_piece(src, shape, r) for r in range(4)}
    assert [len(need[r]) * 4 for r in range(4)] == [0, n // 4, n // 4, 0]
    p2p = point_to_point_plan(src, dst, shape)
    ((before, step),) = exchanges(p2p)
    check_exchange(before, dst, step, shape, 4)
    assert step.bytes == n // 4 == p2p.lower_bound_bytes
    assert sorted((t.src_rank, t.dst_rank) for t in step.transfers if t.src_rank != t.dst_rank) == [(1, 2), (2, 1)]
    collective = planner.plan(src, dst, shape)  # the baseline stays the default: collectives only
    assert {s.op for s in collective.steps} <= set(planner.BASELINE_OPS)
    assert collective.total_bytes == n // 2  # the best collective plan
    big = (4096, 4096)
    chosen = planner.plan(src, dst, big, point_to_point=True)
    assert [s.op for s in chosen.steps] == ["point_to_point"]
    assert chosen.total_bytes == big[0] * big[1] * 4 // 4
    assert chosen.total_seconds < planner.plan(src, dst, big).total_seconds


def test_row_block_permutation_on_8x8():
    """The issue's ``[Shard(0), Replicate()] -> [Replicate(), Shard(0)]``: ``S0 -> S1`` here."""
    shape = (256, 16)
    n = 256 * 16 * 4
    src, dst = L("S0,R over mesh[8,8]"), L("S1,R over mesh[8,8]")
    p2p = point_to_point_plan(src, dst, shape)
    ((_, step),) = exchanges(p2p)
    check_exchange(src, dst, step, shape, 4)
    # Rank (i, j) holds row block i and needs row block j: an eighth, unless i == j.
    assert step.bytes == n // 8 == lower_bound_by_hand(src, dst, shape, 4)
    sent, received = volumes(step.transfers, shape, 4)
    assert set(received.values()) == {n // 8} and len(received) == 56 and max(sent.values()) == n // 8
    assert planner.plan(src, dst, (4096, 4096)).total_bytes / (4096 * 4096 * 4) == 0.21875  # the 0.22N
    chosen = planner.plan(src, dst, (4096, 4096), point_to_point=True)
    assert [s.op for s in chosen.steps] == ["point_to_point"] and chosen.total_bytes == 4096 * 4096 * 4 // 8


def test_gathering_a_doubly_split_dim_needs_half():
    """The issue's ``[Shard(0), Shard(0)] -> [Replicate(), Shard(0)]`` on 2x2: ``S01 -> S1``."""
    shape, n = (64, 8), 64 * 8 * 4
    src, dst = L("S01,R over mesh[2,2]"), L("S1,R over mesh[2,2]")
    assert lower_bound_by_hand(src, dst, shape, 4) == n // 2 == planner.receive_lower_bound(src, dst, shape)
    big, n = (4096, 4096), 4096 * 4096 * 4
    assert planner.plan(src, dst, big).total_bytes == n * 5 // 8  # the 0.625N
    chosen = planner.plan(src, dst, big, point_to_point=True)
    assert [s.op for s in chosen.steps] == ["point_to_point"] and chosen.total_bytes == n // 2


@pytest.mark.parametrize(
    ("src", "dst", "shape"),
    [
        ("S0,S1 over mesh[2,2]", "S0,R over mesh[4] ranks 4..7", (37, 24)),  # disjoint, other shape
        ("S0,S1 over mesh[2,2]", "R,S0 over mesh[4] ranks 4..7", (5, 3)),
        ("S0,S1 over mesh[2,2]", "S1,S0 over mesh[2,2] ranks [3,2,1,0]", (37, 24)),  # permuted ranks
        ("S0,R over mesh[4]", "R,S0 over mesh[2] ranks [2,5]", (7, 9)),  # overlapping rank sets
        ("S01 over mesh[2,4]", "S0 over mesh[3] ranks [7,8,9]", (10,)),  # uneven, empty pieces
        ("R,R over mesh[2]", "S0,S1 over mesh[2,3] ranks 2..7", (3, 2)),  # replicas to balance
        ("S0 over mesh[4]", "S0 over mesh[4] ranks [1,2,3,0]", (3,)),  # a rotation, one empty piece
    ],
)
def test_cross_mesh_and_permuted_pairs(src, dst, shape):
    src, dst = L(src), L(dst)
    p2p = point_to_point_plan(src, dst, shape, "bf16")
    ((before, step),) = exchanges(p2p)
    check_exchange(before, dst, step, shape, 2)
    assert p2p.lower_bound_bytes == lower_bound_by_hand(src, dst, shape, 2)
    chosen = planner.plan(src, dst, shape, "bf16")  # a cross-mesh pair needs no flag
    for state, s in exchanges(chosen):
        check_exchange(state, s.layout, s, shape, 2)
    assert len(exchanges(chosen)) == 1 and chosen.layouts()[-1] == dst
    assert chosen.total_seconds <= p2p.total_seconds * (1 + 1e-12)


def test_partial_sources_are_resolved_by_collectives_first():
    src, dst, shape = L("R,R | P0 over mesh[4]"), L("S0,R over mesh[2] ranks [2,5]"), (8, 6)
    chosen = planner.plan(src, dst, shape)
    ops = [s.op for s in chosen.steps]
    k = ops.index("point_to_point")
    assert ops[:k] and set(ops[:k]) <= {"reduce_scatter", "all_reduce", "slice", "all_gather", "all_to_all"}
    assert all(s.layout.mesh == src.mesh for s in chosen.steps[:k])
    before, step = exchanges(chosen)[0]
    check_exchange(before, step.layout, step, shape, 4)
    # Partial over an axis of size > 1: nobody holds final values, every target element is missing.
    assert chosen.lower_bound_bytes == 4 * 6 * 4 == lower_bound_by_hand(src, dst, shape, 4)
    with pytest.raises(planner.PlanError, match="source is partial"):
        point_to_point_plan(src, dst, shape)


def test_partial_targets_get_local_partial_steps_after_the_exchange():
    src, dst, shape = L("S0,R over mesh[4]"), L("R,R | P0:avg over mesh[2] ranks 4..5"), (9, 2)
    chosen = planner.plan(src, dst, shape)
    k = [s.op for s in chosen.steps].index("point_to_point")
    assert [s.op for s in chosen.steps[k + 1 :]][-1] == "partial"
    assert all(s.layout.mesh == dst.mesh for s in chosen.steps[k:]) and chosen.layouts()[-1] == dst


def test_fan_out_to_a_larger_mesh_sends_thin_pieces_then_gathers():
    """Two holders, eight receivers of the whole tensor N: messages alone make each holder send
    4N; sending each receiver an eighth (each holder 4 messages of N/8) and then one all_gather
    over the target mesh (7 rounds, 7N/8) costs far less."""
    src, dst, shape = L("R over mesh[2]"), L("R over mesh[8] ranks 2..9"), (1 << 20,)
    n, alpha, beta = 1 << 22, planner.DEFAULT_ALPHA, planner.DEFAULT_BANDWIDTH
    direct = point_to_point_plan(src, dst, shape)
    assert direct.steps[0].bytes == 4 * n
    assert direct.total_seconds == pytest.approx(4 * alpha + 4 * n / beta)
    chosen = planner.plan(src, dst, shape)
    assert [s.op for s in chosen.steps] == ["point_to_point", "all_gather"]
    assert chosen.total_seconds == pytest.approx(4 * alpha + n / 2 / beta + 7 * alpha + 7 * n / 8 / beta)


# --- random cases against the references ------------------------------------------------
def test_lower_bound_equals_the_hand_count_on_random_pairs():
    rng = random.Random(7)
    for _ in range(150):
        src, dst, shape, dtype = random_case(rng, partial=True, same_mesh=rng.random() < 0.3)
        expect = lower_bound_by_hand(src, dst, shape, ITEMSIZE[dtype])
        assert planner.receive_lower_bound(src, dst, shape, dtype) == expect, (src, dst, shape)
        if not src.partial and not dst.partial:
            p2p = point_to_point_plan(src, dst, shape, dtype)
            assert p2p.lower_bound_bytes == expect
            check_exchange(src, dst, p2p.steps[0], shape, ITEMSIZE[dtype])


def test_chosen_plans_are_valid_and_no_dearer_than_each_kind_alone():
    rng = random.Random(11)
    for i in range(120):
        same = i % 3 == 0
        src, dst, shape, dtype = random_case(rng, partial=i % 2 == 0, same_mesh=same)
        chosen = planner.plan(src, dst, shape, dtype, point_to_point=True)
        assert chosen.layouts()[-1] == dst and chosen.src == src
        found = exchanges(chosen)
        assert len(found) <= 1 and (found or same)
        for before, step in found:
            check_exchange(before, step.layout, step, shape, ITEMSIZE[dtype])
            k = chosen.steps.index(step)
            assert all(s.layout.mesh == src.mesh for s in chosen.steps[:k])
            assert all(s.layout.mesh == dst.mesh for s in chosen.steps[k:])
        bound = chosen.total_seconds * (1 - 1e-12)
        if same:
            assert planner.plan(src, dst, shape, dtype).total_seconds >= bound
        if not src.partial and not dst.partial:
            assert point_to_point_plan(src, dst, shape, dtype).total_seconds >= bound


def test_step_time_follows_the_documented_model():
    rng = random.Random(5)
    hierarchical = [planner.CostModel(), planner.CostModel(alpha=2e-6, bandwidth=7e9)]
    for i in range(60):
        src, dst, shape, dtype = random_case(rng, partial=False, same_mesh=i % 2 == 0)
        costs = hierarchical
        if i % 2 == 0 and src.mesh.ndim == 2:
            costs = [*hierarchical, planner.CostModel(alpha=(9e-6, 1e-6), bandwidth=(25e9, 300e9))]
        for cost in costs:
            step = point_to_point_plan(src, dst, shape, dtype, cost).steps[0]
            expect = seconds_by_hand(src, dst, step, shape, ITEMSIZE[dtype], cost)
            assert step.seconds == pytest.approx(expect, rel=1e-9, abs=1e-15), (src, dst, shape)


def test_sender_choice_is_within_the_lpt_bound_of_the_best():
    """Brute force every sender for every message of small steps: the greedy's largest per-rank
    volume is at least the optimum and at most (4/3 - 1/(3m)) times it, m the most holders."""
    rng = random.Random(3)
    cases = [
        (L("R over mesh[2]"), L("S0 over mesh[3] ranks 2..4"), (9,)),  # a poor choice sends 2/3
        (L("R,R over mesh[3]"), L("S0,S1 over mesh[2,2] ranks 3..6"), (7, 5)),
        (L("S0,R over mesh[2,2]"), L("R,S0 over mesh[3] ranks 4..6"), (6, 9)),
    ]
    while len(cases) < 60:
        src, dst, shape, _ = random_case(rng, partial=False, same_mesh=rng.random() < 0.3)
        cases.append((src, dst, shape))
    checked = tight = 0
    for src, dst, shape in cases:
        step = point_to_point_plan(src, dst, shape).steps[0]
        messages = [t for t in step.transfers if t.src_rank != t.dst_rank]
        options = [[r for r in src.mesh.ranks if box_set(t.box, shape) <= flat_piece(src, shape, r)] for t in messages]
        if math.prod(len(o) for o in options) > 20000:
            continue
        sizes = [len(box_set(t.box, shape)) * 4 for t in messages]
        best = math.inf
        for senders in itertools.product(*options):
            sent, received = Counter(), Counter()
            for sender, t, n in zip(senders, messages, sizes, strict=True):
                sent[sender] += n
                received[t.dst_rank] += n
            best = min(best, largest_volume(sent, received))
        greedy = largest_volume(*volumes(step.transfers, shape, 4))
        m = max((len(o) for o in options), default=1)
        assert best <= greedy <= (4 / 3 - 1 / (3 * m)) * best + 1e-9, (src, dst, shape, greedy, best)
        checked += 1
        tight += greedy == best
    assert checked >= 40 and tight >= 30


def test_the_holders_of_a_block_are_gathered_in_mesh_order():
    """A layout replicated over a large mesh has one block with every rank as a holder (growing
    its holder tuple one rank at a time took quadratic time: bench/bench_planner_budget.py
    times this case)."""
    layout = L("R over mesh[256,256] ranks 1..65536")
    blocks = Blocks(layout, (8,))
    assert blocks.holders == {((0, 8),): tuple(range(1, 65537))}


def test_blocks_listed_from_the_mesh_structure_match_a_walk_over_every_rank():
    """Blocks are built per dim and axis, visiting only nonempty pieces; a rank-by-rank walk
    (``Layout.rank_piece`` on every rank of the mesh) must find the same holders, each rank's
    block and the same count, on random meshes (explicit rank lists included) and shapes with
    empty pieces."""
    rng = random.Random(7)
    for _ in range(400):
        sizes = [rng.choice([1, 2, 3, 4, 5]) for _ in range(rng.randint(1, 4))]
        n = math.prod(sizes)
        ranks = rng.choice([tuple(range(n)), tuple(rng.sample(range(3 * n), n))])
        dims: list[list[int]] = [[] for _ in range(rng.randint(0, 3))]
        for a in rng.sample(range(len(sizes)), len(sizes)):
            if dims and rng.random() < 0.7:
                dims[rng.randrange(len(dims))].append(a)
        layout = Layout(dims=dims, mesh=Mesh(shape=sizes, ranks=ranks))
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 13]) for _ in dims)
        walked = {r: layout.rank_piece(shape, r) for r in ranks}
        held = {r: box for r, box in walked.items() if box.numel}
        holders: dict = {}
        for r, box in held.items():
            holders.setdefault(box, []).append(r)
        blocks = Blocks(layout, shape)
        assert list(blocks.of_rank.items()) == list(held.items()), (layout, shape)
        assert blocks.holders == {box: tuple(rs) for box, rs in holders.items()}, (layout, shape)
        assert holder_count(layout, shape) == len(held), (layout, shape)
        # Across meshes the receive lower bound walks these blocks: it must equal the bound by hand.
        other = Layout(dims=[d[::-1] for d in dims], mesh=Mesh(shape=sizes[::-1], ranks=tuple(range(1, n + 1))))
        for src, dst in ((layout, other), (other, layout)):
            assert planner.receive_lower_bound(src, dst, shape) == lower_bound_by_hand(src, dst, shape, 4)


def test_ranks_that_hold_nothing_cost_no_budget():
    """A 32-row tensor on 131,072 ranks: 32 ranks hold rows, so listing and pricing the step
    fits the default budget, where the meshes' 229,376 ranks would not (each rank keeps its row:
    no messages, one local copy per row)."""
    src, dst = L("S(tp,dp),R over mesh[dp=16384,tp=8]"), L("S(tp,dp),R over mesh[dp=12288,tp=8]")
    step = point_to_point_plan(src, dst, (32, 4)).steps[0]
    # Rank dp * 8 + tp holds row tp * 4 + dp (4 rows per tp, one per dp < 4) in both layouts.
    expected = [(r, r, ((r % 8 * 4 + r // 8, r % 8 * 4 + r // 8 + 1), (0, 4))) for r in range(32)]
    assert [(t.src_rank, t.dst_rank, tuple(t.box)) for t in step.transfers] == expected
    assert planner.plan(src, dst, (32, 4)).steps == (step,)


# --- JSON, memo, limits, flags, errors --------------------------------------------------
def test_json_round_trip_keeps_transfers_and_reports_the_lower_bound():
    for src, dst, shape, flag in [
        (L("S0,S1 over mesh[2,2]"), L("S1,S0 over mesh[2,2]"), (64, 64), True),
        (L("R,R | P0 over mesh[4]"), L("S0,R over mesh[2] ranks [2,5]"), (7, 3), False),
        (L("R over mesh[2]"), L("R over mesh[8] ranks 2..9"), (1 << 16,), False),
    ]:
        p = planner.plan(src, dst, shape, point_to_point=flag)
        data = json.loads(json.dumps(p.to_json()))
        assert data["lower_bound_bytes"] == lower_bound_by_hand(src, dst, shape, 4)
        (step,) = [s for s in data["steps"] if s["op"] == "point_to_point"]
        assert step["transfers"] and {"src", "dst", "box"} <= set(step["transfers"][0])
        assert Plan.from_json(data) == p


def test_named_meshes_of_a_spec_survive_the_round_trip():
    meshes = {
        "old": Mesh((2, 2), axis_names=("dp", "tp"), name="old"),
        "new": Mesh((8,), tuple(range(8)), axis_names=("dp",), name="new"),
    }
    src, dst = L("S(dp),S(tp) over old", meshes), L("S(dp),R over new", meshes)
    p = planner.plan(src, dst, (37, 24))
    assert Plan.from_json(json.loads(json.dumps(p.to_json()))) == p


def test_planning_is_deterministic_and_memoized():
    src, dst = L("R,R | P0 over mesh[2,2]"), L("S0,R over mesh[3] ranks [5,1,2]")
    first = planner.plan(src, dst, (37, 24))
    assert planner.plan(parse_layout(str(src)), parse_layout(str(dst)), [37, 24]) is first
    cheapest._cheapest.cache_clear()
    again = planner.plan(src, dst, (37, 24))
    assert again == first and again is not first


def test_max_local_bytes_bounds_every_state_of_a_mixed_plan():
    src, dst, shape = L("R | P0 over mesh[4]"), L("R over mesh[4] ranks 4..7"), (1 << 12,)
    free = planner.plan(src, dst, shape)
    limit = 1 << 14  # the whole tensor: the target itself fits, nothing larger may appear
    bounded = planner.plan(src, dst, shape, max_local_bytes=limit)
    for layout in bounded.layouts():
        assert max(len(flat_piece(layout, shape, r)) for r in layout.mesh.ranks) * 4 <= limit
    assert bounded.total_seconds >= free.total_seconds * (1 - 1e-12)
    with pytest.raises(planner.PlanError, match="the source holds 16384 bytes per rank, more than max_local_bytes=100"):
        planner.plan(src, dst, shape, max_local_bytes=100)


def test_the_flag_reaches_whole_spec_planning():
    from planner.spec_plan import plan_spec
    from shardlang import parse_spec

    spec = parse_spec(
        "mesh world = [a=2, b=2]\n"
        "tensor w : f32[4096, 4096] { param = S(a),S(b) over world  grad = S(a),S(b) over world"
        "  state = S(b),S(a) over world }\n"
    )
    baseline = plan_spec(spec)
    extended = plan_spec(spec, point_to_point=True)
    assert "point_to_point" not in {s.op for _, leg in baseline.tensors[0].plans() for s in leg.steps}
    # grad -> state, param -> state (the parameter's shard, an f32 parameter having no master), state -> param
    assert [s.op for _, leg in extended.tensors[0].plans() for s in leg.steps] == ["point_to_point"] * 3
    assert extended.total_seconds < baseline.total_seconds


def test_bad_requests_are_plan_errors():
    with pytest.raises(planner.PlanError, match=r"bandwidth gives 2 values for the 1-axis mesh\[4\]"):
        planner.plan(L("S0 over mesh[2,2]"), L("S0 over mesh[4] ranks 4..7"), (8,), cost=planner.CostModel(
            bandwidth=(1e9, 2e9)))  # fmt: skip
    with pytest.raises(planner.PlanError, match="target is partial"):
        point_to_point_plan(L("S0 over mesh[2]"), L("R | P0 over mesh[2] ranks 2..3"), (8,))
    with pytest.raises(planner.PlanError, match="2-d"):
        planner.plan(L("S0,R over mesh[2]"), L("R over mesh[3] ranks 2..4"), (8,))
    with pytest.raises(ShardlangError, match="unknown dtype"):
        planner.receive_lower_bound(L("S0 over mesh[2]"), L("R over mesh[3]"), (8,), "f12")
