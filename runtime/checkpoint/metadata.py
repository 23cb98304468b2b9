"""The metadata file: what a checkpoint holds and where every byte of it lies.

``metadata.json`` (JSON, so that people and other tools can read it) names the data folder
and, per stored tensor, its layout as saved (canonical text, the mesh inline), global shape,
dtype and pieces: each piece a box of the global tensor stored row-major at a byte offset of
one rank file, with one CRC-32 per block of ``block_bytes`` bytes of the piece (the last
block may be shorter), so that a rank reading part of a piece checks the blocks it reads.
Reading it checks that it describes its files: every field of its type, every piece inside
its file and its tensor, of the length its box and dtype give, with one checksum per block,
the pieces of a tensor covering it exactly (their sizes add up to the tensor's; a save never
writes overlapping pieces). Any failure is a :class:`CheckpointError` naming the metadata
file and the field or the tensor; the file is a regular file inside the checkpoint, not a
link out of it (``paths``).

Format 3 protects the metadata itself, twice. Its ``checksum`` field is the SHA-256 of every
other field (:func:`metadata_checksum`), so a hand edit that leaves the file well formed (two
boxes swapped, a name or a shape changed) is refused when it is read. And each block's CRC-32
covers the identity of its piece before its bytes (:func:`piece_identity`: the tensor's key,
dtype and shape, the rank file and the box; then ``#`` and the block's index), so an entry
that does not describe the bytes it points at fails its blocks' checks at load and in
``verify`` even where the metadata was rewritten with a fresh checksum. Format 2 (plain
CRC-32s, no metadata checksum) is still read, without either protection.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from runtime.checkpoint import objects
from runtime.checkpoint.errors import CheckpointError
from runtime.checkpoint.fields import Fields, field, too_deep
from runtime.checkpoint.paths import open_inside
from shardlang.box import Box
from shardlang.dtypes import ITEMSIZE
from shardlang.errors import ShardlangError
from shardlang.layout import Layout
from shardlang.parser import parse_layout

FORMAT = "shardlang.checkpoint/3"  # 3: the metadata's checksum, pieces' identities in their blocks' CRCs
UNPROTECTED_FORMAT = "shardlang.checkpoint/2"  # 2: a CRC-32 per block of each piece (1: one per piece); read
METADATA_FILE = "metadata.json"
BLOCK_BYTES = 1 << 20
"""The default checksum block: one CRC-32 per MiB of every stored piece. A rank reading part
of a piece reads (and checks) the whole blocks its byte runs touch."""
_NAME = re.compile(r"[A-Za-z0-9_.-]+\Z")  # data folders and rank files: no path separators
_CRC_BELOW = 1 << 32


def metadata_checksum(raw: Mapping[str, Any]) -> str:
    """The SHA-256 (hex) of every field of the metadata ``raw`` (parsed JSON) but ``checksum``,
    written as compact JSON with sorted keys: the layout of the file's text does not count."""
    body = {k: v for k, v in raw.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def piece_identity(key: str, dtype: str, shape: tuple[int, ...], file: str, box: Box) -> bytes:
    """What a stored piece is, as its blocks' CRC-32s cover it (format 3): compact JSON of
    ``[key, dtype, shape, file, box]``, e.g. ``["w","f32",[37,24],"rank-00000.bin",[[0,19],[0,24]]]``."""
    value = [key, dtype, list(shape), file, [list(b) for b in box]]
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True).encode()


def block_crc32(data: bytes | memoryview, identity: bytes, index: int) -> int:
    """The checksum of block ``index`` of a piece: the CRC-32 of its identity, ``#``, the
    index and the block's bytes (format 3); of the bytes alone for an empty identity (format 2)."""
    start = zlib.crc32(identity + b"#%d" % index) if identity else 0
    return zlib.crc32(data, start)


