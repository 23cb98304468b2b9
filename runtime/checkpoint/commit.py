"""The commit point of a save, and how a rank that lost touch with the others learns whether
it was passed.

Rank 0 commits: it writes the new metadata into the staging folder (``PENDING``), renames
the folder ``.staging-<id>`` to ``data-<id>``, then moves ``data-<id>/PENDING`` over
``metadata.json`` (``os.replace``): that move is the commit point. A rank that cannot hear
from the others (a peer died or did not arrive in time) first makes the outcome final, then
reads it from the disk (:func:`settle`): it renames the staging folder away, or if rank 0
already took it, the pending metadata; whichever of the two renames succeeds, rank 0's own
rename or replace of that name then fails, so the save can no longer be committed. If both
are gone, rank 0 has moved the pending metadata: the checkpoint is committed exactly when
``metadata.json`` names ``data-<id>``. So a save reported as not committed never is, and
every rank tells the same outcome. (All ranks see one directory: docs/limits.md.)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from runtime.checkpoint.errors import CheckpointError
from runtime.checkpoint.files import fsync_folder, replace_synced, write_synced
from runtime.checkpoint.metadata import METADATA_FILE
from runtime.checkpoint.paths import open_inside

STAGING = ".staging-"
DATA = "data-"
PENDING = "metadata.json.pending"
NOT_COMMITTED = "the new checkpoint was not committed; the previous checkpoint is unchanged"
COMMITTED = "the new checkpoint was committed (it is complete and loads)"


def staging_folder(directory: Path, token: str) -> Path:
    return directory / f"{STAGING}{token}"


def data_folder(directory: Path, token: str) -> Path:
    return directory / f"{DATA}{token}"


def named_data(directory: Path) -> str | None:
    """The data folder ``metadata.json`` names now, or ``None`` (no metadata, or unreadable)."""
    try:
        fd = open_inside(directory, directory / METADATA_FILE, "the metadata file", missing="")
        with os.fdopen(fd, "rb") as f:
            raw = json.loads(f.read())
    except (CheckpointError, OSError, ValueError, RecursionError):
        return None
    return raw.get("data") if isinstance(raw, dict) else None


def publish(directory: Path, token: str, metadata: bytes) -> None:
    """Rank 0: commit the staged save ``token`` with ``metadata``. Raises a
    :class:`CheckpointError` whose message ends with the outcome (:data:`NOT_COMMITTED` or
    that it was committed), and leaves no new folder behind unless it was committed."""
    staging, data = staging_folder(directory, token), data_folder(directory, token)
    try:
        write_synced(staging / PENDING, metadata)
        fsync_folder(staging)
        try:
            os.rename(staging, data)
        except FileNotFoundError:
            raise CheckpointError(
                "another rank gave up on this save before it was committed (it lost touch with the others)"
            ) from None
        fsync_folder(directory)
        replace_synced(data / PENDING, directory / METADATA_FILE)
    except Exception as e:
        reason = e.message if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
        if named_data(directory) == data.name:  # moved into place; syncing the folders after it failed
            raise CheckpointError(f"{reason}; {COMMITTED}, but may not survive a crash") from e
        for folder in (staging, data):
            shutil.rmtree(folder, ignore_errors=True)
        raise CheckpointError(f"{reason}; {NOT_COMMITTED}") from e
    try:
        leftovers = [e for e in directory.iterdir() if e.name != data.name and e.name.startswith((DATA, STAGING))]
    except OSError:  # committed all the same; the next save removes them
        leftovers = []
    for entry in leftovers:  # earlier data, and saves that crashed or were given up
        shutil.rmtree(entry, ignore_errors=True)


def settle(directory: Path, token: str, rank: int) -> str:
    """A rank other than 0 that lost touch during the save ``token``: make its outcome final
    and say what it is (see the module doc)."""
    staging, data = staging_folder(directory, token), data_folder(directory, token)
    try:
        for name in (staging, data / PENDING):
            try:
                os.rename(name, name.with_name(f"{name.name}.given-up-{rank}"))
                return NOT_COMMITTED
            except FileNotFoundError:
                continue
    except OSError as e:
        now = named_data(directory)
        return (
            f"whether the new checkpoint was committed is unknown (giving the save up failed: {e.strerror}; "
            f"{METADATA_FILE} names {now!r} now, the new data folder is {data.name!r})"
        )
    return COMMITTED if named_data(directory) == data.name else NOT_COMMITTED
