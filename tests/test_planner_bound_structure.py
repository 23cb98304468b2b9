"""The receive lower bound from the layouts' structure (``planner.holdings``) equals the rank by
rank one (:func:`walked_bound`) wherever it answers, on random pairs of one mesh (uneven
lengths, empty pieces, nested splits, partial sources), and answers for the pairs step plans
are made of; it needs no walk over the ranks, so a million-rank mesh is as quick as four."""

from __future__ import annotations

import random

import pytest

from planner.holdings import receive_lower_bound, structural_receive_lower_bound
from shardlang import Layout, Mesh, parse_layout
from shardlang.mesh import RowMajorRanks


def walked_bound(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int) -> int:
    """The receive lower bound rank by rank: every target rank's piece less what its source
    piece holds of it (nothing where the source is partial over an axis of size > 1)."""
    holds = all(src.mesh.shape[a] == 1 for a, _ in src.partial)
    most = 0
    for rank in dst.mesh.ranks:
        target = dst.rank_piece(shape, rank)
        held = src.rank_piece(shape, rank).intersect(target) if holds and rank in src.mesh.ranks else None
        most = max(most, target.numel - (held.numel if held else 0))
    return most * itemsize


def _random_layout(rng: random.Random, mesh: Mesh, ndim: int) -> Layout:
    dims: list[list[int]] = [[] for _ in range(ndim)]
    partial = []
    for axis in range(mesh.ndim):
        where = rng.randrange(ndim + 2)
        if where < ndim:
            dims[where].append(axis)
        elif where == ndim and rng.random() < 0.3:
            partial.append((axis, "sum"))
    for d in dims:
        rng.shuffle(d)
    return Layout(dims=dims, mesh=mesh, partial=partial)


def test_equals_the_rank_by_rank_bound_on_random_pairs() -> None:
    rng = random.Random(7)
    answered = 0
    for _ in range(600):
        shape_mesh = tuple(rng.choice((1, 2, 3, 4)) for _ in range(rng.randrange(1, 4)))
        mesh = Mesh(shape_mesh)
        ndim = rng.randrange(1, 4)
        shape = tuple(rng.choice((0, 1, 2, 3, 5, 7, 8, 12, 13)) for _ in range(ndim))
        src, dst = _random_layout(rng, mesh, ndim), _random_layout(rng, mesh, ndim)
        if rng.random() < 0.5:  # the pairs of a step: one layout the other split further
            dims = [list(d) for d in dst.dims]
            for axis in range(mesh.ndim):
                if all(axis not in d for d in dims) and rng.random() < 0.5:
                    dims[rng.randrange(ndim)].append(axis)
            free = [a for a in range(mesh.ndim) if all(a not in d for d in dims)]
            finer = Layout(dims=dims, mesh=mesh, partial=[(a, "sum") for a in free if rng.random() < 0.2])
            coarse = Layout(dims=dst.dims, mesh=mesh)
            src, dst = (finer, coarse) if rng.random() < 0.5 else (coarse, finer)
        itemsize = rng.choice((1, 2, 4))
        got = structural_receive_lower_bound(src, dst, shape, itemsize)
        dtype = {1: "i8", 2: "bf16", 4: "f32"}[itemsize]
        if got is not None:
            answered += 1
            walked = walked_bound(src, dst, shape, itemsize)
            assert got == walked == receive_lower_bound(src, dst, shape, dtype), (src, dst, shape)
    assert answered > 300


@pytest.mark.parametrize(
    ("src", "dst", "shape"),
    [
        ("S(tp,dp),R over mesh[dp=4096,tp=8]", "S(tp),R over mesh[dp=4096,tp=8]", (11008, 4096)),
        ("S(tp),R | P(dp):avg over mesh[dp=4096,tp=8]", "S(tp,dp),R over mesh[dp=4096,tp=8]", (11008, 4096)),
        ("R,R over mesh[dp=131072]", "S(dp),R over mesh[dp=131072]", (8192, 8192)),
    ],
)
def test_answers_the_pairs_of_zero_steps_at_scale(src: str, dst: str, shape: tuple[int, ...]) -> None:
    s, d = parse_layout(src), parse_layout(dst)
    got = structural_receive_lower_bound(s, d, shape, 2)
    assert got is not None
    # by hand: into S(tp), 1376 rows a rank: its dp piece is 1 row, or none where dp >= 1376, so
    # some rank lacks all 1376; a reduce-scatter lacks its whole piece (the source is partial),
    # 1 row; a slice lacks nothing
    expected = {
        "S(tp),R over mesh[dp=4096,tp=8]": 1376 * 4096 * 2,
        "S(tp,dp),R over mesh[dp=4096,tp=8]": 1 * 4096 * 2,
        "S(dp),R over mesh[dp=131072]": 0,
    }[dst]
    assert got == expected


def test_a_million_ranks_are_never_walked(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: RowMajorRanks) -> None:
        raise AssertionError("walked the ranks")

    monkeypatch.setattr(RowMajorRanks, "__iter__", refuse)
    mesh = "over mesh[dp=1024,tp=1024]"
    got = structural_receive_lower_bound(
        parse_layout(f"S(tp),R {mesh}"), parse_layout(f"S(tp,dp),R {mesh}"), (10**6, 7), 4
    )
    # 10**6 rows: pieces of 977 rows over tp, then of 1 row over dp; a partial-free source holds them
    assert got == 0
    got = structural_receive_lower_bound(
        parse_layout(f"S(tp,dp),R {mesh}"), parse_layout(f"S(tp),R {mesh}"), (10**6, 7), 4
    )
    assert got == 977 * 7 * 4  # and back: dp ranks past 977 held no row


def test_a_plans_json_at_a_million_ranks_walks_no_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import planner

    mesh = "over mesh[dp=1024,tp=1024]"
    plan = planner.plan(parse_layout(f"S(tp),R | P(dp):avg {mesh}"), parse_layout(f"S(tp,dp),R {mesh}"), (10**6, 7))

    def refuse(self: RowMajorRanks) -> None:
        raise AssertionError("walked the ranks")

    monkeypatch.setattr(RowMajorRanks, "__iter__", refuse)
    # by hand: pieces of 977 rows over tp, then of 1 row (or none) over dp; the source is
    # partial, so a rank lacks its whole target piece: 1 row of 7 f32
    assert plan.to_json()["lower_bound_bytes"] == plan.lower_bound_bytes == 7 * 4
