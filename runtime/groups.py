"""Process groups along mesh axes, created lazily on first use and cached.

``axis_group(mesh, axes)`` is the calling rank's group of the ranks that share its mesh
coordinate on every axis not in ``axes``. Group rank ``i`` is the ``i``-th member in mesh
coordinate order (row-major over ``axes`` in the order given), so block ``i`` of a collective
belongs to coordinate ``i``, whatever the mesh's rank numbering (``ranks [2,0,3,1]``).

Groups are created with ``use_local_synchronization=True``: only the members call into
``new_group``, so ranks outside a mesh (an idle rank next to ``mesh[3] ranks 0..2``) never
need to. Members must request overlapping groups in the same order, which holds when every
rank runs the same program (the same plans, the same optimizer steps). The cache is keyed by
the ordered member ranks, so two meshes that share a group share one process group, and it
is dropped when the default process group changes (destroy and re-init).

A user's ``DeviceMesh`` can supply the groups instead (``device_mesh=``): a single axis uses
``device_mesh.get_group(axis)``, after checking that the device mesh is the same grid of ranks
and orders the group like the layout's mesh; several axes use our own group, as DeviceMesh
has no public group over several dims.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from runtime.errors import DistributedError, ReshardError
from shardlang.mesh import Mesh

# Keyed by the ordered member ranks, or by (DeviceMesh, mesh, axis) for a user's groups.
_groups: dict[tuple, dist.ProcessGroup] = {}
_groups_world: object = None


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


def axis_ranks(mesh: Mesh, axes: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """The global ranks of ``rank``'s group along ``axes``, in mesh coordinate order."""
    coordinate = list(mesh.coordinate(rank))
    members = []
    for position in itertools.product(*(range(mesh.shape[a]) for a in axes)):
        for a, c in zip(axes, position, strict=True):
            coordinate[a] = c
        members.append(mesh.rank_at(tuple(coordinate)))
    return tuple(members)


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
    members: tuple[int, ...],
    device_mesh: DeviceMesh | None = None,
    *,
    timeout: datetime.timedelta | None = None,
) -> dist.ProcessGroup:
    """The process group of ``members`` (``axis_ranks(mesh, axes, rank)``, computed by the
    caller once), from ``device_mesh`` for a single axis when one is given."""
    cache = _cache()
    key = (members,) if device_mesh is None or len(axes) != 1 else (device_mesh, mesh, axes[0])
    group = cache.get(key)
    if group is None:
        if len(key) == 1:
            group = _new_group(members, timeout)
        else:
            group = _device_mesh_group(device_mesh, mesh, axes[0], members)
        cache[key] = group
    return group


def _cache() -> dict[tuple, dist.ProcessGroup]:
    """The group cache of the current default process group (emptied when it changes)."""
    global _groups_world
    world = dist.group.WORLD
    if world is not _groups_world:
        _groups.clear()
        _groups_world = world
    return _groups


def _new_group(members: tuple[int, ...], timeout: datetime.timedelta | None) -> dist.ProcessGroup:
    try:
        return dist.new_group(list(members), timeout=timeout, use_local_synchronization=True, sort_ranks=False)
    except (RuntimeError, ValueError) as e:
        raise DistributedError(f"cannot create the process group of ranks {list(members)}: {e}") from e


def check_device_mesh(device_mesh: DeviceMesh, mesh: Mesh) -> None:
    """A :class:`ReshardError` unless ``device_mesh`` is the same grid of ranks as ``mesh``."""
    grid = device_mesh.mesh
    if tuple(grid.shape) != mesh.shape or tuple(grid.flatten().tolist()) != mesh.ranks:
        raise ReshardError(
            f"the DeviceMesh {grid.tolist()} is not the layout's {mesh.describe()} "
            f"(ranks {list(mesh.ranks)} in shape {list(mesh.shape)})"
        )


def _device_mesh_group(
    device_mesh: DeviceMesh, mesh: Mesh, axis: int, members: tuple[int, ...]
) -> dist.ProcessGroup:
    check_device_mesh(device_mesh, mesh)
    group = device_mesh.get_group(axis)
    order = tuple(dist.get_process_group_ranks(group))
    if order != members:
        raise ReshardError(
            f"the DeviceMesh group of mesh axis {mesh.axis_label(axis)} orders its ranks {list(order)}, "
            f"but the layout's mesh orders them {list(members)}; pass no device_mesh to use shardlang's groups"
        )
    return group
