"""Checkpoints in one process: box geometry against brute force, failures that leave the
previous checkpoint, and bad files or requests that give errors naming the file and tensor
while changing nothing. (Saving on 4 ranks and loading on 2 and 8: test_checkpoint_dist.)"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime import checkpoint
from runtime.checkpoint import CheckpointError, LocalPiece
from runtime.optim import ShardedAdamW, ShardedCAME
from shardlang import parse_layout
from shardlang.box import Box
from shardlang.spec import Layouts

ONE = "mesh[1]"
SHAPES = {"w": (37, 24), "b": (24,), "t": (4, 6, 5)}


# --- geometry against brute force ---------------------------------------------------------
def test_flat_range_boxes_are_the_range_in_order() -> None:
    """Every range of several blocks (empty dims included): the boxes, read row-major one
    after the other from an arange, are exactly the flat range."""
    for shape in [(3, 4, 5), (2, 1, 3), (5,), (4, 0), (1, 7), ()]:
        start = tuple(2 for _ in shape)
        block = tuple((s, s + n) for s, n in zip(start, shape, strict=True))
        big = torch.arange(math.prod(n + 3 for n in shape)).reshape([n + 3 for n in shape])
        flat = big[tuple(slice(lo, hi) for lo, hi in block)].reshape(-1)
        total = math.prod(shape)
        for lo, hi in itertools.combinations_with_replacement(range(total + 1), 2):
            boxes = Box(block).flat_range(lo, hi)
            got = [big[tuple(slice(a, b) for a, b in box)].reshape(-1) for box in boxes]
            assert torch.equal(torch.cat([torch.zeros(0, dtype=torch.int64), *got]), flat[lo:hi]), (shape, lo, hi)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_box_runs_read_exactly_the_sub_box() -> None:
    """Random sub-boxes of random stored boxes: the bytes at the runs, concatenated, are the
    sub-box's bytes, and no two runs are adjacent (they would be one read)."""
    rng = random.Random(3)
    for _ in range(300):
        ndim = rng.randint(0, 4)
        stored = tuple((s, s + rng.randint(0, 5)) for s in (rng.randint(0, 3) for _ in range(ndim)))
        sub = []
        for lo, hi in stored:
            a = rng.randint(lo, hi)
            sub.append((a, rng.randint(a, hi)))
        sub = Box(sub)
        data = torch.arange(math.prod(hi - lo for lo, hi in stored), dtype=torch.int32)
        raw = data.numpy().tobytes()
        runs = [(offset * 4, length * 4) for offset, length in Box(stored).runs(sub)]
        got = b"".join(raw[offset : offset + length] for offset, length in runs)
        index = tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(sub, stored, strict=True))
        want = data.reshape([hi - lo for lo, hi in stored])[index].contiguous().numpy().tobytes()
        assert got == want, (stored, sub)
        assert all(o1 + n1 < o2 for (o1, n1), (o2, _) in itertools.pairwise(runs))


# --- helpers --------------------------------------------------------------------------------
def _layout(text: str) -> Any:
    return parse_layout(f"{text} over {ONE}")


def _tensors(scale: float = 1.0) -> dict[str, LocalPiece]:
    gen = torch.Generator().manual_seed(5)
    return {
        "w": LocalPiece(torch.randn(37, 24, generator=gen) * scale, _layout("R,R"), (37, 24)),
        "h": LocalPiece((torch.randn(6, 5, generator=gen) * scale).to(torch.bfloat16), _layout("R,R"), (6, 5)),
        "i": LocalPiece(torch.arange(10) * int(scale), _layout("R"), (10,)),
        "m": LocalPiece(torch.arange(7) % 2 == 0, _layout("R"), (7,)),
        "z": LocalPiece(torch.zeros(3, 0), _layout("R,R"), (3, 0)),
        "s": LocalPiece(torch.tensor(2.5 * scale), _layout("()"), ()),
        "p": LocalPiece(torch.ones(4) * scale, _layout("R | P0"), (4,)),  # partial over 1 rank: the value
    }


def _blank(tensors: dict[str, LocalPiece]) -> dict[str, LocalPiece]:
    return {n: LocalPiece(torch.zeros_like(p.tensor), p.layout, p.shape) for n, p in tensors.items()}


def _digest(directory: Path) -> dict[str, str]:
    """Every file under the checkpoint folder, by content."""
    return {
        str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(directory.rglob("*"))
        if f.is_file()
    }


def _rank_file(directory: Path) -> Path:
    metadata = json.loads((directory / "metadata.json").read_text())
    return directory / metadata["data"] / "rank-00000.bin"


