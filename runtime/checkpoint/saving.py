"""Saving: every rank writes its pieces to its own file in a staging folder; rank 0 then
checks that the pieces cover every tensor and commits (``commit``): it renames the folder and
replaces the metadata file.

    path/metadata.json          -> names data-<id>
    path/data-<id>/rank-00000.bin ...
    path/.staging-<id>/         a save in progress (or one that crashed or was given up)

Until the new metadata file replaces the old one (``os.replace``, after every rank file and
the folder were fsynced), the old metadata names the old, untouched data folder; after it,
the old folder is removed. A save that fails anywhere, on any rank (an error, a rank that
dies or does not arrive), raises a :class:`CheckpointError` on every rank that is left, and
its message says whether the new checkpoint was committed; one reported as not committed
never is, and then the previous checkpoint is as it was.
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

from runtime.checkpoint import agree
from runtime.checkpoint.commit import COMMITTED, NOT_COMMITTED, data_folder, publish, settle, staging_folder
from runtime.checkpoint.errors import CheckpointError
from runtime.checkpoint.files import RankFileWriter
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
from runtime.checkpoint.metadata import (
    BLOCK_BYTES,
    Metadata,
    StoredOptimizer,
    StoredPiece,
    StoredTensor,
    piece_identity,
)
from runtime.checkpoint.objects import Stateful, merged, states_of
from runtime.comm.collectives import timeout_of
from runtime.optim.base import HeldTensor, ShardedOptimizer
from shardlang.parser import parse_layout

NOTHING_WRITTEN = "nothing was written; " + NOT_COMMITTED


def save(
    path: str | os.PathLike[str],
    tensors: Mapping[str, LocalPiece] | None = None,
    optimizer: ShardedOptimizer | None = None,
    *,
    objects: Mapping[str, Stateful] | None = None,
    timeout: float | datetime.timedelta | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> None:
    """Save ``tensors`` (this rank's pieces, by name), ``optimizer`` (its parameters and
    states) and ``objects`` (an lr scheduler, a data loader: their ``state_dict()``, stored
    as ``runtime.checkpoint.objects`` says) to the checkpoint at ``path``, replacing the one
    there only once every rank has written its part. Every rank of the job calls it, with the
    same ``block_bytes`` (bytes per checksum block); ranks outside a tensor's mesh pass ``None`` for it or leave it out.
    A :class:`CheckpointError` on every rank left if any rank fails or does not arrive
    within ``timeout`` (seconds or a timedelta; default the runtime's); its message says
    whether the new checkpoint was committed."""
    directory = Path(path)
    timeout = timeout_of(timeout, CheckpointError)
    if not isinstance(block_bytes, int) or isinstance(block_bytes, bool) or block_bytes < 1:
        raise CheckpointError(f"block_bytes must be a positive integer, got {block_bytes!r}")
    what = f"saving the checkpoint {directory}"
    rank, size = agree.rank_and_size()
    token = secrets.token_hex(8) if rank == 0 else ""
    pieces: dict[str, LocalPiece] = {}
    encoded: dict[str, object] = {}

    def prepare() -> None:
        pieces.update(_held_pieces(tensors or {}, optimizer, rank))
        encoded.update(states_of(objects))
        if rank == 0:  # before any rank may write or give up (commit)
            staging_folder(directory, token).mkdir(parents=True)

    remove = (lambda: shutil.rmtree(staging_folder(directory, token), ignore_errors=True)) if rank == 0 else None
    messages = agree.all_or_none(
        prepare, payload=token, timeout=timeout, what=what, outcome=NOTHING_WRITTEN, cleanup=remove
    )
    token = messages[0]
    staging = staging_folder(directory, token)

    def write() -> None:
        items = [saved_piece(key, resolved(key, piece, rank, timeout), rank) for key, piece in sorted(pieces.items())]
        record = None
        if optimizer is not None:
            held = optimizer.held_tensors()
            items += _state_items(held, rank)
            record = _optimizer_record(optimizer, held)
        if not staging.is_dir():
            raise CheckpointError(f"{staging}: rank 0's staging folder is not here (all ranks must see one directory)")
        index = _write_part(staging / _rank_file(rank), items, block_bytes) | {"optimizer": record, "objects": encoded}
        (staging / _index_file(rank)).write_text(json.dumps(index))

    def given_up() -> str:  # this rank lost touch with the others
        return NOT_COMMITTED if rank == 0 else settle(directory, token, rank)

    agree.all_or_none(write, timeout=timeout, what=what, outcome=NOT_COMMITTED, cleanup=remove, lost=given_up)
    committed = [False]

    def commit() -> None:
        if rank != 0:
            return
        try:
            metadata = _commit_metadata(staging, data_folder(directory, token).name, size, block_bytes)
        except Exception as e:
            shutil.rmtree(staging, ignore_errors=True)
            reason = e.message if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            raise CheckpointError(f"{reason}; {NOT_COMMITTED}") from e
        publish(directory, token, metadata.dumps().encode())
        committed[0] = True

    def outcome_after_commit() -> str:
        if rank == 0:
            return COMMITTED if committed[0] else NOT_COMMITTED
        return settle(directory, token, rank)

    agree.all_or_none(commit, timeout=timeout, what=what, outcome="", lost=outcome_after_commit)


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


def _write_part(path: Path, items: list[Item], block_bytes: int) -> dict[str, Any]:
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
                    n = box.numel
                    if n:
                        identity = piece_identity(item.key, item.dtype, item.shape, path.name, box)
                        offset, crcs = writer.write(flat[position : position + n], block_bytes, identity)
                        pieces.append({"offset": offset, "box": [list(b) for b in box], "block_crc32": crcs})
                    position += n
            tensors[item.key] = item.header() | {"pieces": pieces}
    return {"file": path.name, "size": writer.size, "block_bytes": block_bytes, "tensors": tensors}


def _commit_metadata(staging: Path, data: str, size: int, block_bytes: int) -> Metadata:
    """The metadata of the ranks' parts (their index files, which it removes)."""
    indexes = [json.loads((staging / _index_file(r)).read_text()) for r in range(size)]
    differ = sorted(r for r, index in enumerate(indexes) if index["block_bytes"] != block_bytes)
    if differ:
        raise CheckpointError(f"ranks {differ} save with another block_bytes than rank 0 ({block_bytes})")
    metadata = _merge(indexes, data, size, block_bytes)
    for r in range(size):
        (staging / _index_file(r)).unlink()
    return metadata


def _merge(indexes: list[dict[str, Any]], data: str, size: int, block_bytes: int) -> Metadata:
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
        stored = StoredTensor(pieces=pieces[key], **{**header, "layout": parse_layout(header["layout"])})
        covered, total = sum(p.box.numel for p in stored.pieces), math.prod(stored.shape)
        if covered != total:
            missing = sorted(set(stored.layout.mesh.ranks) - holders[key])
            raise CheckpointError(
                f"tensor '{key}': the ranks stored {covered} of its {total} elements"
                + (f"; ranks {missing} of its mesh did not save it" if missing else "")
            )
        tensors[key] = stored
    optimizer = _merge_optimizers([i["optimizer"] for i in indexes])
    return Metadata(data, size, files, tensors, optimizer, block_bytes, merged([i["objects"] for i in indexes]))


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
