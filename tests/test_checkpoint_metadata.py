"""Checkpoint metadata that was edited or whose entries were swapped is refused (format 3): by
the metadata's checksum when it is edited by hand, and by the blocks' checksums, which cover
what each piece is (tensor, dtype, shape, rank file, box), when the metadata was rewritten
with a fresh checksum. At load (the target untouched) and in ``verify``. A checkpoint of
format 2 still loads.

The checkpoints here are written by hand from the format's description (not by ``save``), so
that they also check that the description is what the reader reads."""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime import checkpoint
from runtime.checkpoint import CheckpointError, LocalPiece
from shardlang import parse_layout
from tests.golden_blocks import golden_blocks

ROWS, COLS = 4, 3
WEIGHT = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 1
BLOCK = 8  # bytes: a piece of two rows (24 bytes) has three blocks


def _checksum(raw: dict[str, Any]) -> str:
    body = {k: v for k, v in raw.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _crcs(data: bytes, identity: list[Any] | None) -> list[int]:
    """Format 3: the CRC-32 of the piece's identity (compact JSON), '#', the block's index and
    the block; format 2 (``identity`` None): of the block alone."""
    out = []
    for i in range(0, len(data), BLOCK):
        head = b"" if identity is None else json.dumps(identity, separators=(",", ":")).encode() + b"#%d" % (i // BLOCK)
        out.append(zlib.crc32(head + data[i : i + BLOCK]))
    return out


def _write(directory: Path, *, same_file: bool = False, protected: bool = True) -> dict[str, Any]:
    """'w' (f32[4, 3], S0 over two ranks): rows 0-1 and rows 2-3, pieces of 24 bytes each, in
    two rank files (or one after the other in one)."""
    data = directory / "data-x"
    data.mkdir(parents=True)
    rows = [WEIGHT[:2].numpy().tobytes(), WEIGHT[2:].numpy().tobytes()]
    files = ["rank-00000.bin", "rank-00000.bin" if same_file else "rank-00001.bin"]
    pieces, sizes = [], {}
    for (lo, hi), raw, file in zip(((0, 2), (2, 4)), rows, files, strict=True):
        box = [[lo, hi], [0, COLS]]
        offset = sizes.get(file, 0)
        with open(data / file, "ab") as f:
            f.write(raw)
        sizes[file] = offset + len(raw)
        identity = ["w", "f32", [ROWS, COLS], file, box] if protected else None
        pieces.append(
            {"file": file, "offset": offset, "length": len(raw), "box": box, "block_crc32": _crcs(raw, identity)}
        )
    raw_metadata: dict[str, Any] = {
        "format": "shardlang.checkpoint/3" if protected else "shardlang.checkpoint/2",
        "data": "data-x",
        "world_size": 2,
        "block_bytes": BLOCK,
        "files": sizes,
        "tensors": {
            "w": {
                "layout": "S0,R over mesh[2]",
                "flat_axis": None,
                "shape": [ROWS, COLS],
                "dtype": "f32",
                "pieces": pieces,
            }
        },
        "optimizer": None,
    }
    _store(directory, raw_metadata, sign=protected)
    return raw_metadata


def _store(directory: Path, raw: dict[str, Any], *, sign: bool) -> None:
    """Write the metadata; ``sign``: with the checksum of what it now says (as a tool that
    rewrites it would), else as it was (a hand edit)."""
    if sign:
        raw = raw | {"checksum": _checksum(raw)}
    (directory / "metadata.json").write_text(json.dumps(raw, indent=1))


def _target(shape: tuple[int, ...] = (ROWS, COLS), dtype: torch.dtype = torch.float32) -> dict[str, LocalPiece]:
    layout = parse_layout(f"{','.join('R' * len(shape))} over mesh[1]")
    return {"w": LocalPiece(torch.full(shape, -1.0).to(dtype), layout, shape)}


def _refused(directory: Path, target: dict[str, LocalPiece], *words: str) -> None:
    """``load`` and ``verify`` raise a CheckpointError holding every word; the target is untouched."""
    before = {k: p.tensor.clone() for k, p in target.items()}
    for call in (lambda: checkpoint.load(directory, target), lambda: checkpoint.verify(directory)):
        with pytest.raises(CheckpointError) as caught:
            call()
        for word in words:
            assert word in str(caught.value), str(caught.value)
    for key, piece in target.items():
        assert torch.equal(piece.tensor, before[key])


def _loads(directory: Path) -> torch.Tensor:
    target = _target()
    checkpoint.load(directory, target)
    checkpoint.verify(directory)
    return target["w"].tensor


def test_a_checkpoint_written_by_the_description_loads(tmp_path: Path) -> None:
    for same_file, folder in ((False, "two"), (True, "one")):
        _write(tmp_path / folder, same_file=same_file)
        assert torch.equal(_loads(tmp_path / folder), WEIGHT)


def _swap_boxes(raw: dict[str, Any]) -> None:
    a, b = raw["tensors"]["w"]["pieces"]
    a["box"], b["box"] = b["box"], a["box"]


def _swap_offsets(raw: dict[str, Any]) -> None:
    a, b = raw["tensors"]["w"]["pieces"]
    a["offset"], b["offset"] = b["offset"], a["offset"]


def _rename(raw: dict[str, Any]) -> None:
    raw["tensors"]["v"] = raw["tensors"].pop("w")


def _transpose(raw: dict[str, Any]) -> None:
    """Shape [4, 3] -> [3, 4] with boxes to match: as many elements, every field consistent."""
    entry = raw["tensors"]["w"]
    entry["shape"] = [COLS, ROWS]
    entry["layout"] = "R,S0 over mesh[2]"
    for piece, box in zip(entry["pieces"], ([[0, COLS], [0, 2]], [[0, COLS], [2, 4]]), strict=True):
        piece["box"] = box


def _retype(raw: dict[str, Any]) -> None:
    raw["tensors"]["w"]["dtype"] = "i32"  # as many bytes: the values would be read as integers


EDITS: dict[str, tuple[Callable[[dict[str, Any]], None], Callable[[], dict[str, LocalPiece]], bool]] = {
    # name: the edit, the target that loads what the edited metadata says, pieces in one file
    "two boxes swapped": (_swap_boxes, _target, False),
    "two boxes swapped in one file": (_swap_boxes, _target, True),
    "two offsets swapped in one file": (_swap_offsets, _target, True),
    "a name changed": (_rename, lambda: {"v": _target()["w"]}, False),
    "a shape changed": (_transpose, lambda: _target((COLS, ROWS)), False),
    "a dtype changed": (_retype, lambda: _target(dtype=torch.int32), False),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_a_hand_edit_of_the_metadata_fails_its_checksum(tmp_path: Path, name: str) -> None:
    edit, target, same_file = EDITS[name]
    raw = _write(tmp_path, same_file=same_file)
    saved = _checksum(raw)
    edit(raw)
    _store(tmp_path, raw | {"checksum": saved}, sign=False)
    _refused(tmp_path, target(), "metadata.json: the metadata does not match its checksum", "edited")


@pytest.mark.parametrize("name", sorted(EDITS))
def test_an_edit_with_a_fresh_checksum_fails_the_blocks_checksums(tmp_path: Path, name: str) -> None:
    edit, target, same_file = EDITS[name]
    raw = _write(tmp_path, same_file=same_file)
    edit(raw)
    _store(tmp_path, raw, sign=True)
    _refused(tmp_path, target(), "rank-0000", "block 0 of the piece", "edited or swapped")


def test_an_edited_checksum_or_none_is_refused(tmp_path: Path) -> None:
    raw = _write(tmp_path)
    _store(tmp_path, raw | {"checksum": "0" * 64}, sign=False)
    _refused(tmp_path, _target(), "does not match its checksum")
    _store(tmp_path, raw, sign=False)
    _refused(tmp_path, _target(), "field checksum is missing")


def test_the_metadata_may_be_reformatted(tmp_path: Path) -> None:
    raw = _write(tmp_path)
    text = (tmp_path / "metadata.json").read_text()
    (tmp_path / "metadata.json").write_text(json.dumps(json.loads(text), indent=4, sort_keys=True))
    assert torch.equal(_loads(tmp_path), WEIGHT)
    assert raw["format"] == "shardlang.checkpoint/3"


def test_a_checkpoint_of_format_2_still_loads(tmp_path: Path) -> None:
    _write(tmp_path, protected=False)
    assert "checksum" not in json.loads((tmp_path / "metadata.json").read_text())
    assert torch.equal(_loads(tmp_path), WEIGHT)


def test_save_writes_what_the_description_says(tmp_path: Path) -> None:
    """A real save of 'w' whole (one rank): its metadata's checksum and its blocks' checksums
    are those of the description, so every edit above is caught in checkpoints save writes."""
    checkpoint.save(tmp_path, {"w": LocalPiece(WEIGHT.clone(), parse_layout("R,R over mesh[1]"), (ROWS, COLS))})
    raw = json.loads((tmp_path / "metadata.json").read_text())
    assert raw["checksum"] == _checksum(raw)
    (piece,) = raw["tensors"]["w"]["pieces"]
    identity = ["w", "f32", [ROWS, COLS], "rank-00000.bin", [[0, ROWS], [0, COLS]]]
    data = (tmp_path / raw["data"] / "rank-00000.bin").read_bytes()[piece["offset"] : piece["offset"] + 48]
    assert raw["block_bytes"] == 1 << 20
    head = json.dumps(identity, separators=(",", ":")).encode() + b"#0"
    assert piece["block_crc32"] == [zlib.crc32(head + data)]
    raw["tensors"]["w"]["shape"] = [ROWS * COLS // 2, 2]
    raw["tensors"]["w"]["pieces"][0]["box"] = [[0, ROWS * COLS // 2], [0, 2]]
    _store(tmp_path, raw, sign=True)
    _refused(tmp_path, _target((ROWS * COLS // 2, 2)), "block 0 of the piece", "edited or swapped")


# --- the messages, exact ------------------------------------------------------------------------
GOLDEN = Path(__file__).parent / "golden" / "checkpoint_errors.txt"


def _messages(directory: Path, name: str, signed: bool) -> list[str]:
    """What ``load`` and ``verify`` say of the checkpoint edited by ``name`` (the folder as CKPT)."""
    edit, target, same_file = EDITS[name]
    raw = _write(directory, same_file=same_file)
    saved = _checksum(raw)
    edit(raw)
    _store(directory, raw if signed else raw | {"checksum": saved}, sign=signed)
    out = []
    for what, call in (
        ("load", lambda: checkpoint.load(directory, target())),
        ("verify", lambda: checkpoint.verify(directory)),
    ):
        with pytest.raises(CheckpointError) as caught:
            call()
        out.append(f"{what}: {str(caught.value).replace(str(directory), 'CKPT')}")
    return out


def test_the_golden_file_has_every_edit_both_ways() -> None:
    assert sorted(golden_blocks(GOLDEN)) == sorted(
        f"{n}, {how}" for n in EDITS for how in ("by hand", "with a fresh checksum")
    )


@pytest.mark.parametrize("name", sorted(EDITS))
def test_the_messages_are_the_golden_text(tmp_path: Path, name: str) -> None:
    golden = golden_blocks(GOLDEN)
    assert _messages(tmp_path / "hand", name, signed=False) == golden[f"{name}, by hand"]
    assert _messages(tmp_path / "tool", name, signed=True) == golden[f"{name}, with a fresh checksum"]
