"""Process groups along mesh axes, created lazily on first use and cached.

``axis_group(mesh, axes)`` is the calling rank's group of the ranks that share its mesh
coordinate on every axis not in ``axes``. Group rank ``i`` is the ``i``-th member in mesh
coordinate order (row-major over ``axes`` in the order given), so block ``i`` of a collective
belongs to coordinate ``i``, whatever the mesh's rank numbering (``ranks [2,0,3,1]``).

Groups are created with ``use_local_synchronization=True``: only the members call into
``new_group``, so ranks outside a mesh (an idle rank next to ``mesh[3] ranks 0..2``, the
ranks of the other mesh in a cross-mesh reshard) never need to. torch names such a group by
hashing its ranks WITH the number of groups the calling process already has, so two members
that created different numbers of groups before (a source-mesh rank and a target-mesh rank
after a cross-mesh reshard) would wait on different rendezvous keys until the timeout. We
name every group by its ordered members alone (``_member_named_groups``), so members agree
whatever else each created; members must still request overlapping groups in the same
order, which holds when every rank runs the same program. The cache is keyed by the ordered
member ranks in their one form (``shardlang.mesh.as_ranks``: runs of ranks, a few numbers
however large the group), so two meshes that share a group share one process group (and no
name is used twice), and it is dropped when the default process group changes (destroy and re-init).

``ranks_group(members)`` is the group of any ordered set of ranks (the union of two meshes,
whose ranks compare plan fingerprints before a cross-mesh reshard). ``ranks_group(members,
purpose="...")`` is another group of the same ranks, one per purpose: a collective on it never
pairs with one a peer has in flight on the plain group (the overlap's agreement, run while a
backward's bucket collectives may still be under way on the plain group).

A user's ``DeviceMesh`` can supply the groups instead (``device_mesh=``): a single axis uses
``device_mesh.get_group(axis)``, after checking that the device mesh is the same grid of ranks
and orders the group like the layout's mesh; several axes use our own group, as DeviceMesh
has no public group over several dims.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import inspect
import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from runtime.errors import DistributedError, ReshardError
from shardlang.mesh import GridRanks, Mesh, RankGroup, StridedRanks, as_ranks

# Keyed by (the ordered member ranks, purpose), or by (DeviceMesh, mesh, axis) for a user's groups.
_groups: dict[tuple, dist.ProcessGroup] = {}
_groups_world: object = None
# (id(members), purpose) -> (members, its group): ranks_group's lookup without hashing the members.
_by_identity: dict[tuple[int, str], tuple[Sequence[int], dist.ProcessGroup]] = {}
_BY_IDENTITY_MAX = 1024  # entries, then emptied (callers that build a new tuple every call)


def normalize_axes(mesh: Mesh, axes: int | Sequence[int]) -> tuple[int, ...]:
    """``axes`` as a tuple of distinct in-range axis indices (a single int is one axis)."""
    axes = (axes,) if isinstance(axes, int) else tuple(int(a) for a in axes)
    if not axes:
        raise ReshardError(f"no mesh axes given for a group of {mesh.describe()}")
    for a in axes:
        if not 0 <= a < mesh.ndim:
            raise ReshardError(f"mesh axis {a} is out of range for {mesh.describe()}")
    if len(set(axes)) != len(axes):
        raise ReshardError(f"mesh axes {list(axes)} repeat an axis")
    return axes


def axis_ranks(mesh: Mesh, axes: tuple[int, ...], rank: int) -> RankGroup:
    """The global ranks of ``rank``'s group along ``axes``, in mesh coordinate order, in their
    one form (``shardlang.mesh.as_ranks``).

    Computed from the mesh's row-major strides, not rank by rank through ``Mesh.rank_at``: on a
    mesh whose ranks are a run (declared without a ``ranks`` clause, or as a range) the group is
    runs too, O(axes) to build and to keep however many ranks it holds; on one of listed ranks,
    a group of 8,192 ranks costs about a millisecond (docs/memory.md, "At scale")."""
    coordinate = mesh.coordinate(rank)
    strides = [math.prod(mesh.shape[a + 1 :]) for a in range(mesh.ndim)]
    base = sum(c * s for a, (c, s) in enumerate(zip(coordinate, strides, strict=True)) if a not in axes)
    ranks = mesh.ranks
    if isinstance(ranks, StridedRanks):
        # Row-major over ``axes`` in the order given: the first axis outermost.
        runs = tuple((mesh.shape[a], strides[a] * ranks.step) for a in axes)
        return as_ranks(GridRanks(ranks.start + base * ranks.step, runs))
    positions = [base]
    for a in axes:
        offsets = range(0, mesh.shape[a] * strides[a], strides[a])
        positions = [p + offset for p in positions for offset in offsets]
    return as_ranks(tuple(ranks[p] for p in positions))


def axis_group(
    mesh: Mesh,
    axes: int | Sequence[int],
    device_mesh: DeviceMesh | None = None,
    *,
    timeout: datetime.timedelta | None = None,
) -> dist.ProcessGroup | None:
    """The calling rank's process group along mesh ``axes``; ``None`` when the calling rank
    is not in ``mesh``. Needs an initialized default process group.

    ``timeout`` bounds the group's creation (all members must arrive) and becomes the
    group's own timeout; ``None`` takes the default process group's.
    """
    axes = normalize_axes(mesh, axes)
    if not dist.is_initialized():
        raise DistributedError("torch.distributed is not initialized (call init_process_group first)")
    rank = dist.get_rank()
    if rank not in mesh.ranks:
        return None
    return group_for(mesh, axes, axis_ranks(mesh, axes, rank), device_mesh, timeout=timeout)


def group_for(
    mesh: Mesh,
    axes: tuple[int, ...],
    members: Sequence[int],
    device_mesh: DeviceMesh | None = None,
    *,
    timeout: datetime.timedelta | None = None,
) -> dist.ProcessGroup:
    """The process group of ``members`` (``axis_ranks(mesh, axes, rank)``, computed by the
    caller once), from ``device_mesh`` for a single axis when one is given."""
    if device_mesh is None or len(axes) != 1:
        return ranks_group(members, timeout=timeout)
    cache = _cache()
    key = (device_mesh, mesh, axes[0])
    group = cache.get(key)
    if group is None:
        group = cache[key] = _device_mesh_group(device_mesh, mesh, axes[0], members)
    return group


def ranks_group(
    members: Sequence[int], *, timeout: datetime.timedelta | None = None, purpose: str = ""
) -> dist.ProcessGroup:
    """The process group of exactly ``members`` (global ranks; group rank ``i`` is
    ``members[i]``), created by the members alone on first use, then cached. A ``purpose``
    other than ``""`` gives a separate group of the same members, named apart (every member
    must ask with the same purpose), whose collectives never pair with those of the plain
    group or of another purpose's."""
    cache = _cache()
    # Steps ask again and again with the same members (a bucket's, the commit flag's): found
    # by identity, without even reading a listed group's thousands of ranks on every call.
    seen = _by_identity.get((id(members), purpose))
    if seen is not None and seen[0] is members:
        return seen[1]
    # Keyed by the members' one form (runs, or a tuple where they are not): the same ranks
    # listed or as runs are one group, and a key of runs holds a few numbers, not the ranks.
    key = (as_ranks(members), purpose)
    group = cache.get(key)
    if group is None:
        group = cache[key] = _new_group(members, timeout, purpose)
    if len(_by_identity) >= _BY_IDENTITY_MAX:
        _by_identity.clear()
    _by_identity[(id(members), purpose)] = (members, group)  # holding ``members`` keeps its id unique
    return group


