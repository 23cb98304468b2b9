"""Checkpoints across gloo runs: saved by 4 ranks, loaded by 2 and by 8 under other layouts.

One 4-rank run trains ShardedAdamW and ShardedCAME for 4 steps on two configurations (rows
over dp and columns over tp on [dp=2,tp=2]; flat ZeRO on [dp=4]) and saves each, then saves
plain tensors (uneven, empty, 0-d, replicated, and a partial one) and injects failures into
saves. A 2-rank and an 8-rank run load every checkpoint into other meshes and layouts (ZeRO
rows and flat ZeRO on [dp=2]; nested S(tp,dp) and flat with tp on [dp=4,tp=2]) and train 4
more steps. The checks, here in the test process, are against torch.optim.AdamW and
came_pytorch run on the full tensors for 8 steps without interruption (their states after
step 4 too), and against ``runtime.shard`` of the full tensors for the plain ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.testing import run_ranks
from tests.optim_support import (
    ADAMW,
    CAME,
    CAME_TOLERANCE,
    DP2_TP2,
    DP4,
    SHAPES,
    _dp2_tp2,
    _flat_tp,
    _nested,
    _optimizer,
    _replicated,
    _spec,
    _zero_rows,
    dyadic,
    hand_piece,
    initial_params,
    local_grad,
    reference,
    step_grads,
)

SEED, SAVE_AT, STEPS = 21, 4, 8
KINDS = ("adamw", "came")
# name: (mesh, layouts (param, grad, state) of an n-d tensor, flat axis)
Config = tuple[str, Callable[[int], tuple[str, str, str]], str | None]
SAVES: dict[str, Config] = {"dp2_tp2": (DP2_TP2, _dp2_tp2, None), "flat_dp4": (DP4, _replicated, "dp")}
LOADS: dict[int, dict[str, Config]] = {
    2: {"rows_dp2": ("mesh[dp=2]", _zero_rows, None), "flat_dp2": ("mesh[dp=2]", _replicated, "dp")},
    8: {"nested_dp4_tp2": ("mesh[dp=4,tp=2]", _nested, None), "flat_dp4_tp2": ("mesh[dp=4,tp=2]", _flat_tp, "dp")},
}
# Per world size, each optimizer's two checkpoints go one into each of the two load layouts
# (crosswise for the two optimizers): every saved and every loaded layout meets both kinds.
CASES = [
    (world, kind, saved, list(LOADS[world])[(i + k) % 2])
    for world in LOADS
    for k, kind in enumerate(KINDS)
    for i, saved in enumerate(SAVES)
]

# Plain tensors: name -> (shape, layout saved from by 4 ranks, layouts loaded into by 2 and 8 ranks).
TENSORS: dict[str, tuple[tuple[int, ...], str, dict[int, str]]] = {
    "e": ((301, 8), "S(dp),R over mesh[dp=4]", {2: "R,S0 over mesh[2]", 8: "S(tp,dp),R over mesh[dp=4,tp=2]"}),
    "acc": (
        (37, 24),
        "R,S(tp) | P(dp) over mesh[dp=2,tp=2]",
        {2: "R,R | P0 over mesh[2]", 8: "S(dp),R | P(tp):avg over mesh[dp=4,tp=2]"},
    ),
    "r": (
        (3, 7),
        "R,R over mesh[3] ranks [3,1,2]",
        {2: "S0,R over mesh[2]", 8: "S1,S0 over mesh[2,2] ranks [7,5,6,4]"},
    ),
    "empty": ((4, 0), "S(dp),R over mesh[dp=4]", {2: "R,S0 over mesh[2]", 8: "S01,R over mesh[4,2]"}),
    "scalar": ((), "() over mesh[dp=2,tp=2]", {2: "() over mesh[2]", 8: "() over mesh[8]"}),
}
# Checksum blocks of one f32 element: reading the whole blocks a load touches then reads
# exactly the elements it needs, which the tests below count (the default is 1 MiB).
BLOCK = 4
# The same rows over 4 ranks, read back over 2 (each rank reads the files of the rows it needs).
ROWS_2 = "S(dp),R over mesh[dp=2]"
COLUMNS_4 = "R,S(dp) over mesh[dp=4]"


def full_tensor(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return dyadic(TENSORS[name][0], torch.float32, gen)


def addend(name: str) -> torch.Tensor:
    """What the rank at dp=0 adds to the value of a sum-partial tensor (the other subtracts it)."""
    gen = torch.Generator().manual_seed(1000 + sum(map(ord, name)))
    return dyadic(TENSORS[name][0], torch.float32, gen, 64)


# --- what the ranks run ------------------------------------------------------------------
def _params(spec: dict, rank: int, values: dict[str, torch.Tensor] | None) -> dict[str, torch.nn.Parameter]:
    """This rank's parameter pieces: of ``values``, or filled with 9 (to be loaded)."""
    out = {}
    for name, entry in spec.items():
        layout = entry.param
        coordinate = layout.mesh.coordinate(rank)
        if values is None:
            shape = tuple(hi - lo for lo, hi in layout.piece(entry.shape, coordinate))
            out[name] = torch.nn.Parameter(torch.full(shape, 9.0))
        else:
            out[name] = torch.nn.Parameter(hand_piece(values[name], layout.dims, layout.mesh.shape, coordinate).clone())
    return out


