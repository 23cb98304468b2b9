"""The ``shardlang`` command on cross-mesh pairs and point-to-point plans, run as the console
script runs it (tests/cli_support.py's run): the receive lower bound in text and JSON, the messages,
``--p2p``, explain, and pictures that show both meshes and the messages (a 64-rank grid included).

Expected numbers come from element sets cut by torch.chunk (the references of
``tests/test_planner_p2p.py``), not from the planner.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from shardlang import parse_layout
from tests.cli_support import SVG, _svg, _text, no_traceback, run
from tests.test_planner_p2p import flat_piece, lower_bound_by_hand

SWAP = ["S0,S1 over mesh[2,2]", "S1,S0 over mesh[2,2]"]
CROSS = ["S0,S1 over mesh[2,2]", "S0,R over mesh[4] ranks 4..7"]


def lower_bound(src: str, dst: str, shape: tuple[int, ...], itemsize: int = 4) -> int:
    return lower_bound_by_hand(parse_layout(src), parse_layout(dst), shape, itemsize)


def test_plan_of_a_cross_mesh_pair_shows_the_bound_and_the_messages() -> None:
    result = run("plan", *CROSS, "--shape", "37x24")
    no_traceback(result)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert f"receive lower bound: {lower_bound(*CROSS, (37, 24))} B per rank" in text
    assert "point_to_point" in text and "S0,R over mesh[4] ranks 4..7" in text
    # Target rank 4 holds rows 0..9, which source ranks 0 (columns 0..11) and 1 (12..23) hold.
    assert "r0 -> r4  480 B" in text and "r1 -> r4  480 B" in text
    assert "between the meshes" in text or "both meshes" in text


def test_json_gives_the_bound_and_every_transfer_covering_each_target_piece() -> None:
    shape = (13, 5)
    result = run("plan", *CROSS, "--shape", "13x5", "--dtype", "bf16", "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["lower_bound_bytes"] == lower_bound(*CROSS, shape, 2)
    (step,) = data["steps"]
    assert step["op"] == "point_to_point" and step["axis"] is None
    dst = parse_layout(CROSS[1])
    x = torch.arange(math.prod(shape)).reshape(shape)
    for rank in dst.mesh.ranks:
        got = [
            set(x[tuple(slice(lo, hi) for lo, hi in t["box"])].flatten().tolist())
            for t in step["transfers"]
            if t["dst"] == rank
        ]
        need = flat_piece(dst, shape, rank)
        assert sum(map(len, got)) == len(need) and set().union(*got) == need


def test_the_p2p_flag_turns_on_point_to_point_for_one_mesh() -> None:
    baseline = run("plan", *SWAP, "--shape", "4096x4096")
    extended = run("plan", *SWAP, "--shape", "4096x4096", "--p2p")
    assert baseline.returncode == extended.returncode == 0
    assert "point_to_point" not in baseline.stdout and "all_gather" in baseline.stdout
    # Ranks (0,1) and (1,0) swap a quarter of the tensor each: 16 MiB; (0,0) and (1,1) keep theirs.
    assert "r1 -> r2  16 MiB" in extended.stdout and "r2 -> r1  16 MiB" in extended.stdout
    assert "2 local copies" in extended.stdout
    # The bound scales with the tensor: a quarter of it, counted on 64x64 here.
    assert lower_bound(*SWAP, (64, 64)) * (4096 // 64) ** 2 == 16 << 20
    for result in (baseline, extended):
        assert "receive lower bound: 16 MiB per rank" in result.stdout


def test_explain_across_meshes_has_no_greedy_baseline() -> None:
    text = run("explain", *CROSS, "--shape", "37x24")
    assert text.returncode == 0, text.stderr
    assert "different meshes" in text.stdout and "point_to_point" in text.stdout
    data = json.loads(run("explain", *CROSS, "--shape", "37x24", "--format", "json").stdout)
    assert data["greedy"] is None and "different meshes" in data["greedy_unavailable"]
    assert data["chosen"]["lower_bound_bytes"] == lower_bound(*CROSS, (37, 24))


def _node(root: ET.Element, node_id: str) -> ET.Element:
    return next(g for g in root.iter(f"{SVG}g") if g.get("id") == node_id)


def test_render_shows_both_meshes_and_the_messages(tmp_path: Path) -> None:
    out = tmp_path / "cross.svg"
    result = run("render", *CROSS, "--shape", "37x24", "-o", str(out))
    assert result.returncode == 0, result.stderr
    root = _svg(out)
    source, target = _text(_node(root, "panel-state0")), _text(_node(root, "panel-state1"))
    assert "mesh[2,2]" in source and all(f"r{r}" in source.split() for r in range(4))
    assert "ranks 4..7" in target and all(f"r{r}" in target.split() for r in range(4, 8))
    messages = _text(_node(root, "messages-1"))
    assert "10 messages between 10 rank pairs" in messages and "r0 → r4" in messages
    assert f"receive lower bound: {lower_bound(*CROSS, (37, 24))} B" in _text(root)


def test_render_of_64_ranks_draws_a_grid_of_rank_pairs(tmp_path: Path) -> None:
    pair = ["S0,R over mesh[8,8]", "S1,R over mesh[8,8]"]
    svg, png = tmp_path / "perm.svg", tmp_path / "perm.png"
    assert run("render", *pair, "--shape", "256x16", "--p2p", "-o", str(svg)).returncode == 0
    messages = _text(_node(_svg(svg), "messages-1"))
    # Rank (i, j) needs row block j from a rank of row i = j: 56 ranks (i != j) receive one message.
    assert "56 messages between 56 rank pairs, 8 local copies" in messages
    assert "rows send, columns receive" in messages
    result = run("render", *pair, "--shape", "256x16", "--p2p", "-o", str(png))
    no_traceback(result)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_spec_plans_take_the_flag_and_report_bounds(tmp_path: Path) -> None:
    spec = tmp_path / "swap.shard"
    spec.write_text(
        "mesh world = [a=2, b=2]\n"
        "tensor w : f32[4096, 4096] {\n"
        "  param = S(a),S(b) over world\n  grad = S(a),S(b) over world\n  state = S(b),S(a) over world\n}\n"
    )
    data = json.loads(run("plan", str(spec), "--p2p", "--format", "json").stdout)
    legs = data["tensors"][0]["legs"]
    # grad -> state, param -> state (f32: no master, the step fetches the state-layout shard)
    # and state -> param: each one point-to-point swap.
    assert [leg["leg"] for leg in legs] == ["grad -> state", "param -> state", "state -> param"]
    assert [s["op"] for leg in legs for s in leg["steps"]] == ["point_to_point"] * 3
    assert all(leg["lower_bound_bytes"] == 16 << 20 for leg in legs)
    plain = json.loads(run("plan", str(spec), "--format", "json").stdout)
    assert "point_to_point" not in {s["op"] for leg in plain["tensors"][0]["legs"] for s in leg["steps"]}


def test_a_cost_model_that_fits_one_mesh_only_is_an_error() -> None:
    result = run("plan", *CROSS, "--shape", "8x8", "--bandwidth", "1e9,2e9")
    no_traceback(result)
    assert result.returncode == 1 and "2 values for the 1-axis mesh[4]" in result.stderr
