"""Bytes on disk: rank files written and synced with a CRC-32 per block of every piece, and
files and folders made durable. (Reading them back: ``reader``.)

A rank file is the row-major bytes of its pieces one after the other (the tensors' own
dtypes, native byte order), nothing else: where each piece lies is in the metadata.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

import torch

from runtime.checkpoint.metadata import block_crc32


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The row-major bytes of a CPU tensor (``tensor`` must be contiguous to share them)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class RankFileWriter:
    """Appends pieces to a new file; closing flushes and fsyncs it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = 0
        self._file = open(path, "wb")  # noqa: SIM115 -- closed by close() / the context manager

    def write(self, data: torch.Tensor, block_bytes: int, identity: bytes) -> tuple[int, list[int]]:
        """Append ``data``, the piece ``identity`` (``metadata.piece_identity``); its offset in
        the file and the checksum of each ``block_bytes`` of it (``metadata.block_crc32``)."""
        raw = raw_bytes(data.detach().to("cpu").contiguous())
        offset = self.size
        self._file.write(raw)
        self.size += raw.nbytes
        return offset, [
            block_crc32(raw[i : i + block_bytes], identity, i // block_bytes) for i in range(0, raw.nbytes, block_bytes)
        ]

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


def fsync_folder(path: Path) -> None:
    """Make the folder's entries (new, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """A new file ``path`` holding ``data``, on disk when this returns."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_synced(source: Path, target: Path) -> None:
    """Move ``source`` over ``target`` atomically (readers see the old file or the new one,
    also after a crash), then make both folders' entries durable."""
    os.replace(source, target)
    fsync_folder(target.parent)
    if source.parent != target.parent:
        fsync_folder(source.parent)
