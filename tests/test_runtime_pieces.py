"""runtime.shard and runtime.unshard, against blocks cut by torch.chunk and hand-made addends."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import ReshardError, shard, unshard
from shardlang import parse_layout
from tests.test_runtime_support import full_tensor, layouts, meshes, random_addends, reference_piece, shapes


@st.composite
def _layout_and_shape(draw: st.DrawFn):
    shape = draw(shapes())
    return draw(layouts(draw(meshes()), len(shape))), shape


@settings(max_examples=200, deadline=None)
@given(_layout_and_shape(), st.sampled_from([torch.float32, torch.int64]))
def test_shard_is_the_torch_chunk_block(case, dtype) -> None:
    layout, shape = case
    if dtype == torch.int64 and "avg" in layout.partial_ops.values():
        dtype = torch.float32  # integers cannot be averaged exactly
    full = full_tensor(shape, dtype, seed=0)
    for rank in layout.mesh.ranks:
        piece = shard(full, layout, rank)
        assert piece.is_contiguous()
        assert torch.equal(piece, reference_piece(full, layout, rank))
    assert torch.equal(unshard({r: shard(full, layout, r) for r in layout.mesh.ranks}, layout), full)


@settings(max_examples=200, deadline=None)
@given(_layout_and_shape(), st.sampled_from([torch.float32, torch.bfloat16, torch.int64]), st.integers(0, 2**16))
def test_unshard_reduces_random_addends(case, dtype, seed) -> None:
    layout, shape = case
    if dtype == torch.int64 and "avg" in layout.partial_ops.values():
        dtype = torch.float32
    full = full_tensor(shape, dtype, seed)
    assert torch.equal(unshard(random_addends(full, layout, seed), layout), full)


def test_unshard_reduces_in_ascending_axis_order() -> None:
    # max over axis 0 first, then the sum over axis 1: max(1,5) + max(2,-3) = 7. The other
    # order would give max(1+2, 5-3) = 3.
    layout = parse_layout("R | P0:max,P1 over mesh[2,2]")
    values = {(0, 0): 1.0, (1, 0): 5.0, (0, 1): 2.0, (1, 1): -3.0}
    pieces = {layout.mesh.rank_at(c): torch.tensor([v]) for c, v in values.items()}
    assert unshard(pieces, layout).tolist() == [7.0]


def test_shard_convention_for_partial_layouts() -> None:
    full = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    layout = parse_layout("S0,R | P1,P2:max over mesh[2,2,2] ranks [7,6,5,4,3,2,1,0]")
    for rank in layout.mesh.ranks:
        row, sum_coordinate, _ = layout.mesh.coordinate(rank)
        expected = full[row : row + 1] if sum_coordinate == 0 else torch.zeros(1, 2)
        assert torch.equal(shard(full, layout, rank), expected)


def test_shard_returns_a_copy() -> None:
    full = torch.arange(6.0)
    piece = shard(full, S0_ON_2, 0)
    piece.fill_(-1)
    assert full.tolist() == [0, 1, 2, 3, 4, 5]


def test_unshard_of_a_scalar() -> None:
    layout = parse_layout("() | P0:avg over mesh[2]")
    assert unshard({0: torch.tensor(1.0), 1: torch.tensor(4.0)}, layout).item() == 2.5


S0_ON_2 = parse_layout("S0 over mesh[2]")
R_AVG_ON_2 = parse_layout("R | P0:avg over mesh[2]")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: shard(torch.zeros(4), S0_ON_2, 5), "rank 5 is not in mesh"),
        (lambda: shard(torch.zeros(4, 2), S0_ON_2, 0), "1-d tensor"),
        (lambda: unshard({0: torch.zeros(2)}, S0_ON_2), r"missing \[1\]"),
        (
            lambda: unshard({0: torch.zeros(3), 1: torch.zeros(1)}, S0_ON_2),
            r"rank 0 holds a piece of shape \[3\], but 'S0 over mesh\[2\]' gives it \[2\] of \[4\]",
        ),
        (lambda: unshard({0: torch.zeros(2), 1: torch.zeros(2, dtype=torch.int64)}, S0_ON_2), "mix"),
        (lambda: unshard({r: torch.ones(2, dtype=torch.int64) for r in (0, 1)}, R_AVG_ON_2), "cannot average"),
    ],
)
def test_bad_pieces_are_reported(call, message) -> None:
    with pytest.raises(ReshardError, match=message):
        call()
