"""runtime.comm.groups: a group's ranks from the mesh's strides (against the mesh's own coordinates,
rank by rank), and one cached process group per ordered set of members and purpose."""

from __future__ import annotations

import itertools
import random

import pytest

from runtime.comm.groups import axis_ranks
from runtime.testing import run_ranks
from shardlang.mesh import Mesh, StridedRanks


def _by_coordinates(mesh: Mesh, axes: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """The ranks whose coordinate equals ``rank``'s off ``axes``, ordered row-major by their
    coordinate on ``axes`` (the first outermost)."""

    def off_axes(r: int) -> tuple[int, ...]:
        return tuple(c for a, c in enumerate(mesh.coordinate(r)) if a not in axes)

    members = [r for r in mesh.ranks if off_axes(r) == off_axes(rank)]
    return tuple(sorted(members, key=lambda r: tuple(mesh.coordinate(r)[a] for a in axes)))


def _meshes() -> list[Mesh]:
    rng = random.Random(0)
    meshes = []
    for _ in range(40):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 4)))
        size = 1
        for n in shape:
            size *= n
        kind = len(meshes) % 3
        ranks = range(size) if kind == 0 else range(5, 5 + size) if kind == 1 else rng.sample(range(3 * size), size)
        meshes.append(Mesh(shape, tuple(ranks)))
    return meshes


@pytest.mark.parametrize("mesh", _meshes(), ids=lambda m: f"{list(m.shape)}-{m.ranks[0]}")
def test_axis_ranks_are_the_ranks_that_share_the_other_coordinates(mesh: Mesh) -> None:
    for k in range(1, mesh.ndim + 1):
        for axes in itertools.permutations(range(mesh.ndim), k):
            for rank in mesh.ranks:
                assert axis_ranks(mesh, axes, rank) == _by_coordinates(mesh, axes, rank), (axes, rank)


def _groups_of(rank: int, world_size: int) -> dict[str, object]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import runtime.comm.groups as groups

    dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1024)
    made = []
    new_group = groups._new_group
    groups._new_group = lambda members, timeout, purpose: made.append(members) or new_group(members, timeout, purpose)
    members = tuple(range(0, 1024, 2))
    first = groups.ranks_group(members)
    again = [groups.ranks_group(members) for _ in range(3)]
    copy = groups.ranks_group(tuple(list(members)))
    runs = groups.ranks_group(StridedRanks(512, 0, 2))  # the same ranks as a run: the same group
    other = groups.ranks_group(tuple(range(512)))
    apart = groups.ranks_group(members, purpose="agreement")
    apart_again = groups.ranks_group(tuple(list(members)), purpose="agreement")
    names = {dist._get_process_group_name(g) for g in (first, other, apart)}
    return {
        "same": all(g is first for g in again) and copy is first and runs is first,
        "other": other is not first,
        "purpose": apart is not first and apart_again is apart and len(names) == 3,
        "made": len(made),
        "ranks": dist.get_process_group_ranks(first) == list(members) == dist.get_process_group_ranks(apart),
    }


def test_ranks_group_makes_one_group_per_ordered_members() -> None:
    got = run_ranks(_groups_of, 1, timeout=60)[0]
    assert got == {"same": True, "other": True, "purpose": True, "made": 3, "ranks": True}
