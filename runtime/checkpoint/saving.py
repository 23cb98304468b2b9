"""Saving: every rank writes its pieces to its own file in a staging folder; rank 0 then
checks that the pieces cover every tensor, renames the folder and replaces the metadata file,
which is the commit point.

    path/metadata.json          -> names data-<id>
    path/data-<id>/rank-00000.bin ...
    path/.staging-<id>/         a save in progress (or one that crashed)

Until the new metadata file replaces the old one (``os.replace``, after every rank file and
the folder were fsynced), the old metadata names the old, untouched data folder; after it,
the old folder is removed. A save that fails anywhere, on any rank, leaves the previous
checkpoint as it was and raises on every rank.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from planner.holdings import box_elements
from runtime.checkpoint import agree
from runtime.checkpoint.errors import CheckpointError
from runtime.checkpoint.files import RankFileWriter, fsync_folder, replace_synced
from runtime.checkpoint.items import (
    Item,
    LocalPiece,
    check_piece,
    param_groups_json,
    resolved,
    saved_piece,
    state_item,
    state_key,
)
from runtime.checkpoint.metadata import METADATA_FILE, Metadata, StoredOptimizer, StoredPiece, StoredTensor
from runtime.comm import timeout_of
from runtime.optim.base import HeldTensor, ShardedOptimizer
from shardlang.parser import parse_layout

STAGING = ".staging-"
DATA = "data-"


def save(
    path: str | os.PathLike[str],
    tensors: Mapping[str, LocalPiece] | None = None,
    optimizer: ShardedOptimizer | None = None,
    *,
    timeout: float | datetime.timedelta | None = None,
) -> None:
    """Save ``tensors`` (this rank's pieces, by name) and ``optimizer`` (its parameters and
    states) to the checkpoint at ``path``, replacing the one there only once every rank has
    written its part. Every rank of the job calls it; ranks outside a tensor's mesh pass
    ``None`` for it or leave it out. A :class:`CheckpointError` on every rank if any rank
    fails; a ``DistributedError`` if a rank does not arrive within ``timeout`` (seconds or a
    timedelta; default the runtime's)."""
    directory = Path(path)
    timeout = timeout_of(timeout, CheckpointError)
    what = f"saving the checkpoint {directory}"
    rank, size = agree.rank_and_size()
    pieces: dict[str, LocalPiece] = {}
    messages = agree.all_or_none(
        lambda: pieces.update(_held_pieces(tensors or {}, optimizer, rank)),
        payload=secrets.token_hex(8) if rank == 0 else "",
        timeout=timeout,
        what=what,
        outcome="nothing was written",
    )
    staging = directory / f"{STAGING}{messages[0]}"

    def write() -> None:
        items = [saved_piece(key, resolved(key, piece, rank, timeout), rank) for key, piece in sorted(pieces.items())]
        record = None
        if optimizer is not None:
            held = optimizer.held_tensors()
            items += _state_items(held, rank)
            record = _optimizer_record(optimizer, held)
        staging.mkdir(parents=True, exist_ok=True)
        index = _write_part(staging / _rank_file(rank), items) | {"optimizer": record}
        (staging / _index_file(rank)).write_text(json.dumps(index))

    unchanged = "the previous checkpoint is unchanged"
    cleanup = (lambda: shutil.rmtree(staging, ignore_errors=True)) if rank == 0 else None
    agree.all_or_none(write, timeout=timeout, what=what, outcome=unchanged, cleanup=cleanup)
    commit = (lambda: _commit(directory, staging, size)) if rank == 0 else (lambda: None)
    agree.all_or_none(commit, timeout=timeout, what=what, outcome=unchanged, cleanup=cleanup)


def _held_pieces(tensors: Mapping[str, LocalPiece], optimizer: ShardedOptimizer | None, rank: int) -> dict:
    """The pieces of ``tensors`` this rank holds; checks names against the optimizer's."""
    pieces = {key: piece for key, piece in tensors.items() if check_piece(key, piece, rank)}
    if optimizer is not None:
        if not isinstance(optimizer, ShardedOptimizer):
            raise CheckpointError(f"optimizer: expected a sharded optimizer, got {type(optimizer).__name__}")
        names = {name for group in optimizer.param_groups for name in group["param_names"]}
        taken = sorted(names & set(tensors))
        if taken:
            raise CheckpointError(f"tensors {taken} are given twice: by name and as parameters of the optimizer")
    return pieces


def _state_items(held_tensors: list[HeldTensor], rank: int) -> list[Item]:
    """Every parameter and state of an optimizer that this rank holds."""
    items = []
    for held in held_tensors:
        items.append(saved_piece(held.name, LocalPiece(held.param, held.param_layout, held.shape), rank))
        for state, tensor in sorted(held.states.items()):
            items.append(state_item(state_key(held.name, state), held.wheres[state], held.shape, tensor, rank))
    return items


def _optimizer_record(optimizer: ShardedOptimizer, held_tensors: list[HeldTensor]) -> dict[str, Any]:
    return {
        "type": type(optimizer).__name__,
        "param_groups": param_groups_json(optimizer.param_groups),
        "tensors": {
            held.name: {"step": held.step, "states": {s: state_key(held.name, s) for s in sorted(held.states)}}
            for held in held_tensors
            if held.states
        },
    }


def _write_part(path: Path, items: list[Item]) -> dict[str, Any]:
    """Write the pieces this rank stores; the part of the metadata they make (every item's
    header, stored or not, so that rank 0 can check the ranks agree)."""
    tensors = {}
    with RankFileWriter(path) as writer:
        for item in items:
            pieces = []
            if item.stores:
                flat = item.data.reshape(-1)
                position = 0
                for box in item.boxes:
                    n = box_elements(box)
                    if n:
                        offset, crc = writer.write(flat[position : position + n])
                        pieces.append({"offset": offset, "box": [list(b) for b in box], "crc32": crc})
                    position += n
            tensors[item.key] = item.header() | {"pieces": pieces}
    return {"file": path.name, "size": writer.size, "tensors": tensors}


def _commit(directory: Path, staging: Path, size: int) -> None:
    indexes = [json.loads((staging / _index_file(r)).read_text()) for r in range(size)]
    metadata = _merge(indexes, DATA + staging.name.removeprefix(STAGING), size)
    for r in range(size):
        (staging / _index_file(r)).unlink()
    fsync_folder(staging)
    data = directory / metadata.data
    os.rename(staging, data)
    try:
        fsync_folder(directory)
        replace_synced(directory / METADATA_FILE, metadata.dumps().encode())
    except BaseException:
        shutil.rmtree(data, ignore_errors=True)  # named by no metadata: the old checkpoint stands
        raise
    for entry in directory.iterdir():  # earlier data, and saves that crashed
        if entry.name != data.name and entry.name.startswith((DATA, STAGING)) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def _merge(indexes: list[dict[str, Any]], data: str, size: int) -> Metadata:
    """The metadata of the ranks' parts; a :class:`CheckpointError` unless the ranks agree on
    every tensor and their pieces cover it."""
    files, headers, pieces, holders = {}, {}, {}, {}
    for rank, index in enumerate(indexes):
        files[index["file"]] = index["size"]
        for key, entry in index["tensors"].items():
            header = {k: v for k, v in entry.items() if k != "pieces"}
            first = headers.setdefault(key, (rank, header))
            if first[1] != header:
                raise CheckpointError(
                    f"tensor '{key}': rank {first[0]} saves it as {first[1]}, rank {rank} as {header}"
                )
            pieces.setdefault(key, []).extend(StoredPiece(file=index["file"], **p) for p in entry["pieces"])
            holders.setdefault(key, set()).add(rank)
    tensors = {}
    for key, (_, header) in headers.items():
        stored = StoredTensor(pieces=pieces[key], **header)
        covered, total = sum(box_elements(p.box) for p in stored.pieces), math.prod(stored.shape)
        if covered != total:
            missing = sorted(set(parse_layout(stored.layout).mesh.ranks) - holders[key])
            raise CheckpointError(
                f"tensor '{key}': the ranks stored {covered} of its {total} elements"
                + (f"; ranks {missing} of its mesh did not save it" if missing else "")
            )
        tensors[key] = stored
    return Metadata(data, size, files, tensors, _merge_optimizers([i["optimizer"] for i in indexes]))


def _merge_optimizers(records: list[dict[str, Any] | None]) -> StoredOptimizer | None:
    if all(r is None for r in records):
        return None
    if any(r is None for r in records):
        without = [rank for rank, r in enumerate(records) if r is None]
        raise CheckpointError(f"ranks {without} passed no optimizer, the others did")
    first = records[0]
    steps: dict[str, int] = {}
    states: dict[str, dict[str, str]] = {}
    for rank, record in enumerate(records):
        if (record["type"], record["param_groups"]) != (first["type"], first["param_groups"]):
            raise CheckpointError(f"rank {rank} saves another optimizer ({record['type']}) or other hyperparameters")
        for name, entry in record["tensors"].items():
            if steps.setdefault(name, entry["step"]) != entry["step"]:
                raise CheckpointError(f"tensor '{name}': the ranks disagree on its step count")
            states[name] = entry["states"]
    return StoredOptimizer(first["type"], first["param_groups"], steps, states)


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def _index_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"