def test_tensors_of_every_kind_round_trip(tmp_path: Path) -> None:
    saved = _tensors()
    checkpoint.save(tmp_path, saved)
    loaded = _blank(saved)
    report = checkpoint.load(tmp_path, loaded)
    for name, piece in saved.items():
        assert piece.tensor.dtype == loaded[name].tensor.dtype
        assert torch.equal(piece.tensor, loaded[name].tensor), name
    assert report.data_bytes == sum(p.tensor.numel() * p.tensor.element_size() for p in saved.values())
    assert checkpoint.verify(tmp_path) == report.data_bytes
    metadata = json.loads((tmp_path / "metadata.json").read_text())
    assert metadata["tensors"]["p"]["layout"] == "R over mesh[1]"  # the value, not the addends
    assert metadata["tensors"]["h"]["dtype"] == "bf16"


# --- saves that fail --------------------------------------------------------------------------
def _first_and_digest(directory: Path) -> dict[str, str]:
    checkpoint.save(directory, _tensors())
    return _digest(directory)


def _still_the_first(directory: Path, before: dict[str, str]) -> None:
    assert _digest(directory) == before
    loaded = _blank(_tensors())
    checkpoint.load(directory, loaded)
    for name, piece in _tensors().items():
        assert torch.equal(piece.tensor, loaded[name].tensor), name


def test_a_save_failing_midway_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _first_and_digest(tmp_path)
    original = checkpoint.files.RankFileWriter.write
    calls = []

    def write_then_fail(self: Any, data: torch.Tensor, block_bytes: int, identity: bytes) -> Any:
        calls.append(1)
        if len(calls) > 2:
            raise OSError(28, "No space left on device (injected)")
        return original(self, data, block_bytes, identity)

    monkeypatch.setattr(checkpoint.files.RankFileWriter, "write", write_then_fail)
    with pytest.raises(CheckpointError, match=r"No space left.*not committed; the previous checkpoint is unchanged"):
        checkpoint.save(tmp_path, _tensors(2.0))
    assert len(calls) == 3
    _still_the_first(tmp_path, before)


def test_a_commit_failing_before_the_metadata_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    commit = importlib.import_module("runtime.checkpoint.commit")
    before = _first_and_digest(tmp_path)

    def crash(source: Path, target: Path) -> None:
        raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(commit, "replace_synced", crash)
    with pytest.raises(CheckpointError, match=r"Input/output error.*the new checkpoint was not committed"):
        checkpoint.save(tmp_path, _tensors(2.0))
    _still_the_first(tmp_path, before)


def test_what_a_crashed_save_leaves_is_ignored_then_removed(tmp_path: Path) -> None:
    before = _first_and_digest(tmp_path)
    for leftover in (".staging-0123456789abcdef", "data-fedcba9876543210"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "rank-00000.bin").write_bytes(b"half a piece")
    _still_the_first(tmp_path, {**before, **{k: v for k, v in _digest(tmp_path).items() if k not in before}})
    checkpoint.save(tmp_path, _tensors(3.0))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        json.loads((tmp_path / "metadata.json").read_text())["data"]
    ]


def test_bad_pieces_and_timeouts_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    bad = {"w": LocalPiece(torch.zeros(36, 24), _layout("R,R"), (37, 24))}
    with pytest.raises(CheckpointError, match=r"tensor 'w'.*\[36, 24\].*\[37, 24\].*nothing was written"):
        checkpoint.save(target, bad)
    for timeout in (-1, "soon"):
        with pytest.raises(CheckpointError, match="timeout must be positive"):
            checkpoint.save(target, _tensors(), timeout=timeout)
        with pytest.raises(CheckpointError, match="timeout must be positive"):
            checkpoint.load(target, _blank(_tensors()), timeout=timeout)
    assert not target.exists()


# --- bad files and requests -------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path: Path) -> Path:
    checkpoint.save(tmp_path, _tensors())
    return tmp_path


def _refused(directory: Path, tensors: dict[str, LocalPiece], *patterns: str) -> str:
    """Loading fails with every pattern in the message, and the targets stay as they were."""
    before = {n: p.tensor.clone() for n, p in tensors.items()}
    with pytest.raises(CheckpointError) as error:
        checkpoint.load(directory, tensors)
    message = str(error.value)
    for pattern in patterns:
        assert pattern in message, message
    for name, piece in tensors.items():
        assert torch.equal(piece.tensor, before[name]), f"'{name}' changed"
    return message


