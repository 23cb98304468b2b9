"""Pattern-valued point-to-point steps (planner.pattern) against the explicit list, brute force.

References: the planner's explicit list (``PlannedExchange`` with patterns turned off: its
largest-first sender choice, written rank by rank, shares no code with ``planner.pieces``), the
tests' own round-robin transfers (``tests.test_p2p_support.hand_transfers``: every source rank's
piece by ``Layout.rank_piece``, every target rank in turn), and one rank's transfers filtered
from those lists. Many small meshes, random layouts, overlapping and shuffled rank sets.
"""

from __future__ import annotations

import json
import random
import time

import attrs
import pytest
import torch

import planner
from cli.main import main
from planner import holdings, p2p
from planner.cost import CostModel
from planner.p2p import Links, PlannedExchange, patterned
from planner.pattern import ExchangePattern
from planner.pieces import cyclic_senders_hold, pieces_of
from planner.plans import Plan
from runtime import recording, reshard, shard, simulate, torch_dtype
from runtime.comm.exchange import compile_exchange
from runtime.testing import run_ranks
from shardlang import Layout, Mesh, parse_layout
from tests.test_p2p_support import hand_transfers, traffic
from tests.test_planner_p2p import lower_bound_by_hand
from tests.test_runtime_support import full_tensor, reference_piece, source_pieces

L = parse_layout
MESH_SHAPES = [(2,), (3,), (4,), (2, 2), (3, 2), (2, 3), (2, 2, 2), (4, 2)]
LENGTHS = [1, 2, 3, 5, 7, 8, 12]


def random_pair(rng: random.Random) -> tuple[Layout, Layout, tuple[int, ...]]:
    """Two layouts on meshes of up to 8 ranks within 12 global ranks (the same, overlapping,
    disjoint or shuffled), of one random shape; neither partial."""
    s1, s2 = rng.choice(MESH_SHAPES), rng.choice(MESH_SHAPES)
    n1, n2 = Mesh(s1).size, Mesh(s2).size
    r1 = rng.sample(range(12), n1)
    r2 = rng.choice([rng.sample(range(12), n2), list(range(n2)), list(range(12 - n2, 12))])
    if rng.random() < 0.5:
        r1.sort()
    m1, m2 = Mesh(s1, r1), Mesh(s2, r2)
    if rng.random() < 0.2:
        m2 = m1
    ndim = rng.randint(1, 3)
    shape = tuple(rng.choice(LENGTHS) for _ in range(ndim))

    def layout(mesh: Mesh) -> Layout:
        dims: list[list[int]] = [[] for _ in range(ndim)]
        for a in rng.sample(range(mesh.ndim), mesh.ndim):
            if rng.random() < 0.7:
                dims[rng.randrange(ndim)].append(a)
        return Layout(dims=dims, mesh=mesh)

    return layout(m1), layout(m2), shape


def explicit(before: Layout, after: Layout, shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch):
    """The planner's list for the step (patterns off) and its PlannedExchange."""
    with monkeypatch.context() as m:
        m.setattr(p2p, "PATTERN_FROM", 1 << 62)
        exchange = PlannedExchange(before, after, shape, 4, Links(CostModel(), before.mesh, after.mesh))
    assert isinstance(exchange.transfers, tuple)
    return exchange


def turns_apply(before: Layout, after: Layout, shape: tuple[int, ...]) -> bool:
    """Where the pattern's senders are the planner's (planner.p2p.patterned without its size threshold)."""
    one_holder = pieces_of(before, shape).holders_per_block == 1
    return (one_holder or not before.mesh.same_geometry(after.mesh)) and cyclic_senders_hold(before, after, shape)


