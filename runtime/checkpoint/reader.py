"""Reading stored pieces back, checked block by block.

A piece's bytes carry one CRC-32 per block of ``block_bytes`` (``metadata``). To fill a
sub-box of a piece, :class:`RangeReader` reads the whole blocks that the sub-box's byte runs
touch (adjacent blocks in one read, at most :data:`SPAN_BYTES` at a time), checks each, and
copies the runs out: a rank that needs a few rows of a piece reads about those rows, and
every byte it uses has been checked. Rank files are opened once, inside the checkpoint only
(``paths``), and their sizes checked against the metadata before anything is allocated for
them (:meth:`RangeReader.check_files`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from runtime.checkpoint.errors import CheckpointError
from runtime.checkpoint.metadata import StoredPiece, block_crc32
from runtime.checkpoint.paths import open_inside, resolved_inside

SPAN_BYTES = 16 << 20  # the most read into one buffer (whole blocks, at least one)


class RangeReader:
    """Reads pieces of the rank files of the data folder ``data`` of the checkpoint ``root``;
    counts the bytes and reads per file."""

    def __init__(self, root: Path, data: str, sizes: Mapping[str, int], block_bytes: int) -> None:
        self.root = root
        self.folder = root / data
        resolved_inside(root, self.folder, "the data folder")
        self.sizes = sizes
        self.block_bytes = block_bytes
        self.bytes_read: dict[str, int] = {}
        self.reads = 0
        self._fds: dict[str, int] = {}

    def check_files(self, files: Iterable[str], label: str) -> None:
        """Open ``files`` and check their sizes now (before buffers are made for them)."""
        for file in files:
            self._open(file, label)

    def read(
        self, piece: StoredPiece, runs: Iterable[tuple[int, int]], length: int, into: memoryview, label: str
    ) -> None:
        """Fill ``into`` with the byte runs ``(offset, length)`` of ``piece`` (offsets from its
        start, increasing; ``length``: the piece's bytes), after checking every block they touch."""
        runs = list(runs)
        fd = self._open(piece.file, label)
        block = self.block_bytes
        run, done, position = 0, 0, 0  # the run being copied, its bytes copied, where it goes in ``into``
        for first, stop in self._spans(runs):
            start, end = first * block, min(stop * block, length)
            direct = run < len(runs) and runs[run][0] + done == start and sum(runs[run]) >= end
            if direct:  # the span is all in the current run: read it where it goes
                buffer = into[position + done : position + done + end - start]
            else:
                buffer = memoryview(bytearray(end - start))
            self._read_exactly(fd, piece, buffer, start, label)
            for b in range(first, stop):
                got = block_crc32(buffer[b * block - start : min((b + 1) * block, end) - start], piece.identity, b)
                if got != piece.block_crc32[b]:
                    cause = "the file is corrupt"
                    if piece.identity:  # format 3: the checksum covers what the metadata says the piece is
                        cause += ", or the metadata's entry for it was edited or swapped with another's"
                    raise CheckpointError(
                        f"{self.folder / piece.file}: {label}: block {b} of the piece {[list(x) for x in piece.box]} "
                        f"(bytes {piece.offset + b * block}..{piece.offset + min((b + 1) * block, length)} of the "
                        f"file) does not match its checksum ({cause})"
                    )
            if direct:
                done += end - start
                if done == runs[run][1]:
                    run, done, position = run + 1, 0, position + runs[run][1]
                continue
            while run < len(runs):
                offset, size = runs[run]
                at = offset + done
                if at >= end:
                    break
                take = min(offset + size, end) - at
                into[position + done : position + done + take] = buffer[at - start : at - start + take]
                done += take
                if done < size:
                    break
                run, done, position = run + 1, 0, position + size

    def _spans(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The touched blocks as ranges ``[first, stop)``, adjacent ones merged, cut at SPAN_BYTES."""
        block = self.block_bytes
        merged: list[list[int]] = []
        for offset, size in runs:
            if size <= 0:
                continue
            first, stop = offset // block, (offset + size - 1) // block + 1
            if merged and first <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], stop)
            else:
                merged.append([first, stop])
        most = max(1, SPAN_BYTES // block)
        return [(b, min(b + most, stop)) for first, stop in merged for b in range(first, stop, most)]

    def _read_exactly(self, fd: int, piece: StoredPiece, buffer: memoryview, start: int, label: str) -> None:
        filled = 0
        while filled < len(buffer):
            try:
                got = os.preadv(fd, [buffer[filled:]], piece.offset + start + filled)
            except OSError as e:
                raise CheckpointError(f"{self.folder / piece.file}: {label}: cannot read: {e.strerror}") from None
            self.reads += 1
            self.bytes_read[piece.file] = self.bytes_read.get(piece.file, 0) + got
            if got == 0:
                raise CheckpointError(f"{self.folder / piece.file}: {label}: the file ends early (truncated)")
            filled += got

    def _open(self, file: str, label: str) -> int:
        fd = self._fds.get(file)
        if fd is not None:
            return fd
        path = self.folder / file
        fd = open_inside(self.root, path, "the rank file", missing=f"{label}: the rank file is missing")
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
