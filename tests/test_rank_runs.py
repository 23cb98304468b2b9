"""shardlang.mesh's runs of ranks (StridedRanks, GridRanks, as_ranks) against the explicit
tuples of the same ranks, by brute force: every group of every rank along every ordered set of
axes of many meshes (ranks from 0, from an offset, strided, listed at random), read through
every sequence operation the runtime uses (len, iteration, indexing, slicing, ``in``, index,
equality and order against tuples, hashing against the same ranks listed)."""

from __future__ import annotations

import itertools
import math
import operator
import pickle
import random

import pytest

from runtime.comm.groups import axis_ranks
from shardlang.errors import LayoutError
from shardlang.mesh import GridRanks, Mesh, RankRuns, RowMajorRanks, StridedRanks, as_ranks, highest_rank

NAMES = {"GridRanks": GridRanks, "StridedRanks": StridedRanks, "RowMajorRanks": RowMajorRanks}


def _by_coordinates(mesh: Mesh, axes: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """The oracle: the ranks whose coordinate equals ``rank``'s off ``axes``, row-major over
    their coordinates on ``axes`` (the first outermost), found rank by rank."""
    mine = mesh.coordinate(rank)
    group = []
    for digits in itertools.product(*(range(mesh.shape[a]) for a in axes)):
        coordinate = list(mine)
        for a, d in zip(axes, digits, strict=True):
            coordinate[a] = d
        group.append(mesh.rank_at(tuple(coordinate)))
    return tuple(group)


def _meshes() -> list[Mesh]:
    rng = random.Random(1)
    meshes = []
    for k in range(60):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 4)))
        size = math.prod(shape)
        kind = k % 4
        if kind == 0:
            ranks: tuple[int, ...] = tuple(range(size))
        elif kind == 1:
            ranks = tuple(range(7, 7 + size))
        elif kind == 2:
            ranks = tuple(range(3, 3 + 5 * size, 5))  # strided: every group is runs of step 5
        else:
            ranks = tuple(rng.sample(range(3 * size), size))
        meshes.append(Mesh(shape, ranks))
    return meshes


def _check_sequence(got: object, want: tuple[int, ...]) -> None:
    """``got`` behaves as the tuple ``want`` wherever the runtime reads a group."""
    assert len(got) == len(want)  # type: ignore[arg-type]
    assert tuple(got) == want and list(got) == list(want)  # type: ignore[call-overload]
    assert got == want and want == got and operator.ne(got, want) is False and operator.ne(want, got) is False
    assert [got[i] for i in range(-len(want), len(want))] == [want[i] for i in range(-len(want), len(want))]  # type: ignore[index]
    for s in (slice(None), slice(1, None), slice(None, -1), slice(None, None, 2), slice(None, None, -1)):
        assert tuple(got[s]) == want[s]  # type: ignore[index]
    for r in range(-2, (max(want) if want else 0) + 3):
        assert (r in got) == (r in want), r  # type: ignore[operator]
        assert got.count(r) == want.count(r)  # type: ignore[attr-defined]
        if r in want:
            assert got.index(r) == want.index(r)  # type: ignore[attr-defined]
        else:
            with pytest.raises(ValueError):
                got.index(r)  # type: ignore[attr-defined]
    assert "0" not in got  # type: ignore[operator]
    if want:
        assert highest_rank(got) == max(want)  # type: ignore[arg-type]
    if isinstance(got, RankRuns):
        assert list(want) == got and [*want, -1] != got
        assert eval(repr(got), NAMES) == got and hash(eval(repr(got), NAMES)) == hash(got)
        assert pickle.loads(pickle.dumps(got)) == got
    # One form per set of ranks: listed, or already runs, it is the same value and hash.
    listed = as_ranks(list(want))
    assert listed == got and hash(listed) == hash(as_ranks(got))  # type: ignore[arg-type]
    assert type(listed) is type(as_ranks(got))  # type: ignore[arg-type]


