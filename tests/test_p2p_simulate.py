"""Point-to-point steps and cross-mesh plans in the simulator, and the checks on their transfers.

Expected pieces are the full tensor cut by torch.chunk on the target layout
(``reference_piece``); partial sources hold RANDOM addends, resolved by collectives on the
source mesh before the point-to-point step, so every result is exact.
"""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import planner
from planner.plans import Plan, Step, Transfer
from runtime import ReshardError, shard, simulate, torch_dtype, unshard
from runtime.comm.exchange import compile_exchange
from runtime.execution.program import bytes_sent, compile_plan
from shardlang import Mesh, parse_layout
from tests.test_p2p_support import CASES, Case, case_plan, hand_plan, traffic
from tests.test_runtime_support import full_tensor, layouts, meshes, reference_piece, shapes, source_pieces


def _check(plan: Plan, seed: int) -> None:
    full = full_tensor(plan.shape, torch_dtype(plan.dtype), seed)
    out = simulate(plan, source_pieces(full, plan.src, seed))
    assert sorted(out) == sorted(plan.dst.mesh.ranks)
    if plan.dst.partial and not any(s.op == "point_to_point" for s in plan.steps):
        # A collective plan between partial layouts may keep the random addends it was given.
        assert torch.equal(unshard(out, plan.dst), full)
        return
    # After a point-to-point step every value is final; partial steps then zero the
    # non-leading addends of a sum exactly as shard() does.
    for rank, piece in out.items():
        expected = reference_piece(full, plan.dst, rank)
        assert piece.dtype == full.dtype and piece.is_contiguous()
        assert torch.equal(piece, expected), f"rank {rank}: {piece} != {expected}"
        assert torch.equal(piece, shard(full, plan.dst, rank))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]} -> {c[1]} {list(c[2])} {c[3]} {c[4]}")
def test_simulate_the_shared_cases(case: Case) -> None:
    _check(case_plan(case), seed=len(case[0]) + 7)


@st.composite
def _placed_meshes(draw: st.DrawFn) -> Mesh:
    """A mesh of up to 8 ranks drawn from global ranks 0..7 in any order."""
    mesh = draw(meshes())
    ranks = draw(st.permutations(range(8)))[: mesh.size]
    return Mesh(shape=mesh.shape, ranks=ranks)


@st.composite
def _cross_mesh_pairs(draw: st.DrawFn):
    shape = draw(shapes())
    src_mesh, dst_mesh = draw(_placed_meshes()), draw(_placed_meshes())
    src, dst = draw(layouts(src_mesh, len(shape))), draw(layouts(dst_mesh, len(shape)))
    dtype = draw(st.sampled_from(["f32", "bf16", "i64"]))
    if dtype == "i64" and "avg" in {*src.partial_ops.values(), *dst.partial_ops.values()}:
        dtype = "f32"  # integers cannot be averaged exactly
    return src, dst, shape, dtype, draw(st.integers(0, 2**16))


@settings(max_examples=150, deadline=None)
@given(_cross_mesh_pairs())
def test_hand_made_cross_mesh_plans_land_on_the_target_pieces(pair) -> None:
    src, dst, shape, dtype, seed = pair
    _check(hand_plan(src, dst, shape, dtype), seed)


def test_a_mean_over_three_ranks_taken_before_a_sum_is_exact() -> None:
    """The plan averages over the 3 ranks of axis 1 before it sums over axis 0: the source's
    random addends must leave every partial sum divisible by 3 (hypothesis found this case)."""
    src = parse_layout("R | P0,P1:avg over mesh[2,3,1]")
    plan = hand_plan(src, parse_layout("R over mesh[4,1,2]"), (5,), "f32")
    assert [(s.op, s.axis, s.reduce_op) for s in plan.steps[:2]] == [
        ("reduce_scatter", 1, "avg"),
        ("all_reduce", 0, "sum"),
    ]
    _check(plan, seed=1)


@settings(max_examples=100, deadline=None)
@given(_cross_mesh_pairs())
def test_the_planners_cross_mesh_plans_land_on_the_target_pieces(pair) -> None:
    src, dst, shape, dtype, seed = pair
    _check(planner.plan(src, dst, shape, dtype, point_to_point=True), seed)


