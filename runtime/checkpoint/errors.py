"""The checkpoint's exception: a :class:`shardlang.ShardlangError`."""

from __future__ import annotations

from shardlang.errors import ShardlangError


class CheckpointError(ShardlangError):
    """A checkpoint that cannot be written or read: missing, truncated or corrupt files,
    metadata that does not describe its files, or tensors asked for with another shape,
    dtype or rank count than stored. The message names the file and the tensor; nothing
    the caller holds has been changed."""
