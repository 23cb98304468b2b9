"""Point-to-point plans built by hand for the runtime tests, and tests of the helpers.

``hand_transfers`` is the tests' own answer to "who sends what": for every target rank and
every distinct source piece overlapping its target piece, one transfer of the overlap, from
the target rank itself when it holds that piece (a local copy), else from the piece's holders
in turn (round-robin). It shares nothing with ``planner.p2p``. ``hand_plan`` wraps it in a
plan, after collective steps that resolve a partial source on the source mesh and before
local ``partial`` steps for a partial target, as the point-to-point contract requires.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

import planner
from planner.plans import Plan, Step, Transfer
from shardlang import Layout, parse_layout
from shardlang.dtypes import ITEMSIZE


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...] | None:
    box = tuple((max(lo, blo), min(hi, bhi)) for (lo, hi), (blo, bhi) in zip(a, b, strict=True))
    return box if all(lo < hi for lo, hi in box) else None


def hand_transfers(before: Layout, after: Layout, shape: tuple[int, ...]) -> tuple[Transfer, ...]:
    """Transfers taking ``before`` (not partial) to ``after`` (module docstring)."""
    holders: dict[tuple, list[int]] = defaultdict(list)
    for rank in before.mesh.ranks:
        holders[before.rank_piece(shape, rank)].append(rank)
    turn: dict[tuple, int] = defaultdict(int)
    transfers = []
    for target in after.mesh.ranks:
        wanted = after.rank_piece(shape, target)
        for piece, ranks in holders.items():
            box = _overlap(piece, wanted)
            if box is None:
                continue
            if target in ranks:
                sender = target
            else:
                sender = ranks[turn[piece] % len(ranks)]
                turn[piece] += 1
            transfers.append(Transfer(sender, target, box))
    return tuple(transfers)


def traffic(transfers: tuple[Transfer, ...], itemsize: int) -> tuple[dict[int, int], dict[int, int]]:
    """Bytes each rank sends and receives over the wire (self copies excluded)."""
    sent: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    for t in transfers:
        if t.src_rank != t.dst_rank:
            nbytes = math.prod(hi - lo for lo, hi in t.box) * itemsize
            sent[t.src_rank] += nbytes
            received[t.dst_rank] += nbytes
    return dict(sent), dict(received)


def p2p_step(before: Layout, after: Layout, shape: tuple[int, ...], dtype: str) -> Step:
    transfers = hand_transfers(before, after, shape)
    sent, received = traffic(transfers, ITEMSIZE[dtype])
    busiest = max((max(sent.get(r, 0), received.get(r, 0)) for r in {*sent, *received}), default=0)
    return Step("point_to_point", None, None, None, None, after, busiest, 0.0, transfers)


def hand_plan(src: Layout, dst: Layout, shape: tuple[int, ...], dtype: str) -> Plan:
    """Collectives resolving ``src``'s partials on the source mesh (all_reduce or whatever the
    planner picks to reach the same splits), one hand-made point-to-point step to ``dst``
    without partials, then the planner's local ``partial`` steps on the target mesh."""
    resolved = Layout(dims=src.dims, mesh=src.mesh)
    filled = Layout(dims=dst.dims, mesh=dst.mesh)
    before = planner.plan(src, resolved, shape, dtype).steps if src.partial else ()
    after = planner.plan(filled, dst, shape, dtype).steps if dst.partial else ()
    assert all(s.op == "partial" for s in after)
    return Plan(src, dst, shape, dtype, (*before, p2p_step(resolved, filled, shape, dtype), *after))


# --- tests of the helpers -------------------------------------------------------------------

PAIRS = [
    ("S0,S1 over mesh[2,2]", "S1,S0 over mesh[2,2]", (5, 7)),
    ("S0,R over mesh[8]", "R,S0 over mesh[8]", (9, 8)),
    ("S0,S1 over mesh[2,2]", "S0,R over mesh[4] ranks 4..7", (3, 5)),
    ("S0,R over mesh[4]", "R,S0 over mesh[2] ranks [2,5]", (6, 1)),
    ("R,S0 over mesh[2,2] ranks [3,1,2,0]", "S01,R over mesh[2,2]", (2, 3)),
]