def test_a_missing_or_foreign_checkpoint(tmp_path: Path) -> None:
    _refused(tmp_path, _blank(_tensors()), str(tmp_path / "metadata.json"), "no checkpoint here")
    (tmp_path / "metadata.json").write_text('{"format": "something else"}')
    _refused(tmp_path, _blank(_tensors()), "not a shardlang checkpoint")


@pytest.mark.parametrize("cut", [0.5, 0.95])
def test_a_truncated_metadata_file(saved: Path, cut: float) -> None:
    path = saved / "metadata.json"
    text = path.read_bytes()
    path.write_bytes(text[: int(len(text) * cut)])
    _refused(saved, _blank(_tensors()), str(path), "not valid JSON")


def test_metadata_that_does_not_describe_its_files(saved: Path) -> None:
    path = saved / "metadata.json"
    good = json.loads(path.read_text())
    edits = {
        "ends past the end": lambda m: m["tensors"]["w"]["pieces"][0].update(offset=10**6),
        "records 1 bytes": lambda m: m["tensors"]["w"]["pieces"][0].update(length=1),
        "is not inside the shape": lambda m: m["tensors"]["w"]["pieces"][0].update(box=[[0, 38], [0, 24]]),
        "does not fit": lambda m: m["tensors"]["w"].update(layout="R over mesh[1]"),
        "unknown dtype": lambda m: m["tensors"]["w"].update(dtype="f8"),
        "hold 0 elements": lambda m: m["tensors"]["w"].update(pieces=[]),
        "has 2 block checksums": lambda m: m["tensors"]["w"]["pieces"][0]["block_crc32"].append(0),
    }
    for pattern, edit in edits.items():
        broken = json.loads(json.dumps(good))
        edit(broken)
        path.write_text(json.dumps(broken))
        _refused(saved, _blank(_tensors()), str(path), "tensor 'w'", pattern)


def test_a_missing_rank_file(saved: Path) -> None:
    rank_file = _rank_file(saved)
    rank_file.unlink()
    _refused(saved, _blank(_tensors()), str(rank_file), "tensor '", "missing")


def test_a_truncated_rank_file(saved: Path) -> None:
    rank_file = _rank_file(saved)
    data = rank_file.read_bytes()
    rank_file.write_bytes(data[:-4])
    _refused(saved, _blank(_tensors()), str(rank_file), "tensor '", "truncated")


def test_a_corrupt_rank_file(saved: Path) -> None:
    """A flipped byte in a piece fails its block's checksum, whether the piece is read whole
    or in part (rows 0..18 of 'w', one block of 1 MiB), and in ``verify``."""
    rank_file = _rank_file(saved)
    data = bytearray(rank_file.read_bytes())
    (piece,) = json.loads((saved / "metadata.json").read_text())["tensors"]["w"]["pieces"]
    data[piece["offset"] + 100] ^= 0x10  # in row 1 of 'w'
    rank_file.write_bytes(bytes(data))
    _refused(saved, _blank(_tensors()), str(rank_file), "tensor 'w'", "block 0", "checksum")
    partial = {"w": LocalPiece(torch.zeros(19, 24), parse_layout("S0,R over mesh[2] ranks [0,1]"), (37, 24))}
    _refused(saved, partial, str(rank_file), "tensor 'w'", "block 0 of the piece [[0, 37], [0, 24]]", "checksum")
    with pytest.raises(CheckpointError, match=r"rank-00000.bin: tensor 'w'.*block 0.*checksum"):
        checkpoint.verify(saved)


def test_shape_dtype_and_layout_mismatches(saved: Path) -> None:
    metadata = str(saved / "metadata.json")
    base = _blank(_tensors())
    cases = {
        "stored with shape [37, 24]": {"w": LocalPiece(torch.zeros(37, 25), _layout("R,R"), (37, 25))},
        "stored as f32, but is loaded as f64": {
            "w": LocalPiece(torch.zeros(37, 24, dtype=torch.float64), _layout("R,R"), (37, 24))
        },
        "describes a 1-d tensor": {"w": LocalPiece(torch.zeros(37, 24), _layout("R"), (37, 24))},
        "is not in the checkpoint": {"v": LocalPiece(torch.zeros(3), _layout("R"), (3,))},
    }
    for pattern, request in cases.items():
        message = _refused(saved, base | request, pattern)
        assert f"tensor '{next(iter(request))}'" in message, message
        if "layout" not in pattern and "1-d" not in pattern:
            assert metadata in message, message


