"""Checkpoints against damage and hostile files, in one process: a checksum per block that
partial reads check, metadata that is malformed in every field (too deep, too large, of the
wrong type), links out of the checkpoint and files that are not regular files, and the
commit protocol when another rank gives up at each point of rank 0's commit."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime import checkpoint
from runtime.checkpoint import CheckpointError, LocalPiece
from runtime.checkpoint.metadata import metadata_checksum
from runtime.optim import ShardedAdamW
from shardlang import parse_layout
from shardlang.spec import Layouts

commit = importlib.import_module("runtime.checkpoint.commit")
files = importlib.import_module("runtime.checkpoint.files")

ROWS, COLS = 37, 24  # f32: a row is 96 bytes
BLOCK = 256


def _weight(scale: float = 1.0) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * scale


def _whole(tensor: torch.Tensor) -> dict[str, LocalPiece]:
    return {"w": LocalPiece(tensor, parse_layout("R,R over mesh[1]"), (ROWS, COLS))}


def _top_rows() -> dict[str, LocalPiece]:
    """Rows 0..18 of 'w' (rank 0's piece of S0 over two ranks): read in part."""
    return {"w": LocalPiece(torch.zeros(19, COLS), parse_layout("S0,R over mesh[2] ranks [0,1]"), (ROWS, COLS))}


def _metadata(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "metadata.json").read_text())


def _rank_file(directory: Path) -> Path:
    return directory / _metadata(directory)["data"] / "rank-00000.bin"


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x04
    path.write_bytes(bytes(data))


