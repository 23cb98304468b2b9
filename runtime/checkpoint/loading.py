"""Loading: every rank reads the metadata, works out the boxes of its target pieces (its
tensors' layouts, its optimizer's own state layouts), and reads from the rank files the
byte runs of the stored pieces that intersect them, in whole checksum blocks, each block
checked (``reader``). Nothing the caller holds changes until every rank has read and checked
its part; then parameters, tensors and optimizer states are replaced together (on every
rank, or on none)."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
import torch

from runtime.checkpoint import agree
from runtime.checkpoint.errors import CheckpointError
from runtime.checkpoint.fields import field
from runtime.checkpoint.files import raw_bytes
from runtime.checkpoint.items import (
    Item,
    LocalPiece,
    check_piece,
    param_groups_from_json,
    state_item,
    wanted_piece,
)
from runtime.checkpoint.metadata import METADATA_FILE, Metadata, StoredTensor, read_metadata
from runtime.checkpoint.objects import Stateful, to_load
from runtime.checkpoint.reader import RangeReader
from runtime.comm.collectives import timeout_of
from runtime.memory.dtypes import torch_dtype
from runtime.memory.packing import region
from runtime.optim.base import STATE_DICT_FORMAT, ShardedOptimizer


@attrs.frozen
class LoadReport:
    """What the calling rank read: bytes per rank file, read calls, and the metadata's bytes."""

    bytes_read: Mapping[str, int]
    reads: int
    metadata_bytes: int

    @property
    def data_bytes(self) -> int:
        return sum(self.bytes_read.values())


def load(
    path: str | os.PathLike[str],
    tensors: Mapping[str, LocalPiece] | None = None,
    optimizer: ShardedOptimizer | None = None,
    *,
    objects: Mapping[str, Stateful] | None = None,
    timeout: float | datetime.timedelta | None = None,
) -> LoadReport:
    """Fill ``tensors`` (this rank's pieces, in any layouts) and ``optimizer`` (parameters and
    states, in its own layouts) from the checkpoint at ``path``, and give ``objects`` (an lr
    scheduler, a data loader) the states saved for them (``load_state_dict``, last). Every
    rank of the job calls it; ranks outside a tensor's mesh pass ``None`` for it or leave it out. Returns what this
    rank read. A :class:`CheckpointError` on every rank, with nothing changed, if any rank
    cannot read its part; a ``DistributedError`` if a rank does not arrive within
    ``timeout`` (seconds or a timedelta; default the runtime's)."""
    directory = Path(path)
    rank, size = agree.rank_and_size()
    changes: list[Callable[[], object]] = []
    report: list[LoadReport] = []

    def read() -> None:
        metadata, metadata_bytes = read_metadata(directory)
        source = str(directory / METADATA_FILE)
        items = []
        for key, piece in sorted((tensors or {}).items()):
            if check_piece(key, piece, rank):
                item = wanted_piece(key, piece, rank)
                items.append(_checked(item, metadata, source))
                changes.append(lambda piece=piece, item=item: piece.tensor.copy_(item.data))
        if optimizer is not None:
            items += _optimizer_targets(metadata, source, optimizer, changes)
        for obj, state in to_load(metadata.objects, objects or {}, rank, size, source):
            changes.append(lambda obj=obj, state=state: obj.load_state_dict(state))
        reader = RangeReader(directory, metadata.data, metadata.files, metadata.block_bytes)
        try:
            for item in items:
                reader.check_files(sorted({p.file for p in metadata.tensors[item.key].pieces}), f"tensor '{item.key}'")
            for item in items:
                _read(reader, metadata.tensors[item.key], item, source)
        finally:
            reader.close()
        report.append(LoadReport(dict(reader.bytes_read), reader.reads, metadata_bytes))

    what = f"loading the checkpoint {directory}"
    agree.all_or_none(read, timeout=timeout_of(timeout, CheckpointError), what=what, outcome="nothing was changed")
    with torch.no_grad():  # parameters are leaves that require gradients
        for change in changes:
            change()
    return report[0]


def _checked(item: Item, metadata: Metadata, source: str) -> Item:
    """``item``, if the checkpoint holds its tensor with its shape and dtype."""
    stored = metadata.tensors.get(item.key)
    if stored is None:
        known = ", ".join(sorted(metadata.tensors)[:8]) + (", ..." if len(metadata.tensors) > 8 else "")
        raise CheckpointError(f"{source}: tensor '{item.key}' is not in the checkpoint (it holds {known})")
    if stored.shape != item.shape:
        raise CheckpointError(
            f"{source}: tensor '{item.key}' is stored with shape {list(stored.shape)} (layout '{stored.layout}'), "
            f"but is loaded with shape {list(item.shape)} (layout '{item.layout}')"
        )
    if stored.dtype != item.dtype:
        raise CheckpointError(
            f"{source}: tensor '{item.key}' is stored as {stored.dtype}, but is loaded as {item.dtype}"
        )
    return item


