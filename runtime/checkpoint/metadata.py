"""The metadata file: what a checkpoint holds and where every byte of it lies.

``metadata.json`` (JSON, so that people and other tools can read it) names the data folder
and, per stored tensor, its layout as saved (canonical text, the mesh inline), global shape,
dtype and pieces: each piece a box of the global tensor stored row-major at a byte offset of
one rank file, with its CRC-32. Reading it checks that it describes its files: every piece
inside its file and its tensor, of the length its box and dtype give, the pieces of a tensor
covering it exactly (their sizes add up to the tensor's; a save never writes overlapping
pieces). Any failure is a :class:`CheckpointError` naming the metadata file and the tensor.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from planner.holdings import box_elements
from planner.plan import Box
from runtime.checkpoint.errors import CheckpointError
from shardlang.dtypes import ITEMSIZE
from shardlang.errors import ShardlangError
from shardlang.parser import parse_layout

FORMAT = "shardlang.checkpoint/1"
METADATA_FILE = "metadata.json"
_NAME = re.compile(r"[A-Za-z0-9_.-]+\Z")  # data folders and rank files: no path separators


@attrs.frozen
class StoredPiece:
    file: str
    offset: int
    box: Box = attrs.field(converter=lambda b: tuple((int(lo), int(hi)) for lo, hi in b))
    crc32: int

    def to_json(self, itemsize: int) -> dict[str, Any]:
        length = box_elements(self.box) * itemsize
        return {
            "file": self.file,
            "offset": self.offset,
            "length": length,
            "box": [list(b) for b in self.box],
            "crc32": self.crc32,
        }


@attrs.frozen
class StoredTensor:
    """``layout``: the canonical text of the layout the tensor was saved from; for a flat
    chunk (flat ZeRO) that of the block that was flattened, and ``flat_axis`` the axis."""

    layout: str
    flat_axis: str | None
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(n) for n in s))
    dtype: str
    pieces: tuple[StoredPiece, ...] = attrs.field(converter=tuple)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "flat_axis": self.flat_axis,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "pieces": [p.to_json(self.itemsize) for p in self.pieces],
        }


@attrs.frozen
class StoredOptimizer:
    """A sharded optimizer's type, hyperparameters (its param groups, JSON) and, per tensor
    with states, its step count and the keys of its states in ``Metadata.tensors``."""

    kind: str
    param_groups: tuple[dict[str, Any], ...] = attrs.field(converter=tuple)
    steps: Mapping[str, int]
    states: Mapping[str, Mapping[str, str]]

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.kind,
            "param_groups": list(self.param_groups),
            "tensors": {n: {"step": self.steps[n], "states": dict(self.states[n])} for n in self.steps},
        }


@attrs.frozen
class Metadata:
    data: str  # the data folder, beside the metadata file
    world_size: int
    files: Mapping[str, int]  # rank file -> its size in bytes
    tensors: Mapping[str, StoredTensor]
    optimizer: StoredOptimizer | None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "data": self.data,
            "world_size": self.world_size,
            "files": dict(self.files),
            "tensors": {k: t.to_json() for k, t in self.tensors.items()},
            "optimizer": None if self.optimizer is None else self.optimizer.to_json(),
        }

    def dumps(self) -> str:
        """The JSON text: one line per tensor, so that people can read it."""
        raw = self.to_json()
        tensors = raw.pop("tensors")
        lines = [f"  {json.dumps(key)}: {json.dumps(entry)}" for key, entry in tensors.items()]
        head = json.dumps(raw, indent=1)[:-2]  # without the closing brace
        return head + ',\n "tensors": {\n' + ",\n".join(lines) + "\n }\n}\n"


def read_metadata(directory: Path) -> tuple[Metadata, int]:
    """The checkpoint's metadata, checked, and the bytes read."""
    path = directory / METADATA_FILE
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no checkpoint here (the metadata file is missing)") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the metadata file: {e.strerror}") from None
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: the metadata file is not valid JSON (corrupt or truncated): {e}") from None
    return parse_metadata(raw, str(path)), len(text)


