"""Bytes on disk: rank files written and synced, byte runs read back and counted, and the
atomic replacement of a file.

A rank file is the row-major bytes of its pieces one after the other (the tensors' own
dtypes, native byte order), nothing else: where each piece lies is in the metadata.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType

import torch

from runtime.checkpoint.errors import CheckpointError


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The row-major bytes of a CPU tensor (``tensor`` must be contiguous to share them)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class RankFileWriter:
    """Appends pieces to a new file; closing flushes and fsyncs it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = 0
        self._file = open(path, "wb")  # noqa: SIM115 -- closed by close() / the context manager

    def write(self, data: torch.Tensor) -> tuple[int, int]:
        """Append ``data``; its offset in the file and the CRC-32 of its bytes."""
        raw = raw_bytes(data.detach().to("cpu").contiguous())
        offset = self.size
        self._file.write(raw)
        self.size += raw.nbytes
        return offset, zlib.crc32(raw)

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()

    def __enter__(self) -> RankFileWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class RangeReader:
    """Reads byte runs of the rank files of one data folder, opening each file once and
    checking its size against the metadata first; counts the bytes and reads per file."""

    def __init__(self, folder: Path, sizes: Mapping[str, int]) -> None:
        self.folder = folder
        self.sizes = sizes
        self.bytes_read: dict[str, int] = {}
        self.reads = 0
        self._fds: dict[str, int] = {}

    def read(self, file: str, base: int, runs: Iterable[tuple[int, int]], into: memoryview, label: str) -> None:
        """Fill ``into`` with the runs ``(offset, length)`` (offsets from ``base``), in order."""
        fd = self._open(file, label)
        position = 0
        for offset, length in runs:
            got = os.preadv(fd, [into[position : position + length]], base + offset)
            self.reads += 1
            self.bytes_read[file] = self.bytes_read.get(file, 0) + got
            if got != length:
                raise CheckpointError(f"{self.folder / file}: {label}: the file ends early (truncated)")
            position += length

    def _open(self, file: str, label: str) -> int:
        fd = self._fds.get(file)
        if fd is not None:
            return fd
        path = self.folder / file
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: {label}: the rank file is missing") from None
        except OSError as e:
            raise CheckpointError(f"{path}: {label}: cannot open the rank file: {e.strerror}") from None
        self._fds[file] = fd
        size = os.fstat(fd).st_size
        if size != self.sizes[file]:
            state = "truncated" if size < self.sizes[file] else "longer than written"
            raise CheckpointError(
                f"{path}: {label}: the rank file has {size} bytes, the metadata says {self.sizes[file]} ({state})"
            )
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def fsync_folder(path: Path) -> None:
    """Make the folder's entries (new, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_synced(path: Path, data: bytes) -> None:
    """Replace ``path`` by a file holding ``data``, atomically: readers see the old file or
    the new one, also after a crash."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fsync_folder(path.parent)
