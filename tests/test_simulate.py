"""runtime.execution.simulate: every plan, run for all ranks in one process, lands on the target pieces.

Inputs are the full tensor cut by torch.chunk, or RANDOM addends for partial sources (random
values below the full for max, above it for min). Expected outputs are the target blocks cut
by torch.chunk, or, for a partial target, pieces that reduce back to the full tensor.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import planner
from runtime import ReshardError, dtype_name, simulate, unshard
from runtime.execution.program import compile_plan
from shardlang import parse_layout
from tests.test_runtime_support import (
    full_tensor,
    has_empty_piece,
    layouts,
    meshes,
    reference_piece,
    shapes,
    source_pieces,
)


@st.composite
def _pairs(draw: st.DrawFn):
    mesh = draw(meshes())
    shape = draw(shapes())
    src, dst = draw(layouts(mesh, len(shape))), draw(layouts(mesh, len(shape)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
    if dtype == torch.int64 and "avg" in {*src.partial_ops.values(), *dst.partial_ops.values()}:
        dtype = torch.float32  # integers cannot be averaged exactly
    return src, dst, shape, dtype, draw(st.integers(0, 2**16))


def _check(src, dst, shape, full, seed) -> planner.Plan:
    plan = planner.plan(src, dst, shape, dtype_name(full.dtype))
    pieces = source_pieces(full, src, seed)
    before = {r: p.clone() for r, p in pieces.items()}
    out = simulate(plan, pieces)
    assert all(torch.equal(before[r], pieces[r]) for r in pieces), "simulate wrote into its input"
    if dst.partial:
        assert torch.equal(unshard(out, dst), full)
    for rank in dst.mesh.ranks:
        expected = reference_piece(full, dst, rank)
        assert out[rank].shape == expected.shape and out[rank].dtype == full.dtype
        if not dst.partial:
            assert torch.equal(out[rank], expected), f"rank {rank}"
    return plan


@settings(max_examples=400, deadline=None)
@given(_pairs())
def test_simulate_reaches_the_target_pieces(case) -> None:
    src, dst, shape, dtype, seed = case
    _check(src, dst, shape, full_tensor(shape, dtype, seed), seed)


@settings(max_examples=100, deadline=None)
@given(_pairs())
def test_simulate_with_fractional_values(case) -> None:
    src, dst, shape, _, seed = case
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    plan = planner.plan(src, dst, shape, "f64")
    out = simulate(plan, source_pieces(full, src, seed))
    if dst.partial:
        torch.testing.assert_close(unshard(out, dst), full)
    else:
        for rank in dst.mesh.ranks:
            torch.testing.assert_close(out[rank], reference_piece(full, dst, rank))


# Hand-picked pairs the random ones may miss: every op, nested orders, empty pieces, every
# reduce op, mixed non-commuting partial axes, an 8-rank mesh.
HAND_PICKED = [
    ("S0,R over mesh[4]", "R,S0 over mesh[4]", (37, 24)),
    ("S01,R over mesh[2,2]", "S10,R over mesh[2,2]", (5, 3)),
    ("S10,R,R over mesh[2,2]", "R,S01,R over mesh[2,2]", (5, 3, 7)),
    ("R,R over mesh[2,2]", "S1,S0 over mesh[2,2]", (3, 1)),
    ("R | P0:avg over mesh[4]", "S0 over mesh[4]", (3,)),
    ("R,R | P0:max,P1 over mesh[2,2]", "R,S1 | P0:max over mesh[2,2]", (5, 3)),
    ("R,R | P0,P1:max over mesh[2,2]", "S0,R over mesh[2,2]", (5, 3)),
    ("R,R | P1:min over mesh[2,4]", "S1,R | P0:min over mesh[2,4]", (2, 2)),
    ("S2,R | P01 over mesh[2,2,2]", "R,S012 over mesh[2,2,2]", (37, 24)),
    ("R | P01 over mesh[2,4]", "R over mesh[2,4]", (1024,)),
    ("S0 over mesh[2,2]", "R | P01:avg over mesh[2,2]", (6,)),
    ("() | P0 over mesh[3]", "() over mesh[3]", ()),
    ("S0,R over mesh[4]", "S0,R over mesh[4]", (0, 3)),
]


@pytest.mark.parametrize(
    ("src", "dst", "shape", "dtype"),
    [
        (*pair, dtype)
        for pair in HAND_PICKED
        for dtype in (torch.float32, torch.bfloat16, torch.int64)
        # Integers cannot be averaged exactly (that error is tested below).
        if not (dtype == torch.int64 and "avg" in pair[0] + pair[1])
    ],
)
def test_simulate_hand_picked(src: str, dst: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    _check(parse_layout(src), parse_layout(dst), shape, full_tensor(shape, dtype, seed=7), seed=7)


def test_hand_picked_pairs_cover_every_op_and_reduce_op() -> None:
    ops, reduce_ops, empty = set(), set(), False
    for src, dst, shape in HAND_PICKED:
        plan = planner.plan(parse_layout(src), parse_layout(dst), shape)
        ops |= {s.op for s in plan.steps}
        reduce_ops |= {s.reduce_op for s in plan.steps if s.op in ("reduce_scatter", "all_reduce")}
        empty |= has_empty_piece(plan.src, shape) or has_empty_piece(plan.dst, shape)
    assert ops == set(planner.BASELINE_OPS)
    assert reduce_ops == {"sum", "avg", "max", "min"}
    assert empty


def test_simulate_rejects_bad_input() -> None:
    src, dst = parse_layout("S0 over mesh[2]"), parse_layout("R over mesh[2]")
    plan = planner.plan(src, dst, (4,), "f32")
    good = {0: torch.zeros(2), 1: torch.zeros(2)}
    with pytest.raises(ReshardError, match="for f32 but the pieces are bf16"):
        simulate(plan, {r: p.bfloat16() for r, p in good.items()})
    with pytest.raises(ReshardError, match=r"missing \[1\]"):
        simulate(plan, {0: good[0]})
    with pytest.raises(ReshardError, match=r"rank 1 holds a piece of shape \[3\]"):
        simulate(plan, {0: good[0], 1: torch.zeros(3)})
    averaged = planner.plan(parse_layout("R | P0:avg over mesh[2]"), dst, (4,), "i64")
    with pytest.raises(ReshardError, match="cannot average a tensor of i64"):
        simulate(averaged, {r: torch.zeros(4, dtype=torch.int64) for r in (0, 1)})
    with pytest.raises(ReshardError, match="cannot average"):
        compile_plan(averaged, 0)