def test_exchange_boxes_sends_and_copies() -> None:
    # Rows [0,4) on ranks 0 and 1 of mesh[2] -> columns on mesh[2] ranks [1,2].
    src, dst = parse_layout("S0,R over mesh[2]"), parse_layout("R,S0 over mesh[2] ranks [1,2]")
    plan = hand_plan(src, dst, (4, 6), "f32")
    zero, one, two = (compile_exchange(plan, 0, rank) for rank in (0, 1, 2))
    assert zero.sends == ((1, (((0, 2), (0, 3)),)), (2, (((0, 2), (3, 6)),))) and not zero.receives
    assert zero.after is None and zero.peers == (1, 2) and not zero.copies
    # Rank 1 keeps its own rows [2,4) of columns [0,3): a copy from its piece into its output.
    assert one.copies == ((((0, 2), (0, 3)), ((2, 4), (0, 3))),)
    assert one.receives == ((0, (((0, 2), (0, 3)),)),) and one.sends == ((2, (((0, 2), (3, 6)),)),)
    assert two.sends == () and two.after == (4, 3) and two.peers == (0, 1)
    assert compile_exchange(plan, 0, 5) is None
    assert bytes_sent(compile_plan(plan, 1)[0], 4) == 2 * 3 * 4 == traffic(plan.steps[0].transfers, 4)[0][1]


def test_contiguous_boxes_move_in_place() -> None:
    src, dst = parse_layout("S0,R over mesh[2]"), parse_layout("S0,R over mesh[4] ranks 2..5")
    plan = hand_plan(src, dst, (8, 3), "f32")
    sender, receiver = compile_exchange(plan, 0, 0), compile_exchange(plan, 0, 2)
    piece = torch.arange(12.0).reshape(4, 3)
    for _, message in sender.pack(piece):  # row blocks: views of the piece, no copy
        assert message.untyped_storage().data_ptr() == piece.untyped_storage().data_ptr()
    out = torch.empty(receiver.after)
    ((_, buffer, in_place),) = receiver.receive_buffers(out)
    assert in_place and buffer.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    # Column blocks are not contiguous: packed by the sender, received into a buffer, placed after.
    columns = hand_plan(parse_layout("R,S0 over mesh[2]"), parse_layout("R,R over mesh[1] ranks [2]"), (3, 4), "f32")
    sender, receiver = compile_exchange(columns, 0, 1), compile_exchange(columns, 0, 2)
    ((_, message),) = sender.pack(torch.arange(6.0).reshape(3, 2))
    assert message.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    out = torch.zeros(receiver.after)
    buffers = receiver.receive_buffers(out)
    assert [(peer, in_place) for peer, _, in_place in buffers] == [(0, False), (1, False)]
    buffers[0][1].fill_(-1.0)
    buffers[1][1].copy_(message)
    receiver.place(out, buffers)
    assert torch.equal(out, torch.cat([torch.full((3, 2), -1.0), torch.arange(6.0).reshape(3, 2)], dim=1))


def _plan_with(transfers: tuple[Transfer, ...], src: str = "S0 over mesh[2]", dst: str = "S0 over mesh[2] ranks 2..3"):
    before, after = parse_layout(src), parse_layout(dst)
    step = Step("point_to_point", None, None, None, None, after, 0, 0.0, transfers)
    return Plan(before, after, (4,), "f32", (step,))