def _optimizer_targets(
    metadata: Metadata, source: str, optimizer: ShardedOptimizer, changes: list[Callable[[], object]]
) -> list[Item]:
    """The parameters and states ``optimizer`` keeps on this rank, in its own layouts; adds
    to ``changes`` loading them into it."""
    stored, kind = metadata.optimizer, type(optimizer).__name__
    if stored is None:
        raise CheckpointError(f"{source}: the checkpoint holds no optimizer states")
    if stored.kind != kind:
        raise CheckpointError(f"{source}: the checkpoint holds the states of a {stored.kind}, not of a {kind}")
    if [g.get("param_names") for g in stored.param_groups] != [g["param_names"] for g in optimizer.param_groups]:
        raise CheckpointError(f"{source}: the checkpoint's parameters or param groups differ from the optimizer's")
    _check_hyperparameters(stored.param_groups, optimizer.param_groups, source)
    rank = agree.rank_and_size()[0]
    items, params, tensors = [], [], {}
    for held in optimizer.held_tensors():
        param = wanted_piece(held.name, LocalPiece(held.param, held.param_layout, held.shape), rank)
        items.append(_checked(param, metadata, source))
        params.append((held.param, param.data))
        keys = stored.states.get(held.name)
        if keys is None:  # saved before its first step: it had no states yet
            if held.states:
                raise CheckpointError(
                    f"{source}: tensor '{held.name}' has no optimizer states in the checkpoint (saved before its "
                    "first step), but the optimizer has stepped it; load into a new optimizer"
                )
            continue
        if set(keys) != set(held.wheres):
            raise CheckpointError(
                f"{source}: tensor '{held.name}': the checkpoint holds the states {sorted(keys)}, "
                f"the optimizer keeps {sorted(held.wheres)}"
            )
        records = {}
        for state, where in held.wheres.items():
            data = torch.empty(where.local_shape, dtype=held.state_dtype)
            items.append(_checked(state_item(keys[state], where, held.shape, data, rank), metadata, source))
            records[state] = where.record() | {"tensor": data}
        tensors[held.name] = {"step": stored.steps[held.name], "states": records}
    state_dict = {
        "format": STATE_DICT_FORMAT,
        "optimizer": kind,
        "param_groups": param_groups_from_json(list(stored.param_groups), optimizer.param_groups),
        "tensors": tensors,
    }

    def change() -> None:
        optimizer.load_state_dict(state_dict)
        for target, data in params:
            target.copy_(data)

    changes.append(change)
    return items


def _check_hyperparameters(saved: tuple[dict, ...], current: list[dict], source: str) -> None:
    """Every hyperparameter that a saved param group and the optimizer's both have is of the
    same kind (a number, a string, a flag, a list of as many), and none is called ``params``."""
    for i, (group, now) in enumerate(zip(saved, current, strict=True)):
        path = field("optimizer.param_groups", i)
        if "params" in group:
            raise CheckpointError(f"{source}: field {field(path, 'params')} is not a hyperparameter")
        for name in sorted(set(group) & set(now)):
            problem = _unlike(group[name], now[name])
            if problem:
                raise CheckpointError(f"{source}: field {field(path, name)} must be {problem}, as the optimizer has it")


def _unlike(saved: object, now: object) -> str | None:
    """What the JSON value ``saved`` must be to stand for the hyperparameter value ``now``, or
    None when it can."""
    if now is None:
        return None
    if isinstance(now, bool):
        return None if isinstance(saved, bool) else "true or false"
    if isinstance(now, int | float):
        return None if isinstance(saved, int | float) and not isinstance(saved, bool) else "a number"
    if isinstance(now, str):
        return None if isinstance(saved, str) else "a string"
    if isinstance(now, list | tuple):
        inner = [_unlike(a, b) for a, b in zip(saved, now, strict=False)] if isinstance(saved, list) else []
        if not isinstance(saved, list) or len(saved) != len(now) or any(inner):
            kinds = ", ".join(_unlike(None, b) or "any value" for b in now) if now else "nothing"
            return f"a list of {len(now)} ({kinds})"
    return None


def _read(reader: RangeReader, stored: StoredTensor, item: Item, source: str) -> None:
    """Fill ``item.data``: for every box, the byte runs of every stored piece it meets."""
    label = f"tensor '{item.key}'"
    flat = item.data.reshape(-1)
    position = 0
    for box in item.boxes:
        n = box.numel
        target = flat[position : position + n].view(box.shape)
        covered = 0
        for piece in stored.pieces:
            common = box.intersect(piece.box)
            if common is None:
                continue
            into = target if common == box else torch.empty(common.shape, dtype=item.data.dtype)
            runs = ((offset * stored.itemsize, n * stored.itemsize) for offset, n in piece.box.runs(common))
            reader.read(piece, runs, piece.box.numel * stored.itemsize, raw_bytes(into), label)
            if into is not target:
                region(target, common.relative_to(box)).copy_(into)
            covered += common.numel
        if covered != n:
            raise CheckpointError(
                f"{source}: {label}: the stored pieces hold {covered} of the {n} elements of "
                f"{[list(b) for b in box]} (overlapping or missing pieces)"
            )
        position += n


def verify(path: str | os.PathLike[str]) -> int:
    """Read every stored piece of the checkpoint at ``path`` and check every block's checksum
    (loading checks the blocks it reads); the bytes checked. One process suffices."""
    directory = Path(path)
    metadata, _ = read_metadata(directory)
    reader = RangeReader(directory, metadata.data, metadata.files, metadata.block_bytes)
    try:
        for key, stored in sorted(metadata.tensors.items()):  # sizes first: the pieces lie inside them
            reader.check_files(sorted({p.file for p in stored.pieces}), f"tensor '{key}'")
        for key, stored in sorted(metadata.tensors.items()):
            whole = Item(key, stored.layout, stored.flat_axis, stored.shape, stored.dtype, (), torch.empty(0))
            for piece in stored.pieces:
                data = torch.empty(piece.box.shape, dtype=torch_dtype(stored.dtype))
                _read(reader, stored, attrs.evolve(whole, boxes=(piece.box,), data=data), str(directory))
    finally:
        reader.close()
    return sum(reader.bytes_read.values())