def parse_metadata(raw: object, source: str) -> Metadata:
    """``raw`` (parsed JSON) as checked :class:`Metadata`; errors name ``source``."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(f"{source}: not a shardlang checkpoint (format {found!r}, expected {FORMAT!r})")
    key = None
    try:
        data = _name(raw["data"], "data folder")
        files = {_name(f, "rank file"): _count(size) for f, size in raw["files"].items()}
        tensors = {}
        for key, entry in raw["tensors"].items():
            tensors[key] = _stored_tensor(entry, files, source, key)
        key = None
        optimizer = None if raw["optimizer"] is None else _stored_optimizer(raw["optimizer"], tensors, source)
        return Metadata(data, _count(raw["world_size"]), files, tensors, optimizer)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        where = f"tensor '{key}'" if key is not None else "the metadata"
        raise CheckpointError(f"{source}: {where} is malformed ({type(e).__name__}: {e})") from None


def _stored_tensor(entry: dict[str, Any], files: Mapping[str, int], source: str, key: str) -> StoredTensor:
    def fail(message: str) -> CheckpointError:
        return CheckpointError(f"{source}: tensor '{key}': {message}")

    shape = tuple(_count(n) for n in entry["shape"])
    dtype = entry["dtype"]
    if dtype not in ITEMSIZE:
        raise fail(f"unknown dtype {dtype!r}")
    try:
        layout = parse_layout(entry["layout"])
        layout.check_shape(shape)
        flat_axis = entry["flat_axis"]
        if flat_axis is not None:
            layout.mesh.axis_index(flat_axis)
    except ShardlangError as e:
        raise fail(f"its layout {entry['layout']!r} does not fit: {e.message}") from None
    itemsize = ITEMSIZE[dtype]
    pieces = []
    for piece in entry["pieces"]:
        stored = StoredPiece(
            file=piece["file"], offset=_count(piece["offset"]), box=piece["box"], crc32=_count(piece["crc32"])
        )
        if stored.file not in files:
            raise fail(f"a piece lies in {stored.file!r}, which the checkpoint does not list")
        if len(stored.box) != len(shape) or any(
            not 0 <= lo <= hi <= n for (lo, hi), n in zip(stored.box, shape, strict=True)
        ):
            raise fail(f"the piece {list(map(list, stored.box))} is not inside the shape {list(shape)}")
        length = box_elements(stored.box) * itemsize
        if _count(piece["length"]) != length:
            raise fail(
                f"the piece {list(map(list, stored.box))} records {piece['length']} bytes, its box holds {length}"
            )
        if stored.offset + length > files[stored.file]:
            raise fail(f"the piece {list(map(list, stored.box))} ends past the end of {stored.file}")
        pieces.append(stored)
    covered = sum(box_elements(p.box) for p in pieces)
    if covered != math.prod(shape):
        raise fail(f"its pieces hold {covered} elements, the shape {list(shape)} has {math.prod(shape)}")
    return StoredTensor(entry["layout"], entry["flat_axis"], shape, dtype, pieces)


def _stored_optimizer(raw: dict[str, Any], tensors: Mapping[str, StoredTensor], source: str) -> StoredOptimizer:
    steps, states = {}, {}
    for name, entry in raw["tensors"].items():
        steps[name] = _count(entry["step"])
        states[name] = dict(entry["states"])
        for state, key in states[name].items():
            if key not in tensors:
                raise CheckpointError(f"{source}: tensor '{name}': its state '{state}' ({key!r}) is not stored")
    groups = raw["param_groups"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise TypeError("param_groups must be a list of objects")
    return StoredOptimizer(str(raw["type"]), groups, steps, states)


def _count(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} is not a count")
    return value


def _name(value: object, what: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value) or value in (".", ".."):
        raise ValueError(f"{value!r} is not a {what} name")
    return value
