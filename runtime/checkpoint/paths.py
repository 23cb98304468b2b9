"""What a checkpoint reads lies inside it: the metadata file, the data folder and the rank
files may be links, but only to places inside the checkpoint's folder, and what is read is a
regular file (a FIFO or a device would block or never end). Any other is a
:class:`CheckpointError` naming the path."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from runtime.checkpoint.errors import CheckpointError
from shardlang.parser import file_kind

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def resolved_inside(root: Path, path: Path, what: str) -> str:
    """``path`` with every link followed; a :class:`CheckpointError` if that leaves ``root``."""
    top = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([top, real]) != top:
        raise CheckpointError(f"{path}: {what} is a link to {real}, outside the checkpoint {top}; refused")
    return real


def open_inside(root: Path, path: Path, what: str, *, missing: str) -> int:
    """A read-only descriptor of the regular file ``path`` inside ``root``; ``missing`` is the
    message when there is none."""
    real = resolved_inside(root, path, what)
    try:
        fd = os.open(real, _OPEN_FLAGS | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {missing}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open {what}: {e.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointError(f"{path}: {what} is {file_kind(mode)}, not a regular file")
    return fd