def test_pattern_transfers_equal_the_explicit_list_on_many_small_meshes(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(30)
    checked = 0
    while checked < 400:
        before, after, shape = random_pair(rng)
        if not turns_apply(before, after, shape):
            continue
        checked += 1
        listed = explicit(before, after, shape, monkeypatch).transfers
        pattern = ExchangePattern(before, after, shape)
        assert pattern.expanded() == listed, (before, after, shape)
        assert len(pattern) == len(listed) and tuple(pattern) == listed
        assert sorted(listed, key=repr) == sorted(hand_transfers(before, after, shape), key=repr)
        assert pattern.message_count == sum(t.src_rank != t.dst_rank for t in listed)
        for rank in {*before.mesh.ranks, *after.mesh.ranks, 12}:  # 12: in neither mesh
            mine = tuple(t for t in listed if rank in (t.src_rank, t.dst_rank))
            assert pattern.transfers_of(rank) == mine, (before, after, shape, rank)


def test_a_pattern_valued_step_prices_as_its_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """With patterns from the first transfer on, every step whose senders take turns is
    pattern-valued, and its figures are the list's: time in units exactly, bytes, copies."""
    rng = random.Random(31)
    cost = CostModel(copy_bandwidth=2e9)
    seen = 0
    for _ in range(300):
        before, after, shape = random_pair(rng)
        listed = explicit(before, after, shape, monkeypatch)
        monkeypatch.setattr(p2p, "PATTERN_FROM", 0)
        links = Links(cost, before.mesh, after.mesh)
        both = PlannedExchange(before, after, shape, 4, links)
        monkeypatch.setattr(p2p, "PATTERN_FROM", 1 << 62)
        if isinstance(both.transfers, tuple):
            assert not turns_apply(before, after, shape)
            continue
        seen += 1
        reference = PlannedExchange(before, after, shape, 4, links)
        assert both.transfers.expanded() == listed.transfers
        assert (both.units, both.bytes) == (reference.units, reference.bytes)
        assert both.step().seconds == pytest.approx(reference.step().seconds, rel=1e-12)
        plan = Plan(before, after, shape, "f32", (both.step(),), cost)
        assert plan.copied_bytes() == plan.expanded().copied_bytes()
    assert seen > 150


def test_bounds_in_numpy_equal_the_block_walks_and_the_bound_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(33)
    for _ in range(300):
        before, after, shape = random_pair(rng)
        links = Links(CostModel(), before.mesh, after.mesh)
        walked = p2p.time_lower_bound(before, after, shape, 4, links)
        counted = p2p.message_count(before, after, shape)
        with monkeypatch.context() as m:
            m.setattr(p2p, "PATTERN_FROM", 0)
            m.setattr(holdings, "VECTORIZE_FROM", 0)
            holdings.most_missing_bytes.cache_clear()
            assert p2p.vectorized(before, after, shape) or not holdings.holder_count(after, shape)
            assert p2p.time_lower_bound(before, after, shape, 4, links) == walked
            assert p2p.message_count(before, after, shape) == counted
            by_numpy = holdings.most_missing_bytes(before, after, shape, 4)
        holdings.most_missing_bytes.cache_clear()
        assert by_numpy == holdings.most_missing_bytes(before, after, shape, 4)
        assert by_numpy == lower_bound_by_hand(before, after, shape, 4)


def test_only_steps_whose_senders_take_turns_are_patterns(monkeypatch: pytest.MonkeyPatch) -> None:
    # One mesh, a block held by two ranks that are joined by different links: the planner picks by link.
    before, after = L("R,S1 over mesh[2,2]"), L("S0,S1 over mesh[2,2]")
    monkeypatch.setattr(p2p, "PATTERN_FROM", 0)
    assert not patterned(before, after, (4, 4)) and patterned(L("S1,S0 over mesh[2,2]"), after, (4, 4))
    # Two meshes, messages of two sizes from one block: largest first is not a round robin.
    assert not patterned(L("R over mesh[2]"), L("S0 over mesh[3] ranks 2..4"), (5,))
    assert patterned(L("R over mesh[2]"), L("S0 over mesh[3] ranks 2..4"), (6,))


SCALE = (L("S(tp,dp),R over mesh[dp=16384,tp=8]"), L("S(tp,dp),R over mesh[dp=12288,tp=8] ranks 131072..229375"))


def test_131072_to_98304_ranks_plans_at_the_default_budget_in_a_short_json() -> None:
    src, dst = SCALE
    started = time.process_time()
    plan = planner.plan(src, dst, (32000, 4096), "bf16")
    seconds = time.process_time() - started
    (step,) = plan.steps
    assert isinstance(step.transfers, ExchangePattern) and len(step.transfers) == 32000
    assert seconds < 2.0, seconds
    text = json.dumps(plan.to_json())
    assert len(text) < 2048
    back = Plan.from_json(json.loads(text))
    assert back == plan and back.steps[0].transfers == step.transfers
    assert eval(repr(step.transfers), {"ExchangePattern": ExchangePattern}) == step.transfers
    # Each target rank receives its own row, from the source rank holding it: by hand.
    for dp, tp in [(0, 0), (3999, 7), (17, 3), (4000, 0)]:
        rank = 131072 + dp * 8 + tp
        got = step.transfers_of(rank)
        if dp >= 4000:  # 32000 rows / 8 = 4000 per tp: the other target ranks hold nothing
            assert got == ()
            continue
        ((sender, receiver, box),) = [(t.src_rank, t.dst_rank, t.box) for t in got]
        assert (receiver, list(box)) == (rank, [(tp * 4000 + dp, tp * 4000 + dp + 1), (0, 4096)])
        assert sender == dp * 8 + tp  # row tp*4000+dp lies at source dp coordinate dp (1 row each)
    assert plan.lower_bound_bytes == 4096 * 2


def test_json_and_repr_read_back_on_small_patterns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(p2p, "PATTERN_FROM", 0)
    world = Mesh((2, 2), (3, 2, 1, 0), axis_names=("dp", "tp"), name="world")
    src = Layout(dims=((0,), (1,)), mesh=world)
    dst = L("S1,S0 over mesh[3,2] ranks 4..9")
    plan = planner.plan(src, dst, (6, 8))
    patterns = [s.transfers for s in plan.steps if s.op == "point_to_point"]
    assert patterns and all(isinstance(p, ExchangePattern) for p in patterns)
    data = json.loads(json.dumps(plan.to_json()))
    assert Plan.from_json(data) == plan
    assert all("pattern" in s["transfers"] for s in data["steps"] if s["op"] == "point_to_point")
    expanded = plan.expanded()
    assert all(isinstance(s.transfers, tuple) for s in expanded.steps)
    assert Plan.from_json(expanded.to_json()) == expanded
    for p in patterns:
        assert eval(repr(p), {"ExchangePattern": ExchangePattern}) == p


def test_a_pattern_valued_plan_runs_in_the_simulator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(p2p, "PATTERN_FROM", 0)
    rng = random.Random(32)
    ran = 0
    while ran < 40:
        before, after, shape = random_pair(rng)
        plan = planner.plan(before, after, shape, "f32", point_to_point=True)
        step = next((s for s in plan.steps if s.op == "point_to_point"), None)
        if step is None or isinstance(step.transfers, tuple):
            continue
        ran += 1
        expanded = plan.expanded()
        index = plan.steps.index(step)
        for rank in {*before.mesh.ranks, *after.mesh.ranks}:
            listed = compile_exchange(expanded, index, rank)
            assert compile_exchange(plan, index, rank) == (listed and attrs.evolve(listed, step=step))
        full = full_tensor(shape, torch_dtype("f32"), ran)
        out = simulate(plan, source_pieces(full, before, ran))
        for rank, piece in out.items():
            assert torch.equal(piece, reference_piece(full, after, rank))
            assert torch.equal(piece, shard(full, after, rank))


def test_cli_plan_writes_the_pattern_and_expands_it(capsys: pytest.CaptureFixture[str]) -> None:
    target = "S0,R over mesh[1024] ranks 2048..3071"
    pair = ["S0,R over mesh[2048]", target, "--shape", "3072x4", "--format", "json"]
    assert main(["plan", *pair]) == 0
    step = json.loads(capsys.readouterr().out)["steps"][0]
    assert step["transfers"] == {"pattern": {"source": "S0,R over mesh[2048]", "target": target, "shape": [3072, 4]}}
    assert main(["plan", *pair, "--expand"]) == 0
    transfers = json.loads(capsys.readouterr().out)["steps"][0]["transfers"]
    # Source rank s holds rows 2s, 2s+1; target rank 2048+i needs rows 3i..3i+2: by hand.
    expected = [
        {"src": s, "dst": 2048 + i, "box": [[max(2 * s, 3 * i), min(2 * s + 2, 3 * i + 3)], [0, 4]]}
        for i in range(1024)
        for s in range(3 * i // 2, (3 * i + 2) // 2 + 1)
    ]
    assert transfers == expected
    assert main(["plan", "examples/gpt2_small_dp2_tp2.shard", "--expand"]) == 2


def _reshard_by_pattern(rank: int, world_size: int, plan: Plan, seed: int) -> tuple | None:
    src, dst = plan.src, plan.dst
    if rank not in src.mesh.ranks and rank not in dst.mesh.ranks:
        return None
    full = full_tensor(plan.shape, torch_dtype(plan.dtype), seed)
    local = source_pieces(full, src, seed)[rank] if rank in src.mesh.ranks else None
    with recording() as log:
        out = reshard(local, src, dst, global_shape=plan.shape, plan=plan, timeout=60, verify=True)
    return out, sum(r.bytes_sent for r in log.records if r.op == "point_to_point")


def test_a_pattern_valued_plan_runs_on_gloo_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank compiles its own transfers from the pattern (``Step.transfers_of``) and the
    pieces arrive as torch.chunk cuts them; each rank sends what the expanded list says."""
    monkeypatch.setattr(p2p, "PATTERN_FROM", 0)
    plan = planner.plan(L("S0,S1 over mesh[2,2]"), L("R,S0 over mesh[3] ranks 2..4"), (7, 5), "f32")
    (step,) = [s for s in plan.steps if s.op == "point_to_point"]
    assert isinstance(step.transfers, ExchangePattern)
    results = run_ranks(_reshard_by_pattern, 6, (plan, 5), timeout=150)
    full = full_tensor(plan.shape, torch_dtype(plan.dtype), 5)
    sent, _ = traffic(step.transfers.expanded(), 4)
    assert results[5] is None
    for rank in range(5):
        out, nbytes = results[rank]
        if rank in plan.dst.mesh.ranks:
            assert torch.equal(out, reference_piece(full, plan.dst, rank)), rank
        else:
            assert out is None
        assert nbytes == sent.get(rank, 0), rank


def test_render_draws_a_pattern_valued_step_as_its_list(monkeypatch: pytest.MonkeyPatch) -> None:
    from cli.picture import picture_dot, plan_picture

    monkeypatch.setattr(p2p, "PATTERN_FROM", 0)
    plan = planner.plan(L("S0,S1 over mesh[2,2]"), L("R,S0 over mesh[3] ranks 2..4"), (7, 5), "f32")
    assert isinstance(plan.steps[0].transfers, ExchangePattern)
    drawn = picture_dot(plan_picture(plan))
    assert "messages of step 1" in drawn and drawn == picture_dot(plan_picture(plan.expanded()))