def shutdown() -> None:
    """End this rank's part in the job: wait for every rank at a barrier (no rank tears gloo
    down while a peer still talks to it), destroy the groups the runtime made and the default
    group. The runtime keeps its groups for the life of the default group; left to the
    interpreter's exit, their backend threads may still be releasing the last collective's work
    while the process shuts down."""
    if not dist.is_initialized():
        return
    dist.barrier()
    groups = list(_cache().values())
    _groups.clear()
    _by_identity.clear()
    for group in dict.fromkeys(groups):
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    dist.destroy_process_group()


def _cache() -> dict[tuple, dist.ProcessGroup]:
    """The group cache of the current default process group (emptied when it changes)."""
    global _groups_world
    world = dist.group.WORLD
    if world is not _groups_world:
        _groups.clear()
        _by_identity.clear()
        _groups_world = world
    return _groups


# Whether this torch's new_group can keep the ranks in the order given (newer releases); older
# ones always sort them, which is the same group where the members come in increasing order.
_KEEPS_ORDER = "sort_ranks" in inspect.signature(dist.new_group).parameters


def _new_group(members: Sequence[int], timeout: datetime.timedelta | None, purpose: str) -> dist.ProcessGroup:
    order = {"sort_ranks": False} if _KEEPS_ORDER else {}
    if not _KEEPS_ORDER and list(members) != sorted(members):
        raise DistributedError(
            f"the ranks {list(members)} of a mesh axis are not in increasing order, and torch "
            f"{torch.__version__} can only make groups of sorted ranks (new_group has no sort_ranks): "
            "upgrade torch, or give the mesh its ranks in increasing order along every axis"
        )
    try:
        with _member_named_groups(purpose):
            return dist.new_group(list(members), timeout=timeout, use_local_synchronization=True, **order)
    except (RuntimeError, ValueError) as e:
        what = f" for {purpose}" if purpose else ""
        raise DistributedError(f"cannot create the process group{what} of ranks {list(members)}: {e}") from e