@pytest.mark.parametrize(("src", "dst", "shape"), PAIRS)
def test_hand_transfers_cover_every_target_piece_once(src: str, dst: str, shape: tuple[int, ...]) -> None:
    before, after = parse_layout(src), parse_layout(dst)
    transfers = hand_transfers(before, after, shape)
    # Brute force: count, element by element, how often each target element arrives; every
    # box must lie inside its sender's piece.
    counts = {r: torch.zeros(shape, dtype=torch.int64) for r in after.mesh.ranks}
    for t in transfers:
        index = tuple(slice(lo, hi) for lo, hi in t.box)
        counts[t.dst_rank][index] += 1
        source = before.rank_piece(shape, t.src_rank)
        assert _overlap(source, t.box) == t.box, f"{t} is not inside its sender's piece {source}"
    for rank in after.mesh.ranks:
        wanted = torch.zeros(shape, dtype=torch.int64)
        wanted[tuple(slice(lo, hi) for lo, hi in after.rank_piece(shape, rank))] = 1
        assert torch.equal(counts[rank], wanted), f"rank {rank}"


def test_hand_transfers_copy_locally_and_balance_replicas() -> None:
    # Every rank of mesh[4] holds the whole tensor: each target rank copies its own piece.
    transfers = hand_transfers(parse_layout("R over mesh[4]"), parse_layout("S0 over mesh[4]"), (8,))
    assert all(t.src_rank == t.dst_rank for t in transfers)
    # Ranks 0..1 both hold everything; ranks 2..5 need it: senders alternate.
    transfers = hand_transfers(parse_layout("R over mesh[2]"), parse_layout("S0 over mesh[4] ranks 2..5"), (8,))
    assert [t.src_rank for t in transfers] == [0, 1, 0, 1]


def test_hand_plan_resolves_partials_around_the_point_to_point_step() -> None:
    src, dst = parse_layout("S0,R | P1 over mesh[2,2]"), parse_layout("R,R | P0 over mesh[2] ranks 4..5")
    plan = hand_plan(src, dst, (4, 3), "f32")
    assert [s.op for s in plan.steps] == ["all_reduce", "point_to_point", "partial"]
    assert plan.steps[1].layout == parse_layout("R,R over mesh[2] ranks 4..5")
    sent, received = traffic(plan.steps[1].transfers, 4)
    assert sum(sent.values()) == sum(received.values()) == 2 * 4 * 3 * 4  # both target ranks get everything
    assert set(sent) <= {0, 1, 2, 3} and set(received) == {4, 5}


