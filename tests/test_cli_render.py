"""``shardlang show`` and ``shardlang render``, run as the console script runs them
(tests/cli_support.py's run): every rank's block against torch.chunk, the wrapped grid's labels,
and the pictures' structure (SVG panels and edges, PNG signature, a 64-rank mesh, a spec's
summary and each tensor)."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from cli.mesh_grid import arrange
from shardlang import Mesh
from tests.cli_support import GOOD_SPEC, HAR, SVG, _svg, _text, no_traceback, plain_env, run


# --- show ---------------------------------------------------------------------------------
def test_show_gives_every_rank_its_torch_chunk_block() -> None:
    import torch  # the independent reference: torch.chunk

    layout = "S01,R over mesh[2,3]"
    shape = (7, 3)
    data = json.loads(run("show", layout, "--shape", "7x3", "--format", "json").stdout)
    full = torch.arange(21).reshape(shape)
    assert data["local_shape"] == [2, 3]
    assert [r["rank"] for r in data["ranks"]] == list(range(6))
    for r in data["ranks"]:
        c0, c1 = r["coordinate"]
        outer = full.chunk(2, dim=0)
        inner = outer[c0].chunk(3, dim=0) if c0 < len(outer) else ()
        want = inner[c1] if c1 < len(inner) else full[:0]
        (r0, r1), (s0, s1) = r["bounds"]
        got = full[r0:r1, s0:s1]
        assert torch.equal(got, want) or (got.numel() == want.numel() == 0), r
        assert r["empty"] == (want.numel() == 0)
        assert r["padded"] == (want.numel() > 0 and want.shape[0] < 2)
    assert sum(r["empty"] for r in data["ranks"]) == 1  # 7 -> 4, 3; 4 -> 2, 2, 0

    text = run("show", layout, "--shape", "7x3").stdout
    for rank in range(6):
        assert f"rank {rank}" in text
    assert "axis 0=1" in text and "axis 1=2" in text
    assert "[6:7, :]" in text and "empty" in text and "padded" in text


@pytest.mark.parametrize("size", [17, 21, 31, 64, 97])
def test_wrapped_grid_rows_are_labelled_with_the_ranks_they_hold(size: int) -> None:
    # A one-axis mesh too wide for one row is wrapped; each row label names its first and last
    # coordinate, also in a short last row.
    grid = arrange(Mesh(shape=(size,)))
    held = []
    for label, row in zip(grid.row_labels, grid.cells, strict=True):
        coordinates = [c[0] for c in row if c is not None]
        first, _, last = label.removeprefix("axis 0=").partition("..")
        assert (int(first), int(last or first)) == (coordinates[0], coordinates[-1]), label
        held += coordinates
    assert held == list(range(size))


def _groups(root: ET.Element, cls: str) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if g.get("class", "").split()[:1] == [cls]]


def test_render_svg_has_a_panel_per_state_and_a_labelled_edge_per_step(tmp_path: Path) -> None:
    out = tmp_path / "har.svg"
    result = run("render", *HAR, "-o", str(out))
    assert result.returncode == 0, result.stderr
    root = _svg(out)
    panels = _groups(root, "node")
    edges = _groups(root, "edge")
    assert len(panels) == 4 and len(edges) == 3
    assert [p.get("id") for p in panels] == [f"panel-state{i}" for i in range(4)]
    for panel, layout in zip(
        panels,
        ["R | P01 over mesh[2,8]", "S1 | P0 over mesh[2,8]", "S1 over mesh[2,8]", "R over mesh[2,8]"],
        strict=True,
    ):
        text = _text(panel)
        assert layout in text
        assert all(f"r{rank}" in text.split() for rank in range(16))
    for edge, (op, axis, nbytes) in zip(
        edges,
        [
            ("reduce_scatter", "axis 1", "3.5 MiB"),
            ("all_reduce", "axis 0", "512 KiB"),
            ("all_gather", "axis 1", "3.5 MiB"),
        ],
        strict=True,
    ):
        text = _text(edge)
        assert op in text and axis in text and f"{nbytes} per rank" in text and re.search(r"\d us", text)


def test_render_png_and_dot_without_the_dot_program(tmp_path: Path) -> None:
    png = tmp_path / "plan.png"
    assert run("render", *HAR, "-o", str(png)).returncode == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    env = plain_env()
    env["PATH"] = str(tmp_path / "empty")  # no dot anywhere
    missing = run("render", *HAR, "--format", "svg", "-o", str(tmp_path / "x.svg"), env=env)
    no_traceback(missing)
    assert missing.returncode == 1
    assert "apt-get install graphviz" in missing.stderr and "--format dot" in missing.stderr
    assert not (tmp_path / "x.svg").exists()
    dot = run("render", *HAR, "--format", "dot", env=env)
    assert dot.returncode == 0, dot.stderr
    assert dot.stdout.startswith('digraph "plan" {')
    assert dot.stdout.count(" -> ") == 3


def test_a_64_rank_mesh_renders_with_every_cell(tmp_path: Path) -> None:
    out = tmp_path / "big.svg"
    mesh = "mesh[dp=8,tp=8]"
    result = run(
        "render",
        f"S(dp,tp),R | P() over {mesh}".replace(" | P()", ""),
        f"R,S(tp,dp) over {mesh}",
        "--shape",
        "1000x300",
        "-o",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    root = _svg(out)
    panels = _groups(root, "node")
    edges = _groups(root, "edge")
    assert len(panels) == len(edges) + 1 >= 2
    for panel in panels:
        words = _text(panel).split()
        assert sorted(w for w in words if re.fullmatch(r"r\d+", w)) == sorted(f"r{i}" for i in range(64))
        for label in ("dp=0", "dp=7", "tp=0", "tp=7"):
            assert label in _text(panel)
    # Legible: no text smaller than 8 points, and an 8x8 grid keeps the picture under ~30 inches wide.
    sizes = [float(t.get("font-size", "14")) for t in root.iter(f"{SVG}text")]
    assert min(sizes) >= 8
    assert float(root.get("width", "0pt").removesuffix("pt")) < 30 * 72


def test_render_a_spec_tensor_the_summary_and_each_tensor(tmp_path: Path) -> None:
    spec = tmp_path / "model.shard"
    spec.write_text(GOOD_SPEC)
    emb = tmp_path / "emb.svg"
    assert run("render", str(spec), "--tensor", "emb", "-o", str(emb)).returncode == 0
    root = _svg(emb)
    # grad -> state (1 step), param -> state (a slice: f32, no master) and state -> param
    # (1 step): three states, three edges.
    assert [p.get("id") for p in _groups(root, "node")] == ["panel-grad", "panel-state", "panel-param"]
    assert sorted(e.get("id") for e in _groups(root, "edge")) == ["step-1", "step-2", "step-3"]

    summary = tmp_path / "summary.svg"
    assert run("render", str(spec), "-o", str(summary)).returncode == 0
    text = _text(_svg(summary))
    for label in ("emb", "h.{0..2}.w", "bias", "total"):
        assert label in text
    # Largest first: h.{0..2}.w is three tensors of two 5-us collectives each (>= 30 us), emb
    # two collectives of 5 us + 912 B / 25 GB/s (10.1 us), bias nothing.
    assert text.index("h.{0..2}.w") < text.index("emb ") < text.index("bias")
    # Below it, the buckets: one row per collective, in the order the ranks run them.
    buckets = _text(next(g for g in _groups(_svg(summary), "node") if g.get("id") == "buckets"))
    assert buckets.count("reduce_scatter(axis=dp") == 2 and buckets.count("all_gather(axis=dp)") == 2
    assert "3: h.{0..2}.w" in buckets and "4 collectives" in buckets

    each = tmp_path / "each"
    result = run("render", str(spec), "--each", "-o", str(each), "--format", "dot")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in each.iterdir()) == ["bias.dot", "emb.dot", "h.0.w.dot"]
    assert result.stdout == ""
