"""The optimizers' exceptions: both are :class:`shardlang.ShardlangError`."""

from __future__ import annotations

from shardlang.errors import ShardlangError


class OptimizerError(ShardlangError):
    """Bad input to a sharded optimizer: a parameter the spec does not place, layouts that do
    not fit the tensor, a state dict saved for other layouts."""


class OptimizerStepError(ShardlangError):
    """A step failed (a reshard, a statistics reduction, a peer that died). It names the tensor
    and the stage; the calling rank's parameters and optimizer states are as before the step."""