# --- the cases the simulator and the gloo tests share (8 ranks at most) ---------------------
# (src, dst, shape, dtype, how): "hand" runs hand_plan; "p2p" the planner's plan with
# point-to-point steps allowed (same mesh); "auto" lets reshard plan (cross-mesh).
Case = tuple[str, str, tuple[int, ...], str, str]
CASES: list[Case] = [
    # swap on mesh[2,2]
    ("S0,S1 over mesh[2,2]", "S1,S0 over mesh[2,2]", (8, 6), "f32", "hand"),
    ("S0,S1 over mesh[2,2]", "S1,S0 over mesh[2,2]", (5, 3), "bf16", "hand"),
    ("S0,S1 over mesh[2,2]", "S1,S0 over mesh[2,2]", (1, 3), "i64", "hand"),
    ("S0,S1 over mesh[2,2]", "S1,S0 over mesh[2,2]", (7, 9), "f32", "p2p"),
    # permutations of row blocks
    ("S0,R over mesh[8]", "R,S0 over mesh[8]", (16, 8), "f32", "hand"),
    ("S0,R over mesh[8]", "R,S0 over mesh[8]", (3, 5), "i64", "hand"),
    ("S0,R over mesh[8]", "R,S0 over mesh[8]", (9, 10), "f32", "p2p"),
    ("S0,R over mesh[2,4]", "R,S0 over mesh[2,4]", (6, 10), "bf16", "hand"),
    ("S01,R over mesh[2,4]", "S10,R over mesh[2,4]", (11, 2), "f32", "p2p"),
    # mesh[2,2] ranks 0..3 -> mesh[4] ranks 4..7
    ("S0,S1 over mesh[2,2]", "S0,R over mesh[4] ranks 4..7", (8, 6), "f32", "hand"),
    ("R,S1 over mesh[2,2]", "R,S0 over mesh[4] ranks 4..7", (5, 7), "f32", "auto"),
    ("S0,S1 over mesh[2,2]", "R,R over mesh[4] ranks 4..7", (6, 5), "i64", "auto"),
    ("S0,S1 over mesh[2,2]", "R,S0 over mesh[4] ranks 4..7", (0, 4), "f32", "hand"),
    # mesh[2,2] -> mesh[2,2] with permuted ranks
    ("S0,S1 over mesh[2,2]", "S0,S1 over mesh[2,2] ranks [3,1,2,0]", (6, 6), "f32", "hand"),
    ("S0,R over mesh[2,2]", "R,S1 over mesh[2,2] ranks [3,1,2,0]", (5, 4), "bf16", "auto"),
    # overlapping rank sets
    ("S0,R over mesh[4]", "R,S0 over mesh[2] ranks [2,5]", (7, 3), "f32", "hand"),
    ("S0,R over mesh[4]", "R,S0 over mesh[2] ranks [2,5]", (7, 3), "i64", "auto"),
    ("S0 over mesh[4]", "S0 over mesh[3] ranks 3..5", (2,), "f32", "hand"),
    ("S1,S0 over mesh[2,3] ranks 2..7", "S0,R over mesh[4] ranks [7,0,5,2]", (5, 4), "f32", "auto"),
    # partial sources: collectives on the source mesh first
    ("S0,R | P1 over mesh[2,2]", "R,S0 over mesh[4] ranks 4..7", (6, 5), "f32", "hand"),
    ("R | P0:max over mesh[2] ranks [6,7]", "S0 over mesh[3] ranks 0..2", (5,), "bf16", "hand"),
    ("R,S1 | P0:avg over mesh[2,2]", "S0,R over mesh[2] ranks [4,5]", (4, 6), "f32", "auto"),
    # partial targets: local partial steps after
    ("S0,S1 over mesh[2,2]", "R,R | P0 over mesh[2] ranks [2,5]", (3, 4), "f32", "hand"),
    ("S0 over mesh[4]", "S0 | P1:max over mesh[2,2] ranks 4..7", (9,), "f32", "auto"),
    # a scalar
    ("() over mesh[2]", "() over mesh[3] ranks 5..7", (), "f32", "hand"),
]


def case_plan(case: Case) -> Plan:
    src_text, dst_text, shape, dtype, how = case
    src, dst = parse_layout(src_text), parse_layout(dst_text)
    if how == "hand":
        return hand_plan(src, dst, shape, dtype)
    return planner.plan(src, dst, shape, dtype, point_to_point=True)


def test_the_cases_cover_what_the_runtime_must_handle() -> None:
    plans = [case_plan(case) for case in CASES]
    assert all(any(s.op == "point_to_point" for s in plan.steps) for plan in plans)
    cross = [p for p in plans if p.src.mesh.ranks != p.dst.mesh.ranks or p.src.mesh.shape != p.dst.mesh.shape]
    assert any(not set(p.src.mesh.ranks) & set(p.dst.mesh.ranks) for p in cross)  # disjoint
    assert any(set(p.src.mesh.ranks) & set(p.dst.mesh.ranks) for p in cross)  # overlapping
    ops = [[s.op for s in p.steps] for p in plans]
    collective = ("all_gather", "all_to_all", "reduce_scatter", "all_reduce")
    assert any(op in collective for o in ops for op in o[: o.index("point_to_point")])  # collectives before
    assert any(op in collective for o in ops for op in o[o.index("point_to_point") :])  # collectives after
    assert any(p.steps[-1].op == "partial" for p in plans)
    assert any(0 in (hi - lo for lo, hi in p.dst.rank_piece(p.shape, r)) for p in plans for r in p.dst.mesh.ranks)