def _train(optimizer: Any, params: dict, spec: dict, rank: int, steps: range) -> None:
    for step in steps:
        for name, (grad, addends) in step_grads(torch.float32, SEED, step).items():
            layout = spec[name].grad
            params[name].grad = local_grad(grad, addends, layout, layout.mesh.coordinate(rank))
        optimizer.step()


def _piece(name: str, layout_text: str, rank: int, value: torch.Tensor | None = None) -> Any:
    """This rank's LocalPiece of a plain tensor (of ``value``, else of the tensor itself); over
    a sum axis (of 2 ranks) the rank at 0 holds the piece plus an addend, the other minus it."""
    import attrs

    from runtime import shard
    from runtime.checkpoint import LocalPiece
    from shardlang import parse_layout

    layout = parse_layout(layout_text)
    shape = TENSORS[name][0]
    if rank not in layout.mesh.ranks:
        return LocalPiece(None, layout, shape)
    whole = attrs.evolve(layout, partial=())
    piece = shard(full_tensor(name) if value is None else value, layout, rank)  # the value at coordinate 0
    for axis, op in layout.partial:
        assert op == "sum" and layout.mesh.shape[axis] == 2
        sign = 1 if layout.mesh.coordinate(rank)[axis] == 0 else -1
        piece = piece + sign * shard(addend(name), whole, rank)
    return LocalPiece(piece, layout, shape)


def _target(name: str, layout_text: str, rank: int) -> Any:
    """A LocalPiece to load into: filled with 5, or None outside the mesh."""
    from runtime.checkpoint import LocalPiece
    from shardlang import parse_layout

    layout = parse_layout(layout_text)
    shape = TENSORS[name][0]
    if rank not in layout.mesh.ranks:
        return LocalPiece(None, layout, shape)
    return LocalPiece(torch.full([hi - lo for lo, hi in layout.rank_piece(shape, rank)], 5.0), layout, shape)


def _digest(directory: Path) -> dict[str, str]:
    """The committed checkpoint: the metadata file and the data folder it names, by content."""
    import json

    metadata = directory / "metadata.json"
    data = directory / json.loads(metadata.read_text())["data"]
    files = [metadata, *sorted(data.iterdir())]
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


@contextlib.contextmanager
def _failing(active: bool, owner: Any, name: str, calls_before: int, action: Callable[[], None]) -> Iterator[None]:
    """Make ``owner.name`` run ``action`` (raise, or exit) after ``calls_before`` normal calls."""
    original = getattr(owner, name)
    calls = [0]

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > calls_before:
            action()
        return original(*args, **kwargs)

    if active:
        setattr(owner, name, broken)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _disk_full() -> None:
    raise OSError(28, "No space left on device (injected)")