@pytest.mark.parametrize(
    ("transfers", "message"),
    [
        ((Transfer(0, 2, ((0, 2),)), Transfer(0, 3, ((2, 4),))), r"box \[2:4\] is not inside rank 0's source piece"),
        ((Transfer(0, 2, ((0, 2),)),), r"rank 3's target piece \[2:4\] has 2 elements but its transfers bring 0"),
        ((Transfer(0, 2, ((0, 2),)), Transfer(0, 2, ((1, 2),)), Transfer(1, 3, ((2, 4),))), r"\[1:2\], which overlap"),
        ((Transfer(0, 2, ((0, 2),)), Transfer(1, 6, ((2, 4),))), "rank 6 is not in the target mesh"),
        ((Transfer(0, 2, ((0, 5),)),), r"box \[0:5\]\) is not a box of the tensor of shape \[4\]"),
        ((Transfer(0, 2, ((0, 2), (0, 1))),), r"is not a box of the tensor"),
    ],
)
def test_bad_transfers_are_refused_naming_the_step(transfers: tuple[Transfer, ...], message: str) -> None:
    plan = _plan_with(transfers)
    pieces = {0: torch.zeros(2), 1: torch.zeros(2)}
    step = r"step 1 of 1 \(point_to_point\(messages=\d\) -> S0 over mesh\[2\] ranks 2\.\.3\)"
    with pytest.raises(ReshardError, match=step):
        simulate(plan, pieces)
    with pytest.raises(ReshardError, match=message):
        compile_plan(plan, 0)


def test_partial_states_around_a_point_to_point_step_are_refused() -> None:
    good = (Transfer(0, 2, ((0, 4),)), Transfer(0, 3, ((0, 4),)))
    partial_source = _plan_with(good, src="R | P0 over mesh[2]", dst="R over mesh[2] ranks 2..3")
    with pytest.raises(ReshardError, match=r"state before a point_to_point step must not be partial .* axes 0"):
        compile_plan(partial_source, 2)
    partial_target = _plan_with(good, src="R over mesh[2]", dst="R | P0 over mesh[2] ranks 2..3")
    with pytest.raises(ReshardError, match="state after a point_to_point step must not be partial"):
        compile_plan(partial_target, 2)
    # Partial over an axis of size 1 holds final values: allowed.
    size_one = _plan_with(good, src="R | P1 over mesh[2,1]", dst="R over mesh[2] ranks 2..3")
    out = simulate(size_one, {0: torch.arange(4.0), 1: torch.arange(4.0)})
    assert all(torch.equal(piece, torch.arange(4.0)) for piece in out.values())


def test_only_a_point_to_point_step_changes_meshes() -> None:
    src, dst = parse_layout("S0 over mesh[2]"), parse_layout("R over mesh[2] ranks 2..3")
    gather = planner.plan(src, parse_layout("R over mesh[2]"), (4,)).steps[0]
    plan = Plan(src, dst, (4,), "f32", (attrs.evolve(gather, layout=dst),))
    with pytest.raises(ReshardError, match=r"step 1 of 1 \(all_gather\(axis=0, dim=0\)\) goes from mesh\[2\] to"):
        compile_plan(plan, 0)
    with pytest.raises(ReshardError, match=r"ends on mesh\[2\], not on the target's mesh"):
        compile_plan(Plan(src, dst, (4,), "f32", ()), 0)


def test_ranks_outside_a_step_take_no_part() -> None:
    plan = case_plan(("S0,R | P1 over mesh[2,2]", "R,S0 over mesh[4] ranks 4..7", (6, 5), "f32", "hand"))
    source_only, target_only, empty = compile_plan(plan, 1), compile_plan(plan, 6), compile_plan(plan, 7)
    assert source_only[0] is not None and source_only[1].after is None
    assert target_only[0] is None and target_only[1].after == (6, 1) and not target_only[1].sends
    assert empty[1].after == (6, 0) and empty[1].peers == ()
    assert all(move is None for move in compile_plan(plan, 9))


def test_simulate_takes_source_pieces_and_gives_target_pieces() -> None:
    plan = hand_plan(parse_layout("S0 over mesh[2]"), parse_layout("S0 over mesh[3] ranks 4..6"), (5,), "f32")
    with pytest.raises(ReshardError, match=r"missing \[0, 1\], not in the mesh \[4, 5, 6\]"):
        simulate(plan, {r: torch.zeros(2) for r in (4, 5, 6)})
    out = simulate(plan, {0: torch.arange(3.0), 1: torch.arange(3.0, 5.0)})
    assert [out[r].tolist() for r in (4, 5, 6)] == [[0.0, 1.0], [2.0, 3.0], [4.0]]
    assert math.prod(out[6].shape) == 1
