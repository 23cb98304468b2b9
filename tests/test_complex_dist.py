"""Complex tensors (c64, c128): shard/unshard and runtime.reshard on 4 gloo ranks against the
full tensor sliced by hand; max and min partials of complex values are refused."""

from __future__ import annotations

import pytest
import torch

from runtime import ReshardError, reshard, shard, unshard
from runtime.testing import attempt, run_ranks
from shardlang import parse_layout
from tests.optim_support import hand_piece

MESH = "mesh[2,2]"
# (source, target, shape): splits, nestings, uneven and empty pieces, sum and avg partials.
CASES = [
    ("S0,R", "R,S1", (5, 3)),
    ("S01,R", "S10,R", (7, 2)),
    ("R,S1", "S0,S1", (3, 5)),
    ("R | P0", "S1 | P0", (6,)),
    ("R,R | P01:avg", "S0,R", (3, 4)),
    ("S1,R | P0", "R,R", (2, 3)),
    ("S(0,1)", "R", (2,)),
]
DTYPES = [torch.complex64, torch.complex128]


def full_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small Gaussian integers: every sum and halving of them below is exact."""
    gen = torch.Generator().manual_seed(seed)
    real, imag = (torch.randint(-8, 9, shape, generator=gen).to(torch.float64) for _ in range(2))
    return torch.complex(real, imag).to(dtype)


def source_piece(full: torch.Tensor, layout, rank: int) -> torch.Tensor:
    """The rank's block, made partial: over a sum axis the ranks hold ``block * k + offset_k``
    pieces that add up to the block; over an avg axis ``block + offset_k`` with offsets summing
    to zero (all Gaussian integers or halves, so exact)."""
    coordinate = layout.mesh.coordinate(rank)
    piece = hand_piece(full, layout.dims, layout.mesh.shape, coordinate).clone()
    for axis, op in sorted(layout.partial, reverse=True):
        k, n = coordinate[axis], layout.mesh.shape[axis]
        offset = (k - (n - 1) / 2) * (1 + 1j)
        piece = piece * (k == 0) + offset if op == "sum" else piece + offset
    return piece


def _ranks(rank: int, world_size: int) -> dict:
    out = {}
    for dtype in DTYPES:
        for i, (src_text, dst_text, shape) in enumerate(CASES):
            src, dst = parse_layout(f"{src_text} over {MESH}"), parse_layout(f"{dst_text} over {MESH}")
            full = full_tensor(shape, dtype, i)
            out[(str(dtype), i)] = reshard(source_piece(full, src, rank), src, dst, global_shape=shape)
    src, dst = parse_layout(f"R | P0:max over {MESH}"), parse_layout(f"R over {MESH}")
    out["max"] = attempt(lambda: reshard(torch.zeros(3, dtype=torch.complex64), src, dst, global_shape=(3,)))
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_ranks, 4, timeout=120)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_complex_reshard_gives_the_hand_sliced_block(ranks: list[dict], dtype: torch.dtype, case: int) -> None:
    src_text, dst_text, shape = CASES[case]
    dst = parse_layout(f"{dst_text} over {MESH}")
    full = full_tensor(shape, dtype, case)
    for rank, got in enumerate(ranks):
        result = got[(str(dtype), case)]
        assert result.dtype == dtype
        if dst.is_partial:
            continue  # checked through unshard below
        want = hand_piece(full, dst.dims, dst.mesh.shape, dst.mesh.coordinate(rank))
        assert torch.equal(result, want), (src_text, dst_text, rank)
    if dst.is_partial:
        assert torch.equal(unshard({r: got[(str(dtype), case)] for r, got in enumerate(ranks)}, dst), full)


def test_complex_max_partials_are_refused_on_every_rank(ranks: list[dict]) -> None:
    for got in ranks:
        kind, message, _ = got["max"]
        assert kind == "ReshardError" and "complex" in message and "max" in message


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_complex_shard_and_unshard(dtype: torch.dtype, case: int) -> None:
    src_text, _, shape = CASES[case]
    layout = parse_layout(f"{src_text} over {MESH}")
    full = full_tensor(shape, dtype, case)
    for rank in range(4):
        if not layout.is_partial:
            want = hand_piece(full, layout.dims, layout.mesh.shape, layout.mesh.coordinate(rank))
            assert torch.equal(shard(full, layout, rank), want)
    pieces = {rank: source_piece(full, layout, rank) for rank in range(4)}
    assert torch.equal(unshard(pieces, layout), full)


def test_complex_max_is_refused_by_unshard() -> None:
    layout = parse_layout(f"R | P0:max over {MESH}")
    with pytest.raises(ReshardError, match="complex"):
        unshard({r: torch.zeros(2, dtype=torch.complex128) for r in range(4)}, layout)