def _save_run(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    from runtime import checkpoint

    out: dict[str, Any] = {}
    for kind in KINDS:
        for config, (mesh, layouts_of, flat_axis) in SAVES.items():
            spec = _spec(mesh, layouts_of)
            params = _params(spec, rank, initial_params(torch.float32, SEED))
            optimizer = _optimizer(kind, list(params.items()), spec, flat_axis=flat_axis)
            _train(optimizer, params, spec, rank, range(SAVE_AT))
            checkpoint.save(root / f"{kind}-{config}", optimizer=optimizer, block_bytes=BLOCK)
    pieces = {name: _piece(name, saved, rank) for name, (_, saved, _) in TENSORS.items()}
    checkpoint.save(root / "tensors", pieces, block_bytes=BLOCK)
    out["atomic"] = _failed_saves(rank, root / "atomic")
    return out


def _failed_saves(rank: int, directory: Path) -> dict[str, Any]:
    """A first save, then a save whose rank 2 fails writing after its first piece, and one
    whose commit fails on rank 0 just before the metadata is replaced: both raise on every
    rank and leave the first checkpoint as it was, loadable."""
    import importlib

    from runtime import checkpoint
    from runtime.checkpoint import files

    commit = importlib.import_module("runtime.checkpoint.commit")
    first = {n: _piece(n, TENSORS[n][1], rank) for n in ("e", "acc")}
    second = {n: _piece(n, TENSORS[n][1], rank, full_tensor(n) * 2) for n in first}
    checkpoint.save(directory, first)
    before = _digest(directory)
    messages = []
    for active, owner, name in ((rank == 2, files.RankFileWriter, "write"), (rank == 0, commit, "replace_synced")):
        with _failing(active, owner, name, 1 if name == "write" else 0, _disk_full):
            try:
                checkpoint.save(directory, second)
                messages.append(None)
            except checkpoint.CheckpointError as e:
                messages.append(str(e))
    after = _digest(directory)
    leftovers = sorted(p.name for p in directory.iterdir())
    loaded = _target("e", COLUMNS_4, rank)
    checkpoint.load(directory, {"e": loaded})
    return {"messages": messages, "before": before, "after": after, "entries": leftovers, "e": loaded.tensor}


def _load_run(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    from runtime import checkpoint

    out: dict[str, Any] = {}
    for world, kind, saved, config in CASES:
        if world != world_size:
            continue
        mesh, layouts_of, flat_axis = LOADS[world][config]
        spec = _spec(mesh, layouts_of)
        params = _params(spec, rank, None)
        optimizer = _optimizer(kind, list(params.items()), spec, flat_axis=flat_axis)
        report = checkpoint.load(root / f"{kind}-{saved}", optimizer=optimizer)
        state = optimizer.state_dict()
        loaded = {n: p.detach().clone() for n, p in params.items()}
        _train(optimizer, params, spec, rank, range(SAVE_AT, STEPS))
        out[(kind, saved, config)] = {
            "report": report,
            "state": state,
            "loaded": loaded,
            "final": {n: p.detach().clone() for n, p in params.items()},
        }
    targets = {n: _target(n, TENSORS[n][2][world_size], rank) for n in TENSORS}
    checkpoint.load(root / "tensors", targets)
    out["tensors"] = {n: p.tensor for n, p in targets.items()}
    if world_size == 2:
        rows = _target("e", ROWS_2, rank)
        out["rows_report"] = checkpoint.load(root / "tensors", {"e": rows})
    return out


def _crash_run(rank: int, world_size: int, directory: Path, dies: str) -> dict[str, Any]:
    """A first save, then a second one in which a rank dies: rank 1 as it starts writing its
    pieces (``"writing"``), or rank 0 just before it moves the new metadata into place
    (``"committing"``) or just after (``"committed"``)."""
    import importlib

    from runtime import checkpoint
    from runtime.checkpoint import files

    commit = importlib.import_module("runtime.checkpoint.commit")
    layouts = {"e": ROWS_2, "r": "R,R over mesh[dp=2]"}
    checkpoint.save(directory, {n: _piece(n, text, rank) for n, text in layouts.items()}, timeout=10)
    before = _digest(directory)
    second = {n: _piece(n, text, rank, full_tensor(n) * 3) for n, text in layouts.items()}
    original = commit.replace_synced

    def die_at_the_commit(source: Path, target: Path) -> None:
        if dies == "committed":
            original(source, target)
        os._exit(1)

    if rank == 0 and dies != "writing":
        commit.replace_synced = die_at_the_commit
    started = time.monotonic()
    with _failing(rank == 1 and dies == "writing", files.RankFileWriter, "write", 0, lambda: os._exit(1)):
        try:
            checkpoint.save(directory, second, timeout=10)
            message = None
        except Exception as e:  # the test checks its type and message
            message = f"{type(e).__name__}: {e}"
    return {"message": message, "seconds": time.monotonic() - started, "before": before, "after": _digest(directory)}


# --- the runs ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def saved(root: Path) -> list[dict[str, Any]]:
    return run_ranks(_save_run, 4, (root,), timeout=120)


@pytest.fixture(scope="module")
def loaded(root: Path, saved: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    return {world: run_ranks(_load_run, world, (root,), timeout=150) for world in (2, 8)}


# --- the references ------------------------------------------------------------------------
def _reference(
    kind: str,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Parameters and states after SAVE_AT steps, and parameters after STEPS steps."""
    hyper = ADAMW if kind == "adamw" else CAME
    ref, optimizer = reference(kind, initial_params(torch.float32, SEED), hyper)
    names = {id(p): n for n, p in ref.items()}
    at_save: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    for step in range(STEPS):
        for name, (grad, _) in step_grads(torch.float32, SEED, step).items():
            ref[name].grad = grad.clone()
        optimizer.step()
        if step == SAVE_AT - 1:
            at_save = {n: p.detach().clone() for n, p in ref.items()}
            for p, state in optimizer.state.items():
                states[names[id(p)]] = {k: v.clone() for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
    return at_save, states, {n: p.detach() for n, p in ref.items()}


def _close(kind: str, got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    assert got.shape == want.shape, f"{label}: shape {list(got.shape)}, expected {list(want.shape)}"
    if kind == "adamw":
        assert torch.equal(got, want), f"{label}: differs from torch.optim.AdamW by {(got - want).abs().max()}"
    elif want.numel():
        error = ((got - want).abs().max() / want.abs().max()).item()
        assert error <= CAME_TOLERANCE[torch.float32], f"{label}: relative error {error:.3g} against came_pytorch"


def _expected_state(record: dict[str, Any], full: torch.Tensor, rank: int) -> torch.Tensor:
    """The reference state sliced by hand where the loaded optimizer says it lies: a block of
    its layout, or a flat chunk of the block of ``flat_of``."""
    from shardlang import parse_layout

    layout = parse_layout(record["layout"])
    coordinate = layout.mesh.coordinate(rank)
    if record["flat_of"] is None:
        return hand_piece(full, layout.dims, layout.mesh.shape, coordinate)
    base = parse_layout(record["flat_of"])
    block = hand_piece(full, base.dims, base.mesh.shape, coordinate).reshape(-1)
    return hand_piece(block, layout.dims, layout.mesh.shape, coordinate)


# --- the checks ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(("world", "kind", "saved_as", "config"), CASES)
def test_a_loaded_run_continues_like_an_uninterrupted_one(
    loaded: dict[int, list[dict[str, Any]]], world: int, kind: str, saved_as: str, config: str
) -> None:
    """Saved by 4 ranks after 4 steps, loaded by ``world`` ranks in other layouts: parameters
    and every state (CAME's row and column statistics, flat chunks) equal the reference's
    after step 4, and 4 more steps equal 8 uninterrupted ones."""
    at_save, states, final = _reference(kind)
    mesh, layouts_of, _ = LOADS[world][config]
    spec = _spec(mesh, layouts_of)
    for rank, result in enumerate(loaded[world]):
        case = result[(kind, saved_as, config)]
        label = f"{kind} saved as {saved_as}, loaded as {config} on rank {rank}"
        for name, layout in ((n, s.param) for n, s in spec.items()):
            coordinate = layout.mesh.coordinate(rank)
            want = hand_piece(at_save[name], layout.dims, layout.mesh.shape, coordinate)
            _close(kind, case["loaded"][name], want, f"{label}: parameter '{name}' as loaded")
            want = hand_piece(final[name], layout.dims, layout.mesh.shape, coordinate)
            _close(kind, case["final"][name], want, f"{label}: parameter '{name}' after {STEPS} steps")
        assert set(case["state"]["tensors"]) == set(SHAPES)
        for name, entry in case["state"]["tensors"].items():
            assert entry["step"] == SAVE_AT
            assert set(entry["states"]) == set(states[name]), f"{label}: '{name}' has states {set(entry['states'])}"
            for state, record in entry["states"].items():
                want = _expected_state(record, states[name][state], rank)
                _close(kind, record["tensor"], want, f"{label}: state '{state}' of '{name}'")


@pytest.mark.slow
@pytest.mark.parametrize(("world", "kind", "saved_as", "config"), CASES)
def test_a_rank_reads_exactly_the_bytes_of_its_pieces(
    loaded: dict[int, list[dict[str, Any]]], world: int, kind: str, saved_as: str, config: str
) -> None:
    """Every element is stored once, so a rank that reads only what it needs reads the bytes
    of its parameter pieces and local states, and nothing else."""
    mesh, layouts_of, _ = LOADS[world][config]
    spec = _spec(mesh, layouts_of)
    for rank, result in enumerate(loaded[world]):
        case = result[(kind, saved_as, config)]
        params = sum(math.prod(hi - lo for lo, hi in s.param.rank_piece(s.shape, rank)) for s in spec.values())
        states = sum(r["tensor"].numel() for e in case["state"]["tensors"].values() for r in e["states"].values())
        assert case["report"].data_bytes == 4 * (params + states), f"rank {rank} read {case['report'].bytes_read}"


@pytest.mark.slow
def test_a_rank_reads_only_the_files_and_rows_it_needs(loaded: dict[int, list[dict[str, Any]]]) -> None:
    """[301, 8] saved as rows over 4 ranks (76, 76, 76, 73), read as rows over 2 (151, 150):
    each rank opens the files holding its rows and reads just those rows, one run per file."""
    length, width = TENSORS["e"][0]

    def row_range(parts: int, i: int) -> tuple[int, int]:
        size = -(-length // parts)
        return min(i * size, length), min((i + 1) * size, length)

    saved_rows = [row_range(4, i) for i in range(4)]
    for rank, result in enumerate(loaded[2]):
        mine = row_range(2, rank)
        want = {}
        for i, (lo, hi) in enumerate(saved_rows):
            rows = min(hi, mine[1]) - max(lo, mine[0])
            if rows > 0:
                want[f"rank-{i:05d}.bin"] = rows * width * 4
        report = result["rows_report"]
        assert dict(report.bytes_read) == want, f"rank {rank}"
        assert report.reads == len(want)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 8])
def test_plain_tensors_load_into_other_layouts(loaded: dict[int, list[dict[str, Any]]], world: int) -> None:
    """Uneven rows, a tensor with a zero-length dim, a 0-d tensor, a replicated one (saved from
    3 of the 4 ranks, loaded into 4 of the 8 in another order), and one saved partial (each
    rank an addend): every piece equals runtime.shard of the value, partial targets included
    (the value at coordinate 0 of a sum axis, everywhere for avg)."""
    from runtime import shard
    from shardlang import parse_layout

    for rank, result in enumerate(loaded[world]):
        for name, (_, _, targets) in TENSORS.items():
            layout = parse_layout(targets[world])
            if rank not in layout.mesh.ranks:
                continue
            want = shard(full_tensor(name), layout, rank)
            assert torch.equal(result["tensors"][name], want), f"'{name}' on rank {rank} of {world}"


@pytest.mark.slow
def test_replicated_pieces_are_stored_once(root: Path, saved: list[dict[str, Any]]) -> None:
    """The rank files hold exactly one copy of every tensor: their sizes add up to the
    tensors' sizes, parameters and states of both optimizers included."""
    from runtime.checkpoint import read_metadata

    for kind in KINDS:
        for config in SAVES:
            directory = root / f"{kind}-{config}"
            metadata, _ = read_metadata(directory)
            files = sorted((directory / metadata.data).iterdir())
            stored = sum(f.stat().st_size for f in files)
            want = 0
            for shape in SHAPES.values():
                n = math.prod(shape)
                if kind == "adamw" or len(shape) == 1:
                    want += 3 * n  # parameter, exp_avg, exp_avg_sq
                else:  # parameter, exp_avg, and row and column statistics of the squares and the residual
                    rows, cols = math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]
                    want += 2 * n + 2 * rows + 2 * cols
            assert stored == 4 * want, f"{kind}-{config}: the rank files hold {stored} bytes, one copy is {4 * want}"
            assert [f.name for f in files] == [f"rank-{r:05d}.bin" for r in range(4)]
    metadata, _ = read_metadata(root / "tensors")
    assert len(metadata.tensors["r"].pieces) == 1  # R,R over 3 ranks: one holder writes it


@pytest.mark.slow
def test_a_failed_save_leaves_the_previous_checkpoint(saved: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(saved):
        case = result["atomic"]
        writing, committing = case["messages"]
        assert writing is not None and "No space left on device (injected)" in writing, writing
        assert rank == 2 or "rank 2" in writing, writing
        assert "previous checkpoint is unchanged" in writing
        assert committing is not None and "No space left on device (injected)" in committing
        assert case["after"] == case["before"], f"rank {rank}: the checkpoint changed"
        assert not [e for e in case["entries"] if e.startswith(".staging-")], case["entries"]
        assert len([e for e in case["entries"] if e.startswith("data-")]) == 1, case["entries"]
        from runtime import shard
        from shardlang import parse_layout

        want = shard(full_tensor("e"), parse_layout(COLUMNS_4), rank)
        assert torch.equal(case["e"], want)


def _load_whole(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors 'e' and 'r' of a checkpoint, read whole by this one process."""
    from runtime import checkpoint
    from runtime.checkpoint import LocalPiece
    from shardlang import parse_layout

    whole = {n: LocalPiece(torch.zeros(TENSORS[n][0]), parse_layout("R,R over mesh[1]"), TENSORS[n][0]) for n in "er"}
    checkpoint.load(directory, whole)
    return {n: p.tensor for n, p in whole.items()}


@pytest.mark.slow
def test_a_rank_that_dies_mid_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    result = run_ranks(_crash_run, 2, (tmp_path, "writing"), timeout=90, collective_timeout=20, allow_missing=(1,))[0]
    assert result["message"] is not None, "the save succeeded without rank 1"
    assert result["message"].startswith("CheckpointError: "), result["message"]
    assert "the new checkpoint was not committed; the previous checkpoint is unchanged" in result["message"]
    assert result["seconds"] < 15
    assert result["after"] == result["before"]
    for name, tensor in _load_whole(tmp_path).items():  # one process reads what two wrote
        assert torch.equal(tensor, full_tensor(name)), name


@pytest.mark.slow
@pytest.mark.parametrize("dies", ["committing", "committed"])
def test_when_rank_0_dies_at_the_commit_the_others_tell_the_outcome(tmp_path: Path, dies: str) -> None:
    """Rank 0 dies just before or just after it moves the new metadata into place: rank 1
    raises a CheckpointError saying which, and the checkpoint on disk is the one it names."""
    result = run_ranks(_crash_run, 2, (tmp_path, dies), timeout=90, collective_timeout=20, allow_missing=(0,))[1]
    message = result["message"]
    assert message is not None and message.startswith("CheckpointError: "), message
    assert result["seconds"] < 15
    loaded = _load_whole(tmp_path)
    if dies == "committing":
        assert "the new checkpoint was not committed; the previous checkpoint is unchanged" in message, message
        assert result["after"] == result["before"]
        assert all(torch.equal(loaded[n], full_tensor(n)) for n in loaded)
    else:
        assert "the new checkpoint was committed" in message and "not committed" not in message, message
        assert result["after"] != result["before"]
        assert all(torch.equal(loaded[n], full_tensor(n) * 3) for n in loaded)