# --- a checksum per block ---------------------------------------------------------------------
def test_every_block_of_a_piece_has_the_crc_of_its_identity_and_bytes(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, _whole(_weight()), block_bytes=BLOCK)
    metadata = _metadata(tmp_path)
    assert metadata["format"] == "shardlang.checkpoint/3" and metadata["block_bytes"] == BLOCK
    (piece,) = metadata["tensors"]["w"]["pieces"]
    raw = _rank_file(tmp_path).read_bytes()[piece["offset"] : piece["offset"] + ROWS * COLS * 4]
    assert raw == _weight().numpy().tobytes()
    # The identity as the format documents it: [key, dtype, shape, rank file, box], then "#<block>".
    identity = b'["w","f32",[37,24],"rank-00000.bin",[[0,37],[0,24]]]'
    expected = [zlib.crc32(identity + b"#%d" % (i // BLOCK) + raw[i : i + BLOCK]) for i in range(0, len(raw), BLOCK)]
    assert piece["block_crc32"] == expected
    assert len(piece["block_crc32"]) == 14  # 3552 bytes: 13 whole blocks and one of 224


def test_a_partial_read_checks_exactly_the_blocks_it_reads(tmp_path: Path) -> None:
    """Rows 0..18 are bytes 0..1823 of the piece: blocks 0..7. A flipped bit in row 5
    (block 1) fails the partial load, naming the file and the block; one in row 30 (block 11)
    is not read by it, and ``verify`` finds it."""
    checkpoint.save(tmp_path, _whole(_weight()), block_bytes=BLOCK)
    rank_file = _rank_file(tmp_path)
    (piece,) = _metadata(tmp_path)["tensors"]["w"]["pieces"]
    clean = rank_file.read_bytes()

    target = _top_rows()
    report = checkpoint.load(tmp_path, target)
    assert torch.equal(target["w"].tensor, _weight()[:19])
    assert report.data_bytes == 8 * BLOCK and report.reads == 1

    _flip(rank_file, piece["offset"] + 5 * 96 + 7)
    with pytest.raises(CheckpointError) as caught:
        checkpoint.load(tmp_path, _top_rows())
    message = str(caught.value)
    assert f"{rank_file}: tensor 'w': block 1 of the piece [[0, 37], [0, 24]]" in message, message
    assert f"bytes {piece['offset'] + 256}..{piece['offset'] + 512} of the file" in message, message
    assert "checksum" in message and "nothing was changed" in message

    rank_file.write_bytes(clean)
    _flip(rank_file, piece["offset"] + 30 * 96)
    target = _top_rows()
    checkpoint.load(tmp_path, target)
    assert torch.equal(target["w"].tensor, _weight()[:19])
    with pytest.raises(CheckpointError, match=r"rank-00000\.bin: tensor 'w': block 11 of the piece .*checksum"):
        checkpoint.verify(tmp_path)


def test_columns_read_the_blocks_of_every_row(tmp_path: Path) -> None:
    """Columns 0..11 touch every 256-byte block (each holds a row's first columns): the load
    reads and checks the whole piece, and a flip anywhere in it fails."""
    checkpoint.save(tmp_path, _whole(_weight()), block_bytes=BLOCK)
    target = {"w": LocalPiece(torch.zeros(ROWS, 12), parse_layout("R,S0 over mesh[2] ranks [0,1]"), (ROWS, COLS))}
    report = checkpoint.load(tmp_path, target)
    assert torch.equal(target["w"].tensor, _weight()[:, :12])
    assert report.data_bytes == ROWS * COLS * 4
    _flip(_rank_file(tmp_path), ROWS * COLS * 4 - 1)  # the last column of the last row: not loaded, but checked
    with pytest.raises(CheckpointError, match="block 13 of the piece"):
        checkpoint.load(tmp_path, target)


def test_the_default_block_is_a_mebibyte_and_bad_block_sizes_are_refused(tmp_path: Path) -> None:
    checkpoint.save(tmp_path / "a", _whole(_weight()))
    assert _metadata(tmp_path / "a")["block_bytes"] == 1 << 20
    for bad in (0, -4, 1.5, True, "256"):
        with pytest.raises(CheckpointError, match="block_bytes must be a positive integer"):
            checkpoint.save(tmp_path / "b", _whole(_weight()), block_bytes=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "b").exists()


def test_a_checkpoint_of_the_first_format_is_named_as_such(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, _whole(_weight()))
    (tmp_path / "metadata.json").write_text(json.dumps(_metadata(tmp_path) | {"format": "shardlang.checkpoint/1"}))
    with pytest.raises(CheckpointError, match=r"format 'shardlang.checkpoint/1'; this version reads"):
        checkpoint.verify(tmp_path)


# --- malformed metadata -----------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path: Path) -> Path:
    checkpoint.save(
        tmp_path, _whole(_weight()) | {"b": LocalPiece(torch.ones(5), parse_layout("R over mesh[1]"), (5,))}
    )
    return tmp_path


def _rewrite(directory: Path, text: str) -> Path:
    """Replace the metadata with ``text``; JSON of format 3 gets a fresh checksum, as a tool that
    rewrites the metadata would give it, so that what is checked is every field's own check."""
    path = directory / "metadata.json"
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError):
        raw = None
    if isinstance(raw, dict) and raw.get("format") == "shardlang.checkpoint/3":
        text = json.dumps(raw | {"checksum": metadata_checksum(raw)})
    path.write_text(text)
    return path


def _both_refuse(directory: Path, *words: str) -> None:
    """``verify`` and ``load`` raise a CheckpointError holding every word; the target stays."""
    target = _whole(torch.full((ROWS, COLS), 7.0))
    for call in (lambda: checkpoint.verify(directory), lambda: checkpoint.load(directory, target)):
        with pytest.raises(CheckpointError) as caught:
            call()
        for word in words:
            assert word in str(caught.value), str(caught.value)
    assert torch.equal(target["w"].tensor, torch.full((ROWS, COLS), 7.0))


def test_deeply_nested_metadata_names_the_field(saved: Path) -> None:
    text = (saved / "metadata.json").read_text()
    shape = json.dumps(_metadata(saved)["tensors"]["w"]["shape"])
    path = _rewrite(saved, text.replace(shape, "[" * 100_000 + "]" * 100_000, 1))
    _both_refuse(saved, str(path), "field tensors.w.shape nests deeper")
    _rewrite(saved, '{"format": "shardlang.checkpoint/3", "files": ' + '{"a": ' * 50_000 + "1" + "}" * 50_001)
    _both_refuse(saved, str(path), "field files.a.a.a.a.a.a.a nests deeper")


def test_a_box_of_two_to_the_sixty_elements_is_checked_against_the_file_first(saved: Path) -> None:
    """Every field consistent with a tensor of 2^60 x 24 floats, even the rank file's size
    and one checksum block: the real file's size refuses it before anything is allocated."""
    metadata = _metadata(saved)
    huge = 2**60 * COLS * 4
    metadata["block_bytes"] = 2**70
    metadata["files"]["rank-00000.bin"] = huge + 10**6
    metadata["tensors"]["w"]["shape"] = [2**60, COLS]
    piece = metadata["tensors"]["w"]["pieces"][0]
    piece.update(box=[[0, 2**60], [0, COLS]], length=huge, block_crc32=[0])
    metadata["tensors"]["b"]["pieces"][0]["block_crc32"] = [0]
    _rewrite(saved, json.dumps(metadata))
    with pytest.raises(
        CheckpointError, match=r"rank-00000\.bin: tensor '\w': the rank file has \d+ bytes, the metadata"
    ):
        checkpoint.verify(saved)
    target = {"w": LocalPiece(torch.zeros(2, COLS), parse_layout("S0,R over mesh[2] ranks [0,1]"), (4, COLS))}
    with pytest.raises(CheckpointError, match=r"tensor 'w' is stored with shape \[1152921504606846976, 24\]"):
        checkpoint.load(saved, target)


# Hand-written fields and what each must be.
FIELD_CASES = [
    (["world_size"], "2", "field world_size must be an integer, not a string"),
    (["world_size"], 0, "field world_size is 0; it must be at least 1"),
    (["block_bytes"], None, "field block_bytes must be an integer, not null"),
    (["data"], "../elsewhere", "field data is '../elsewhere', which is not a data folder name"),
    (["files"], [], "field files must be an object, not a list"),
    (["files", "rank-00000.bin"], True, 'field files["rank-00000.bin"] must be an integer, not a boolean'),
    (["tensors"], "w", "field tensors must be an object, not a string"),
    (["tensors", "w", "shape"], {"0": 37}, "field tensors.w.shape must be a list, not an object"),
    (["tensors", "w", "shape", 1], 24.0, "field tensors.w.shape[1] must be an integer, not a number"),
    (["tensors", "w", "layout"], 7, "field tensors.w.layout must be a string, not an integer"),
    (["tensors", "w", "flat_axis"], 0, "field tensors.w.flat_axis must be a string, not an integer"),
    (["tensors", "w", "dtype"], ["f32"], "field tensors.w.dtype must be a string, not a list"),
    (["tensors", "w", "pieces", 0], [], "field tensors.w.pieces[0] must be an object, not a list"),
    (["tensors", "w", "pieces", 0, "file"], None, "field tensors.w.pieces[0].file must be a string, not null"),
    (["tensors", "w", "pieces", 0, "offset"], -1, "field tensors.w.pieces[0].offset is -1; it must be at least 0"),
    (["tensors", "w", "pieces", 0, "box", 1], [0, 12, 24], "field tensors.w.pieces[0].box[1] must be [start, stop]"),
    (["tensors", "w", "pieces", 0, "box", 1, 0], "0", "field tensors.w.pieces[0].box[1][0] must be an integer"),
    (["tensors", "w", "pieces", 0, "block_crc32", 0], 2**32, "field tensors.w.pieces[0].block_crc32[0] is 4294967296"),
    (["tensors", "w", "pieces", 0, "block_crc32"], 5, "field tensors.w.pieces[0].block_crc32 must be a list"),
    (["optimizer"], [], "field optimizer must be an object, not a list"),
]


def _set(raw: Any, keys: list[Any], value: Any) -> None:
    for key in keys[:-1]:
        raw = raw[key]
    raw[keys[-1]] = value


@pytest.mark.parametrize(("keys", "value", "words"), FIELD_CASES)
def test_a_field_of_the_wrong_type_or_range_is_named(saved: Path, keys: list[Any], value: Any, words: str) -> None:
    metadata = _metadata(saved)
    _set(metadata, keys, value)
    path = _rewrite(saved, json.dumps(metadata))
    _both_refuse(saved, f"{path}: {words}")


def test_a_missing_field_is_named(saved: Path) -> None:
    metadata = _metadata(saved)
    del metadata["tensors"]["w"]["pieces"][0]["length"]
    path = _rewrite(saved, json.dumps(metadata))
    _both_refuse(saved, f"{path}: field tensors.w.pieces[0].length is missing")


def _paths(value: Any, keys: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [keys]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*keys, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*keys, i))
    return out


def test_every_field_replaced_by_every_kind_of_value_gives_a_checkpoint_error(saved: Path) -> None:
    """Each of the metadata's fields (all levels) set to null, a flag, a string, a negative, a
    huge and a fractional number, a list and an object: ``verify`` and ``load`` succeed or
    raise a CheckpointError naming metadata.json (or a rank file), never anything else."""
    good = _metadata(saved)
    kinds = [None, True, "x", -1, 2**64, 0.5, [], {}, [[0, 1]], {"a": []}]
    tried = 0
    for keys in _paths(good):
        if not keys or keys == ("format",):
            continue
        for value in kinds:
            broken = json.loads(json.dumps(good))
            _set(broken, list(keys), value)
            _rewrite(saved, json.dumps(broken))
            for call in (
                lambda: checkpoint.verify(saved),
                lambda: checkpoint.load(saved, _whole(torch.zeros(ROWS, COLS))),
            ):
                try:
                    call()
                except CheckpointError as e:
                    assert "metadata.json" in str(e) or "rank-00000.bin" in str(e), (keys, value, str(e))
            tried += 1
    assert tried > 300


def test_hyperparameters_of_the_wrong_kind_are_refused_before_loading(tmp_path: Path) -> None:
    layout = parse_layout("R over mesh[1]")
    spec = {"p": Layouts(param=layout, grad=layout, states=(("", layout),))}

    def optimizer() -> tuple[torch.nn.Parameter, Any]:
        p = torch.nn.Parameter(torch.ones(4))
        adamw = ShardedAdamW([("p", p)], spec, lr=0.1)
        p.grad = torch.ones(4)
        adamw.step()
        return p, adamw

    _, saved_optimizer = optimizer()
    checkpoint.save(tmp_path, optimizer=saved_optimizer)
    good = _metadata(tmp_path)
    cases = [
        ("lr", "fast", "field optimizer.param_groups[0].lr must be a number"),
        ("betas", [0.9], "field optimizer.param_groups[0].betas must be a list of 2 (a number, a number)"),
        ("params", [1, 2], "field optimizer.param_groups[0].params is not a hyperparameter"),
    ]
    for name, value, words in cases:
        broken = json.loads(json.dumps(good))
        broken["optimizer"]["param_groups"][0][name] = value
        _rewrite(tmp_path, json.dumps(broken))
        p, other = optimizer()
        before = (p.detach().clone(), other.param_groups[0]["lr"])
        with pytest.raises(CheckpointError) as caught:
            checkpoint.load(tmp_path, optimizer=other)
        assert words in str(caught.value), str(caught.value)
        assert torch.equal(p, before[0]) and other.param_groups[0]["lr"] == before[1]


# --- links and special files ---------------------------------------------------------------------
def test_a_data_folder_linked_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    checkpoint.save(directory, _whole(_weight()))
    data = directory / _metadata(directory)["data"]
    outside = tmp_path / "elsewhere"
    shutil.move(data, outside)
    data.symlink_to(outside, target_is_directory=True)
    _both_refuse(directory, f"{data}: the data folder is a link to {outside}, outside the checkpoint")


def _saved_with_its_rank_file_moved(directory: Path, to: Path) -> Path:
    """A checkpoint of ``_weight()`` saved to ``directory``, its rank file then moved ``to``:
    where that file was."""
    checkpoint.save(directory, _whole(_weight()))
    rank_file = _rank_file(directory)
    shutil.move(rank_file, to)
    return rank_file


def test_a_rank_file_linked_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    directory, outside = tmp_path / "ckpt", tmp_path / "stolen.bin"
    rank_file = _saved_with_its_rank_file_moved(directory, outside)
    rank_file.symlink_to(outside)
    _both_refuse(directory, f"{rank_file}: the rank file is a link to {outside}, outside the checkpoint")
    (directory / "metadata.json").rename(tmp_path / "metadata.json")
    (directory / "metadata.json").symlink_to(tmp_path / "metadata.json")
    _both_refuse(directory, "the metadata file is a link to", "outside the checkpoint")


def test_links_inside_the_checkpoint_are_followed(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    kept = directory / "kept.bin"
    rank_file = _saved_with_its_rank_file_moved(directory, kept)
    rank_file.symlink_to(os.path.relpath(kept, rank_file.parent))
    target = _whole(torch.zeros(ROWS, COLS))
    checkpoint.load(directory, target)
    assert torch.equal(target["w"].tensor, _weight())
    assert checkpoint.verify(tmp_path / "ckpt") == ROWS * COLS * 4


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_rank_file_or_metadata_that_is_not_a_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    """A FIFO would block the read forever, a folder fail inside the OS: both are refused."""
    checkpoint.save(tmp_path, _whole(_weight()))
    rank_file = _rank_file(tmp_path)
    for path, what in ((rank_file, "the rank file"), (tmp_path / "metadata.json", "the metadata file")):
        path.unlink()
        os.mkfifo(path) if kind == "fifo" else path.mkdir()
        with pytest.raises(CheckpointError, match=rf"{what} is a {'FIFO' if kind == 'fifo' else 'folder'}"):
            checkpoint.verify(tmp_path)


# --- the commit protocol when another rank gives up ------------------------------------------------
def _token(path: Path) -> str:
    return path.name.removeprefix(".staging-").removeprefix("data-")


def _loads(directory: Path) -> torch.Tensor:
    target = _whole(torch.zeros(ROWS, COLS))
    checkpoint.load(directory, target)
    return target["w"].tensor


@pytest.mark.parametrize("when", ["before the rename", "before the replace", "after the replace"])
def test_a_rank_giving_up_during_the_commit_makes_the_outcome_final(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Rank 1 gives up (``settle``) at three points of rank 0's commit: before it renames
    the staging folder, before it replaces the metadata, and after. What ``settle`` says is
    what happened: not committed (rank 0's step then fails) in the first two, committed in
    the last; and rank 0's save agrees."""
    checkpoint.save(tmp_path, _whole(_weight()))
    said = []
    original_write, original_replace = commit.write_synced, commit.replace_synced

    def write_then_give_up(path: Path, data: bytes) -> None:
        original_write(path, data)
        said.append(commit.settle(tmp_path, _token(path.parent), 1))

    def replace_around_giving_up(source: Path, target: Path) -> None:
        if when == "after the replace":
            original_replace(source, target)
        said.append(commit.settle(tmp_path, _token(source.parent), 1))
        if when == "before the replace":
            original_replace(source, target)

    if when == "before the rename":
        monkeypatch.setattr(commit, "write_synced", write_then_give_up)
    else:
        monkeypatch.setattr(commit, "replace_synced", replace_around_giving_up)
    if when == "after the replace":
        checkpoint.save(tmp_path, _whole(_weight(2.0)))
        assert said == [commit.COMMITTED]
        assert torch.equal(_loads(tmp_path), _weight(2.0))
        return
    with pytest.raises(CheckpointError) as caught:
        checkpoint.save(tmp_path, _whole(_weight(2.0)))
    assert said == [commit.NOT_COMMITTED]
    assert str(caught.value).endswith(commit.NOT_COMMITTED), str(caught.value)
    assert torch.equal(_loads(tmp_path), _weight())
    monkeypatch.undo()
    checkpoint.save(tmp_path, _whole(_weight(3.0)))  # the next save clears what was given up
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["metadata.json", _metadata(tmp_path)["data"]])


def test_a_sync_failing_after_the_metadata_moved_reports_a_committed_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replace happened, the folder sync after it failed: the save says it was committed
    (and keeps the data folder the new metadata names, which loads)."""
    checkpoint.save(tmp_path, _whole(_weight()))

    def broken_sync(path: Path) -> None:
        raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(files, "fsync_folder", broken_sync)  # what replace_synced calls after the move
    with pytest.raises(CheckpointError) as caught:
        checkpoint.save(tmp_path, _whole(_weight(2.0)))
    message = str(caught.value)
    assert "Input/output error (injected)" in message and "the new checkpoint was committed" in message, message
    assert "not committed" not in message
    monkeypatch.undo()
    assert torch.equal(_loads(tmp_path), _weight(2.0))
    assert checkpoint.verify(tmp_path) == ROWS * COLS * 4


def test_the_reader_returns_exactly_the_runs_whatever_the_blocks_and_spans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random increasing byte runs of a piece, random block sizes, reads cut into spans of a
    few blocks: what the reader returns is the runs' bytes, sliced from the file by hand, and
    it reads only the blocks the runs touch."""
    import random

    from runtime.checkpoint.metadata import StoredPiece
    from runtime.checkpoint.reader import RangeReader

    reader_module = importlib.import_module("runtime.checkpoint.reader")
    rng = random.Random(11)
    data = bytes(rng.randrange(256) for _ in range(5000))
    (tmp_path / "data-x").mkdir()
    (tmp_path / "data-x" / "rank-00000.bin").write_bytes(b"head" + data)
    for trial in range(300):
        block = rng.choice([1, 3, 64, 100, 999, 4096, 10_000])
        monkeypatch.setattr(reader_module, "SPAN_BYTES", rng.choice([1, 200, 4096, 1 << 20]))
        crcs = [zlib.crc32(data[i : i + block]) for i in range(0, len(data), block)]
        piece = StoredPiece(file="rank-00000.bin", offset=4, box=((0, len(data)),), block_crc32=crcs)
        cuts = sorted(rng.sample(range(len(data) + 1), rng.choice([2, 4, 10, 40])))
        runs = [(a, b - a) for a, b in zip(cuts[::2], cuts[1::2], strict=False) if b > a]
        into = bytearray(sum(n for _, n in runs))
        reader = RangeReader(tmp_path, "data-x", {"rank-00000.bin": len(data) + 4}, block)
        try:
            reader.read(piece, runs, len(data), memoryview(into), "tensor 't'")
        finally:
            reader.close()
        assert bytes(into) == b"".join(data[a : a + n] for a, n in runs), (trial, block, runs)
        touched = {b for a, n in runs for b in range(a // block, (a + n - 1) // block + 1)}
        want = sum(min((b + 1) * block, len(data)) - b * block for b in touched)
        assert reader.bytes_read.get("rank-00000.bin", 0) == want, (trial, block, runs)