def block_count(length: int, block_bytes: int) -> int:
    """How many checksum blocks a piece of ``length`` bytes has."""
    return -(-length // block_bytes)


@attrs.frozen
class StoredPiece:
    file: str
    offset: int
    box: Box = attrs.field(converter=Box)
    block_crc32: tuple[int, ...] = attrs.field(converter=tuple)
    identity: bytes = b""  # what its blocks' checksums cover beside the bytes (empty: format 2)

    def to_json(self, itemsize: int) -> dict[str, Any]:
        length = self.box.numel * itemsize
        return {
            "file": self.file,
            "offset": self.offset,
            "length": length,
            "box": [list(b) for b in self.box],
            "block_crc32": list(self.block_crc32),
        }


@attrs.frozen
class StoredTensor:
    """``layout``: the layout the tensor was saved from, over an anonymous mesh; for a flat
    chunk (flat ZeRO) that of the block that was flattened, and ``flat_axis`` the axis."""

    layout: Layout
    flat_axis: str | None
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(n) for n in s))
    dtype: str
    pieces: tuple[StoredPiece, ...] = attrs.field(converter=tuple)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": str(self.layout),
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
    block_bytes: int = BLOCK_BYTES
    # Objects' encoded states (``objects``): {name: {"same": state} or {"ranks": [state, ...]}}.
    objects: Mapping[str, Mapping[str, object]] = attrs.field(factory=dict)

    def to_json(self) -> dict[str, Any]:
        raw = {
            "format": FORMAT,
            "data": self.data,
            "world_size": self.world_size,
            "block_bytes": self.block_bytes,
            "files": dict(self.files),
            "tensors": {k: t.to_json() for k, t in self.tensors.items()},
            "optimizer": None if self.optimizer is None else self.optimizer.to_json(),
        }
        if self.objects:  # absent from checkpoints without objects (and those saved before them)
            raw["objects"] = dict(self.objects)
        return raw | {"checksum": metadata_checksum(raw)}

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
    fd = open_inside(directory, path, "the metadata file", missing="no checkpoint here (the metadata file is missing)")
    try:
        with os.fdopen(fd, "rb") as f:
            text = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the metadata file: {e.strerror}") from None
    try:
        raw = json.loads(text)
    except RecursionError:
        deep = too_deep(text.decode(errors="replace")) or "(the top)"
        raise CheckpointError(f"{path}: field {deep} nests deeper than any checkpoint's metadata (corrupt)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: the metadata file is not valid JSON (corrupt or truncated): {e}") from None
    return parse_metadata(raw, str(path)), len(text)


def parse_metadata(raw: object, source: str) -> Metadata:
    """``raw`` (parsed JSON) as checked :class:`Metadata`; errors name ``source`` and the field."""
    if not isinstance(raw, dict) or raw.get("format") not in (FORMAT, UNPROTECTED_FORMAT):
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        readable = f"{FORMAT!r} and {UNPROTECTED_FORMAT!r}"
        if isinstance(found, str) and found.startswith(FORMAT.split("/")[0] + "/"):
            raise CheckpointError(f"{source}: a checkpoint of format {found!r}; this version reads {readable}")
        raise CheckpointError(f"{source}: not a shardlang checkpoint (format {found!r}, expected {readable})")
    fields = Fields(source)
    protected = raw["format"] == FORMAT
    checksum = fields.string(fields.get(raw, "checksum", ""), "checksum") if protected else None
    data = _name(fields, fields.get(raw, "data", ""), "data", "a data folder")
    world_size = fields.count(fields.get(raw, "world_size", ""), "world_size", least=1)
    block_bytes = fields.count(fields.get(raw, "block_bytes", ""), "block_bytes", least=1)
    files = {}
    for name, size in fields.object(fields.get(raw, "files", ""), "files").items():
        path = field("files", name)
        files[_name(fields, name, path, "a rank file")] = fields.count(size, path)
    tensors = {}
    for key, entry in fields.object(fields.get(raw, "tensors", ""), "tensors").items():
        reader = _TensorReader(fields, field("tensors", key), key, files, block_bytes, protected)
        tensors[key] = reader.tensor(fields.object(entry, reader.path))
    optimizer = fields.get(raw, "optimizer", "")
    stored = None if optimizer is None else _stored_optimizer(fields, fields.object(optimizer, "optimizer"), tensors)
    stored_objects = objects.parse(raw.get("objects", {}), fields, world_size)
    # Last, so that a field of the wrong kind is named as such rather than as a mismatch.
    if checksum is not None and checksum != metadata_checksum(raw):
        raise CheckpointError(
            f"{source}: the metadata does not match its checksum: it was edited or damaged after the save "
            "(a tensor, box, shape or setting changed), and cannot be edited by hand: restore the file as it "
            "was saved, or save the checkpoint again"
        )
    return Metadata(data, world_size, files, tensors, stored, block_bytes, stored_objects)