@contextlib.contextmanager
def _member_named_groups(purpose: str) -> Iterator[None]:
    """Within the block, ``new_group(..., use_local_synchronization=True)`` names a group by its
    ordered ranks and ``purpose`` alone (see the module docstring). torch has no public argument for the name,
    so its private hashing function (``_hash_ranks_to_str(ranks) -> str``) is swapped for the
    block; a torch without it fails loudly here rather than deadlocking later."""
    original = c10d._hash_ranks_to_str
    c10d._hash_ranks_to_str = lambda ranks: _group_name(ranks, purpose)
    try:
        yield
    finally:
        c10d._hash_ranks_to_str = original


def _group_name(ranks: Sequence[int], purpose: str) -> str:
    text = "_".join(map(str, ranks)) + (f"/{purpose}" if purpose else "")
    return "shardlang-" + hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()


def check_device_mesh(device_mesh: DeviceMesh, mesh: Mesh) -> None:
    """A :class:`ReshardError` unless ``device_mesh`` is the same grid of ranks as ``mesh``."""
    grid = device_mesh.mesh
    if tuple(grid.shape) != mesh.shape or tuple(grid.flatten().tolist()) != mesh.ranks:
        raise ReshardError(
            f"the DeviceMesh {grid.tolist()} is not the layout's {mesh.describe()} "
            f"(ranks {list(mesh.ranks)} in shape {list(mesh.shape)})"
        )


def _device_mesh_group(device_mesh: DeviceMesh, mesh: Mesh, axis: int, members: Sequence[int]) -> dist.ProcessGroup:
    check_device_mesh(device_mesh, mesh)
    group = device_mesh.get_group(axis)
    order = tuple(dist.get_process_group_ranks(group))
    if order != members:
        raise ReshardError(
            f"the DeviceMesh group of mesh axis {mesh.axis_label(axis)} orders its ranks {list(order)}, "
            f"but the layout's mesh orders them {list(members)}; pass no device_mesh to use shardlang's groups"
        )
    return group