@pytest.mark.parametrize("mesh", _meshes(), ids=lambda m: f"{list(m.shape)}-{m.ranks[0]}-{m.ranks[-1]}")
def test_a_group_along_any_axes_is_its_ranks(mesh: Mesh) -> None:
    for k in range(1, mesh.ndim + 1):
        for axes in itertools.permutations(range(mesh.ndim), k):
            for i, rank in enumerate(mesh.ranks):
                got, want = axis_ranks(mesh, axes, rank), _by_coordinates(mesh, axes, rank)
                assert got == want, (axes, rank, got, want)
                if i in (0, 5, mesh.size - 1):  # every operation on a few groups per axes
                    _check_sequence(got, want)
                if isinstance(mesh.ranks, StridedRanks):
                    # A run of ranks gives a group of runs: no rank is listed, however many.
                    assert isinstance(got, RankRuns), (axes, rank, got)


def test_groups_order_and_key_as_their_tuples() -> None:
    rng = random.Random(2)
    groups = {}
    for mesh in _meshes()[:30]:
        for k in range(1, mesh.ndim + 1):
            for axes in itertools.permutations(range(mesh.ndim), k):
                rank = rng.choice(list(mesh.ranks))
                groups[axis_ranks(mesh, axes, rank)] = _by_coordinates(mesh, axes, rank)
    values = list(groups)
    rng.shuffle(values)
    # sorted as the tuples are, with tuples mixed in (a listed mesh's ranks beside runs)
    mixed = [tuple(v) if i % 3 == 0 else v for i, v in enumerate(values)]
    assert [tuple(v) for v in sorted(mixed)] == sorted(tuple(v) for v in values)
    for a, b in itertools.product(values[:40], repeat=2):
        ta, tb = tuple(a), tuple(b)
        assert (a < b, a <= b, a > b, a >= b) == (ta < tb, ta <= tb, ta > tb, ta >= tb)
        assert (a < tb, ta < b, a >= tb, ta >= b) == (ta < tb, ta < tb, ta >= tb, ta >= tb)
        assert (a == b) == (ta == tb) and (hash(a) == hash(b)) >= (ta == tb)
    # the same groups, listed: every one found under its key
    assert all(groups[as_ranks(want)] == want for want in groups.values())


