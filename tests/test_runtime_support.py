"""Helpers shared by the runtime tests, and tests of the helpers themselves.

* ``reference_piece``: a rank's block cut by nested ``torch.chunk`` (independent of
  ``Layout.piece`` and of the runtime), with the partial convention of ``runtime.shard``.
* ``random_addends``: every rank's piece of a partial layout as RANDOM addends whose
  reduction (in ascending axis order) is the full tensor; integer-valued, so every sum,
  average (by a group size) and max/min is exact in f32, bf16 and i64 and results compare
  with ``torch.equal``.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from hypothesis import strategies as st

from shardlang import REDUCE_OPS, Layout, Mesh, parse_layout

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def full_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small integer values, exact in every dtype even after the addends below."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=generator).to(dtype)


def chunk_block(full: torch.Tensor, layout: Layout, coordinate: tuple[int, ...]) -> torch.Tensor:
    """The block at a mesh coordinate: each dim cut with torch.chunk, outer axis first.
    torch.chunk returns fewer than n chunks when the length is short; the missing trailing
    chunks are empty."""
    block = full
    for d, axes in enumerate(layout.dims):
        for a in axes:
            chunks = torch.chunk(block, layout.mesh.shape[a], dim=d) if block.shape[d] else ()
            k = coordinate[a]
            block = chunks[k] if k < len(chunks) else block.narrow(d, block.shape[d], 0)
    return block


def reference_piece(full: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    coordinate = layout.mesh.coordinate(rank)
    block = chunk_block(full, layout, coordinate)
    if any(op == "sum" and coordinate[a] != 0 for a, op in layout.partial):
        return torch.zeros_like(block)
    return block


def _split(value: torch.Tensor, op: str, n: int, generator: torch.Generator, step: int = 1) -> list[torch.Tensor]:
    """``n`` random tensors whose reduction with ``op`` is ``value``; a sum's or mean's random
    addends are multiples of ``step``."""

    def noise(low: int, high: int) -> torch.Tensor:
        return torch.randint(low, high, value.shape, generator=generator).to(value.dtype)

    if op in ("sum", "avg"):
        parts = [noise(-4, 5) * step for _ in range(n - 1)]
        total = value * n if op == "avg" else value
        return [*parts, total - sum(parts, torch.zeros_like(value))]
    sign = -1 if op == "max" else 1
    parts = [value + sign * noise(0, 5) for _ in range(n)]
    holder = torch.randint(0, n, value.shape, generator=generator)
    return [torch.where(holder == i, value, p) for i, p in enumerate(parts)]


def random_addends(full: torch.Tensor, layout: Layout, seed: int) -> dict[int, torch.Tensor]:
    """Every rank's piece of ``full`` in ``layout``, partial axes holding random addends
    (replicas of one addend identical)."""
    generator = torch.Generator().manual_seed(seed)
    work = full.to(torch.float64 if full.dtype in FLOAT_DTYPES else torch.int64)
    mesh = layout.mesh
    # A plan may reduce the partial axes in any order, so a mean over n ranks (n not a power of
    # two) may divide a sum of addends before the other axes complete it: every addend is then
    # a multiple of the product of such n (one at most, on 8 ranks), and so is every partial sum.
    step = math.prod(mesh.shape[a] for a, op in layout.partial if op == "avg" and mesh.shape[a] & (mesh.shape[a] - 1))
    # addends[(c_p1, ..., c_pk)]: the full-shaped addend at those partial coordinates. The
    # highest axis is reduced last, so it is split first.
    addends = {(): work}
    for axis, op in reversed(layout.partial):
        addends = {
            (c, *key): part
            for key, value in addends.items()
            for c, part in enumerate(_split(value, op, mesh.shape[axis], generator, step))
        }
    pieces = {}
    for rank in mesh.ranks:
        coordinate = mesh.coordinate(rank)
        key = tuple(coordinate[a] for a, _ in layout.partial)
        pieces[rank] = chunk_block(addends[key], layout, coordinate).to(full.dtype).contiguous()
    return pieces


def source_pieces(full: torch.Tensor, layout: Layout, seed: int) -> dict[int, torch.Tensor]:
    """Random addends for a partial layout, plain blocks otherwise."""
    if layout.partial:
        return random_addends(full, layout, seed)
    return {r: reference_piece(full, layout, r).contiguous() for r in layout.mesh.ranks}


def has_empty_piece(layout: Layout, shape: tuple[int, ...]) -> bool:
    return any(0 in (hi - lo for lo, hi in layout.rank_piece(shape, r)) for r in layout.mesh.ranks)


# --- hypothesis strategies ------------------------------------------------------------------


@st.composite
def meshes(draw: st.DrawFn, max_ranks: int = 8) -> Mesh:
    """1-3 axes of size 1-4 (at most ``max_ranks`` ranks), sometimes with permuted ranks."""
    shape: list[int] = []
    for _ in range(draw(st.integers(1, 3))):
        room = max_ranks // math.prod(shape)
        shape.append(draw(st.integers(1, min(4, room))))
    size = math.prod(shape)
    ranks = draw(st.permutations(range(size))) if draw(st.booleans()) else range(size)
    return Mesh(shape=shape, ranks=ranks)


def random_layout(rng: random.Random, mesh: Mesh, ndim: int) -> Layout:
    """Each mesh axis replicated, partial (any op) or splitting a dim, in a random nesting order."""
    roles = [rng.choice(["R", "P", *range(ndim)]) for _ in range(mesh.ndim)]
    order = rng.sample(range(mesh.ndim), mesh.ndim)
    dims = [[a for a in order if roles[a] == d] for d in range(ndim)]
    partial = [(a, rng.choice(REDUCE_OPS)) for a in range(mesh.ndim) if roles[a] == "P"]
    return Layout(dims=dims, mesh=mesh, partial=partial)


@st.composite
def layouts(draw: st.DrawFn, mesh: Mesh, ndim: int) -> Layout:
    return random_layout(draw(st.randoms(use_true_random=False)), mesh, ndim)


@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, ...]:
    """0-3 dims of length 0-7: lengths shorter than an axis give empty pieces."""
    return tuple(draw(st.lists(st.integers(0, 7), max_size=3)))


# --- tests of the helpers -------------------------------------------------------------------


def test_chunk_block_by_hand() -> None:
    full = torch.arange(5)
    layout = parse_layout("S01 over mesh[2,2]")  # [0,3) -> [0,2),[2,3); [3,5) -> [3,4),[4,5)
    blocks = {c: chunk_block(full, layout, c).tolist() for c in itertools.product(range(2), range(2))}
    assert blocks == {(0, 0): [0, 1], (0, 1): [2], (1, 0): [3], (1, 1): [4]}
    layout = parse_layout("S10 over mesh[2,2]")  # axis 1 outer
    blocks = {c: chunk_block(full, layout, c).tolist() for c in itertools.product(range(2), range(2))}
    assert blocks == {(0, 0): [0, 1], (1, 0): [2], (0, 1): [3], (1, 1): [4]}
    short = parse_layout("S0 over mesh[4]")  # 3 rows over 4 ranks: 1, 1, 1, 0
    assert [chunk_block(torch.arange(3), short, (k,)).tolist() for k in range(4)] == [[0], [1], [2], []]


def _hand_reduce(stack: torch.Tensor, op: str) -> torch.Tensor:
    if op == "sum":
        return stack.sum(0)
    if op == "avg":
        return stack.mean(0)
    return stack.amax(0) if op == "max" else stack.amin(0)


@pytest.mark.parametrize(
    "text",
    ["R,R | P0:avg,P1:max over mesh[2,3]", "S1,R | P0:max,P2 over mesh[2,2,2]", "R | P0:min over mesh[3]"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_addends_reduce_to_the_full_tensor(text: str, dtype: torch.dtype) -> None:
    layout = parse_layout(text)
    shape = (5, 3)[: layout.ndim]
    full = full_tensor(shape, dtype, seed=1)
    pieces = random_addends(full, layout, seed=2)
    mesh: Mesh = layout.mesh
    # Reduce by hand: axis by axis in ascending order over the grid of pieces.
    grid: dict[tuple[int, ...], torch.Tensor] = {mesh.coordinate(r): p.double() for r, p in pieces.items()}
    for axis, op in layout.partial:
        reduced: dict[tuple[int, ...], torch.Tensor] = {}
        for coordinate in grid:
            key = (*coordinate[:axis], 0, *coordinate[axis + 1 :])
            stack = torch.stack([grid[(*key[:axis], c, *key[axis + 1 :])] for c in range(mesh.shape[axis])])
            reduced[key] = _hand_reduce(stack, op)
        grid = reduced
    for coordinate, value in grid.items():
        rank = mesh.rank_at(coordinate)
        assert torch.equal(value.to(dtype), reference_piece(full, Layout(dims=layout.dims, mesh=mesh), rank))
    # The addends are really random: not the shard() convention.
    assert not all(torch.equal(p, reference_piece(full, layout, r)) for r, p in pieces.items())