# --- optimizers ---------------------------------------------------------------------------------
def _optimizer(
    kind: type, seed: int, dtype: torch.dtype = torch.float32, steps: int = 3
) -> tuple[dict[str, torch.nn.Parameter], Any]:
    gen = torch.Generator().manual_seed(seed)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for n, s in SHAPES.items()}
    spec = {}
    for name, shape in SHAPES.items():
        layout = _layout(",".join("R" for _ in shape))
        spec[name] = Layouts(param=layout, grad=layout, states=(("", layout),))
    optimizer = kind(list(params.items()), spec, lr=0.01)
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        optimizer.step()
    return params, optimizer


def _states(optimizer: Any) -> dict[tuple[str, str], torch.Tensor]:
    return {(n, s): r["tensor"] for n, e in optimizer.state_dict()["tensors"].items() for s, r in e["states"].items()}


def test_optimizer_states_round_trip_and_mismatches_change_nothing(tmp_path: Path) -> None:
    params, came = _optimizer(ShardedCAME, 1)
    checkpoint.save(tmp_path, optimizer=came)
    other_params, other = _optimizer(ShardedCAME, 2)
    checkpoint.load(tmp_path, optimizer=other)
    assert all(torch.equal(params[n], other_params[n]) for n in SHAPES)
    want = _states(came)
    assert all(torch.equal(t, want[k]) for k, t in _states(other).items()) and _states(other).keys() == want.keys()

    adamw_params, adamw = _optimizer(ShardedAdamW, 3)
    before = ({n: p.detach().clone() for n, p in adamw_params.items()}, _states(adamw))
    with pytest.raises(CheckpointError, match="states of a ShardedCAME, not of a ShardedAdamW"):
        checkpoint.load(tmp_path, optimizer=adamw)
    assert all(torch.equal(adamw_params[n], before[0][n]) for n in SHAPES)
    assert all(torch.equal(t, before[1][k]) for k, t in _states(adamw).items())

    with pytest.raises(CheckpointError, match="given twice"):
        checkpoint.save(tmp_path / "twice", {"w": LocalPiece(torch.zeros(37, 24), _layout("R,R"), (37, 24))}, came)
    (tmp_path / "metadata.json").write_text((tmp_path / "metadata.json").read_text().replace('"step": 3', '"step": -1'))
    with pytest.raises(CheckpointError, match=r"metadata\.json"):
        checkpoint.load(tmp_path, optimizer=other)


def test_bf16_parameters_and_their_fp32_masters_round_trip(tmp_path: Path) -> None:
    params, adamw = _optimizer(ShardedAdamW, 4, torch.bfloat16)
    checkpoint.save(tmp_path, optimizer=adamw)
    other_params, other = _optimizer(ShardedAdamW, 5, torch.bfloat16)
    checkpoint.load(tmp_path, optimizer=other)
    want = _states(adamw)
    assert {s for _, s in want} == {"exp_avg", "exp_avg_sq", "master"}
    assert _states(other).keys() == want.keys()
    for key, tensor in _states(other).items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, want[key]), key
    for name, p in params.items():
        assert other_params[name].dtype == torch.bfloat16 and torch.equal(other_params[name], p), name


def test_a_checkpoint_saved_before_the_first_step(tmp_path: Path) -> None:
    """Parameters only: they load into a new optimizer (into parameters that require
    gradients), which then has no states; one that has stepped refuses them unchanged."""
    params, fresh = _optimizer(ShardedCAME, 6, steps=0)
    checkpoint.save(tmp_path, optimizer=fresh)
    new_params, new = _optimizer(ShardedCAME, 7, steps=0)
    assert all(p.requires_grad for p in new_params.values())
    checkpoint.load(tmp_path, optimizer=new)
    assert all(torch.equal(new_params[n], params[n]) for n in SHAPES)
    assert new.state_dict()["tensors"] == {}
    stepped_params, stepped = _optimizer(ShardedCAME, 8)
    before = {n: p.detach().clone() for n, p in stepped_params.items()}
    with pytest.raises(CheckpointError, match=r"tensor '\w+' has no optimizer states in the checkpoint"):
        checkpoint.load(tmp_path, optimizer=stepped)
    assert all(torch.equal(stepped_params[n], before[n]) for n in SHAPES)


def test_parameters_given_as_tensors_load_in_place(tmp_path: Path) -> None:
    weight = torch.nn.Parameter(torch.randn(37, 24))
    checkpoint.save(tmp_path, {"w": LocalPiece(weight, _layout("R,R"), (37, 24))})
    other = torch.nn.Parameter(torch.zeros(37, 24))
    checkpoint.load(tmp_path, {"w": LocalPiece(other, _layout("R,R"), (37, 24))})
    assert torch.equal(other, weight) and other.requires_grad