def _grid(start: int, dims: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """Row-major ``start + sum(i_k * stride_k)``, the first run outermost, by brute force."""
    return tuple(
        start + sum(i * stride for i, (_, stride) in zip(digits, dims, strict=True))
        for digits in itertools.product(*(range(count) for count, _ in dims))
    )


def test_nested_runs_are_their_ranks() -> None:
    rng = random.Random(3)
    tried = 0
    while tried < 400:
        # strides from a random mesh's, so that the runs nest (as a group's do), in any order
        shape = [rng.randint(1, 4) for _ in range(rng.randint(1, 4))]
        step = rng.randint(1, 3)
        strides = [math.prod(shape[a + 1 :]) * step for a in range(len(shape))]
        axes = rng.sample(range(len(shape)), rng.randint(1, len(shape)))
        dims = tuple((shape[a], strides[a]) for a in axes)
        start = rng.randint(0, 20)
        want = _grid(start, dims)
        got = as_ranks(GridRanks(start, dims))
        _check_sequence(got, want)
        tried += 1
    # runs that continue one another are one run, however they are given
    assert GridRanks(4, ((2, 8), (4, 2))) == StridedRanks(8, 4, 2)
    assert hash(GridRanks(4, ((2, 8), (4, 2)))) == hash(StridedRanks(8, 4, 2))
    assert isinstance(as_ranks(GridRanks(4, ((2, 8), (4, 2)))), StridedRanks)
    assert as_ranks(GridRanks(3, ((1, 5), (4, 1), (1, 9)))) == RowMajorRanks(4, 3)
    assert isinstance(as_ranks((0, 1, 2, 3)), RowMajorRanks)


def test_listed_ranks_are_held_as_runs_only_where_they_are_runs() -> None:
    rng = random.Random(4)
    for _ in range(2000):
        n = rng.randint(0, 12)
        kind = rng.randint(0, 2)
        if kind == 0:  # anything: mostly not runs
            want = tuple(rng.sample(range(40), n))
        elif kind == 1:  # a group's nested runs (as in test_nested_runs_are_their_ranks), perhaps one rank changed
            shape = [rng.randint(1, 3) for _ in range(rng.randint(1, 3))]
            strides = [math.prod(shape[a + 1 :]) * rng.randint(1, 2) for a in range(len(shape))]
            axes = rng.sample(range(len(shape)), len(shape))
            want = list(_grid(rng.randint(0, 5), tuple((shape[a], strides[a]) for a in axes)))
            if rng.random() < 0.5:
                want[rng.randrange(len(want))] += rng.choice((-1, 1, 7))
            want = tuple(want)
        else:  # an arithmetic run, perhaps decreasing
            want = tuple(range(rng.randint(0, 9), 60, rng.choice((1, 2, 5)))[:n])
            if rng.random() < 0.3:
                want = want[::-1]
        got = as_ranks(want)
        assert got == want and tuple(got) == want
        if len(set(want)) == len(want) and isinstance(got, tuple) and len(want) > 1:
            # kept listed: no nested runs, with increasing strides spanning apart, give these ranks
            assert _as_grid(want) is None, want
        if isinstance(got, RankRuns):
            _check_sequence(got, want)
        else:
            assert isinstance(got, tuple)


def _as_grid(ranks: tuple[int, ...]) -> tuple | None:
    """Any nesting of runs with positive strides that lists ``ranks`` and that GridRanks
    accepts, found by trying every factorization of the length and every stride (slow)."""
    n = len(ranks)

    def factorizations(m: int) -> list[list[int]]:
        if m == 1:
            return [[]]
        return [[f, *rest] for f in range(2, m + 1) if m % f == 0 for rest in factorizations(m // f)]

    for counts in factorizations(n):
        # strides are read off the ranks: that of run k is the step after counts[k+1:] ranks
        inner = [math.prod(counts[k + 1 :]) for k in range(len(counts))]
        dims = tuple((c, ranks[w] - ranks[0]) for c, w in zip(counts, inner, strict=True))
        if any(s < 1 for _, s in dims) or _grid(ranks[0], dims) != ranks:
            continue
        try:
            GridRanks(ranks[0], dims)
        except LayoutError:
            continue
        return dims
    return None


def test_runs_that_would_repeat_or_interleave_ranks_are_refused() -> None:
    for dims in (((2, 2), (3, 1)), ((3, 2), (2, 3)), ((2, 1), (2, 1))):
        with pytest.raises(LayoutError, match="span"):
            GridRanks(0, dims)
    with pytest.raises(LayoutError, match="step"):
        StridedRanks(4, 0, 0)
    # the ranks of such runs, listed, stay listed
    assert isinstance(as_ranks((0, 3, 2, 5, 4, 7)), tuple)


def test_a_group_of_a_huge_mesh_is_built_and_read_without_walking_it(monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = Mesh((64, 8192, 8), axis_names=("pp", "dp", "tp"))  # 4,194,304 ranks
    rank = mesh.rank_at((5, 77, 3))

    def refuse(self: RankRuns) -> None:
        raise AssertionError("walked the ranks")

    for cls in (RankRuns, StridedRanks):
        monkeypatch.setattr(cls, "__iter__", refuse)
    dp = axis_ranks(mesh, (1,), rank)
    pp_tp = axis_ranks(mesh, (0, 2), rank)
    assert dp == StridedRanks(8192, 5 * 65536 + 3, 8) and len(dp) == 8192
    assert isinstance(pp_tp, GridRanks) and pp_tp.dims == ((64, 65536), (8, 1)) and len(pp_tp) == 512
    assert rank in dp and rank in pp_tp and dp.index(rank) == 77 and pp_tp.index(rank) == 5 * 8 + 3
    assert rank + 1 not in dp and rank + 8 not in pp_tp and pp_tp[-1] == 63 * 65536 + 77 * 8 + 7
    assert highest_rank(pp_tp) == pp_tp[-1] and hash(pp_tp) == hash(GridRanks(pp_tp.start, pp_tp.dims))
    assert axis_ranks(mesh, (0, 1, 2), rank) == RowMajorRanks(mesh.size)
