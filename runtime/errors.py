"""The runtime's exceptions: all of them are :class:`shardlang.ShardlangError`."""

from __future__ import annotations

from shardlang.errors import ShardlangError


class ReshardError(ShardlangError):
    """Bad input to the runtime: a piece of the wrong shape, a rank outside the mesh, a plan
    that does not belong to the layouts, a dtype the reduction cannot handle."""


class DistributedError(ShardlangError):
    """Communication failed: a peer died or never arrived within the timeout, a process group
    could not be created, or the ranks of a mesh disagree."""


class PlanMismatchError(DistributedError):
    """``verify=True`` found ranks of one mesh holding different plans."""


class ReplicaMismatchError(DistributedError):
    """Ranks that a layout declares replicas of each other hold different values
    (``runtime.comm.replicas``)."""