@attrs.frozen
class _TensorReader:
    """Checks one entry of ``tensors``: its fields (named by ``path``) and what they say."""

    fields: Fields
    path: str
    key: str
    files: Mapping[str, int]
    block_bytes: int
    protected: bool  # format 3: pieces' identities are in their blocks' checksums

    def fail(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.fields.source}: tensor '{self.key}': {message}")

    def tensor(self, entry: dict[str, Any]) -> StoredTensor:
        f, path = self.fields, self.path
        shape_path = field(path, "shape")
        shape = tuple(
            f.count(n, field(shape_path, i)) for i, n in enumerate(f.list(f.get(entry, "shape", path), shape_path))
        )
        dtype = f.string(f.get(entry, "dtype", path), field(path, "dtype"))
        if dtype not in ITEMSIZE:
            raise self.fail(f"unknown dtype {dtype!r}")
        layout_text = f.string(f.get(entry, "layout", path), field(path, "layout"))
        flat_axis = f.get(entry, "flat_axis", path)
        if flat_axis is not None:
            f.string(flat_axis, field(path, "flat_axis"))
        try:
            layout = parse_layout(layout_text)
            layout.check_shape(shape)
            if flat_axis is not None:
                layout.mesh.axis_index(flat_axis)
        except ShardlangError as e:
            raise self.fail(f"its layout {layout_text!r} does not fit: {e.message}") from None
        pieces_path = field(path, "pieces")
        pieces = [
            self.piece(f.object(p, field(pieces_path, i)), field(pieces_path, i), shape, dtype)
            for i, p in enumerate(f.list(f.get(entry, "pieces", path), pieces_path))
        ]
        covered = sum(p.box.numel for p in pieces)
        if covered != math.prod(shape):
            raise self.fail(f"its pieces hold {covered} elements, the shape {list(shape)} has {math.prod(shape)}")
        return StoredTensor(layout, flat_axis, shape, dtype, pieces)

    def piece(self, piece: dict[str, Any], path: str, shape: tuple[int, ...], dtype: str) -> StoredPiece:
        f, itemsize = self.fields, ITEMSIZE[dtype]
        file = f.string(f.get(piece, "file", path), field(path, "file"))
        if file not in self.files:
            raise self.fail(f"a piece lies in {file!r}, which the checkpoint does not list")
        offset = f.count(f.get(piece, "offset", path), field(path, "offset"))
        box_path = field(path, "box")
        box = []
        for d, bounds in enumerate(f.list(f.get(piece, "box", path), box_path)):
            bounds = f.list(bounds, field(box_path, d))
            if len(bounds) != 2:
                raise f.fail(field(box_path, d), f"must be [start, stop], not {len(bounds)} numbers")
            box.append(tuple(f.count(b, field(field(box_path, d), i)) for i, b in enumerate(bounds)))
        if len(box) != len(shape) or any(not lo <= hi <= n for (lo, hi), n in zip(box, shape, strict=True)):
            raise self.fail(f"the piece {list(map(list, box))} is not inside the shape {list(shape)}")
        length = Box(box).numel * itemsize
        recorded = f.count(f.get(piece, "length", path), field(path, "length"))
        if recorded != length:
            raise self.fail(f"the piece {list(map(list, box))} records {recorded} bytes, its box holds {length}")
        if offset + length > self.files[file]:
            raise self.fail(f"the piece {list(map(list, box))} ends past the end of {file}")
        crc_path = field(path, "block_crc32")
        crcs = f.list(f.get(piece, "block_crc32", path), crc_path)
        blocks = block_count(length, self.block_bytes)
        if len(crcs) != blocks:
            raise self.fail(
                f"the piece {list(map(list, box))} has {len(crcs)} block checksums, its {length} bytes make "
                f"{blocks} blocks of {self.block_bytes}"
            )
        crcs = [f.count(c, field(crc_path, i), below=_CRC_BELOW) for i, c in enumerate(crcs)]
        identity = piece_identity(self.key, dtype, shape, file, Box(box)) if self.protected else b""
        return StoredPiece(file=file, offset=offset, box=box, block_crc32=crcs, identity=identity)


def _stored_optimizer(fields: Fields, raw: dict[str, Any], tensors: Mapping[str, StoredTensor]) -> StoredOptimizer:
    steps, states = {}, {}
    kind = fields.string(fields.get(raw, "type", "optimizer"), "optimizer.type")
    for name, entry in fields.object(fields.get(raw, "tensors", "optimizer"), "optimizer.tensors").items():
        path = field("optimizer.tensors", name)
        entry = fields.object(entry, path)
        steps[name] = fields.count(fields.get(entry, "step", path), field(path, "step"))
        states_path = field(path, "states")
        states[name] = {}
        for state, key in fields.object(fields.get(entry, "states", path), states_path).items():
            key = fields.string(key, field(states_path, state))
            if key not in tensors:
                raise CheckpointError(f"{fields.source}: tensor '{name}': its state '{state}' ({key!r}) is not stored")
            states[name][state] = key
    groups = fields.list(fields.get(raw, "param_groups", "optimizer"), "optimizer.param_groups")
    for i, group in enumerate(groups):
        fields.object(group, field("optimizer.param_groups", i))
    return StoredOptimizer(kind, groups, steps, states)


def _name(fields: Fields, value: object, path: str, what: str) -> str:
    name = fields.string(value, path)
    if not _NAME.match(name) or name in (".", ".."):
        raise fields.fail(path, f"is {name!r}, which is not {what} name (letters, digits, '_', '.', '-')")
    return name
