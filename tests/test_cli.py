"""The ``shardlang`` command, run through ``cli.main.main`` as the console script runs it (and
the installed script itself where a process matters: its exit code, a terminal): exit codes,
the error format (line and column), JSON validity and schema, the main job, colors and progress
only on a terminal. Its pictures are in test_cli_render.py.

Expected numbers come from the cost model's formulas worked by hand, or from torch.chunk.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pty
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from cli.inputs import bandwidth_arg, bytes_arg, duration_arg
from shardlang import parse_layout
from tests.cli_support import GOOD_SPEC, HAR, SCRIPT, _svg, no_traceback, plain_env, run, run_script
from tests.conftest import EXAMPLES

PAIR_KEYS = {"src", "dst", "shape", "dtype", "steps", "total_bytes", "total_seconds", "lower_bound_bytes"}
STEP_KEYS = {"op", "axis", "dim", "to_dim", "reduce_op", "layout", "bytes", "seconds"}


# --- check --------------------------------------------------------------------------------
# Each bad file: its text, and where the error may point: (line, the offending item on that
# line); the column must fall inside the item.
BAD_SPECS = {
    "axis_twice.shard": (
        "mesh world = [dp=2, tp=2]\ntensor w : f32[4, 4] {\n  param = S(tp),S(tp) over world\n}\n",
        [(3, "S(tp) over")],
    ),
    "syntax.shard": ("tensor w : f32[4, 4] {\n  param = S0,R ovr mesh[2,2]\n}\n", [(2, "ovr")]),
    "unknown_mesh.shard": ("tensor w : f32[4] {\n  param = S0 over wrld\n}\n", [(2, "wrld")]),
    "rank_mismatch.shard": ("tensor w : f32[4, 4] {\n\n  param = S0 over mesh[2]\n}\n", [(3, "S0 over mesh[2]")]),
    "axis_range.shard": ("tensor w : f32[4, 4] {\n  param = S0,S3 over mesh[2,2]\n}\n", [(2, "S3")]),
    "duplicate.shard": (
        "tensor w : f32[4] { param = S0 over mesh[2] }\n# comment\ntensor w : f32[4] { param = R over mesh[2] }\n",
        [(3, "tensor w")],
    ),
    "mesh_size.shard": ("mesh m = [2, 2] ranks 0..2\ntensor w : f32[4] { param = R over m }\n", [(1, "ranks 0..2")]),
    # The gradient lies on another mesh than the state: no plan exists. The language may say so
    # at the grad layout, or the planner at the tensor.
    "no_plan.shard": (
        "tensor w : f32[4] {\n  param = R over mesh[2]\n  grad = R | P0 over mesh[4]\n}\n",
        [(1, "tensor w"), (3, "R | P0 over mesh[4]")],
    ),
}


@pytest.fixture()
def spec_dir(tmp_path: Path) -> Path:
    for name, (text, _) in BAD_SPECS.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "good.shard").write_text(GOOD_SPEC)
    return tmp_path


def _points_at_the_error(name: str, line: int, column: int) -> bool:
    """Whether 1-based (line, column) falls inside one of the offending items of ``name``."""
    text, places = BAD_SPECS[name]
    for want_line, item in places:
        start = text.split("\n")[want_line - 1].index(item) + 1
        if line == want_line and start <= column < start + len(item):
            return True
    return False


def test_check_names_file_line_and_column_of_every_error(spec_dir: Path) -> None:
    files = [str(spec_dir / n) for n in BAD_SPECS] + [str(spec_dir / "good.shard")]
    result = run("check", *files)
    no_traceback(result)
    assert result.returncode == 1
    assert re.search(r"good\.shard: ok: 5 tensors, 1 rule", result.stdout)
    lines = result.stderr.splitlines()
    reported = {}
    for i, line in enumerate(lines):
        m = re.match(r"(.+\.shard):(\d+):(\d+): (.+)$", line)
        if m:
            reported[Path(m.group(1)).name] = (int(m.group(2)), int(m.group(3)), m.group(4), lines[i + 1], lines[i + 2])
    assert set(reported) == set(BAD_SPECS)
    for name, (line, column, message, shown, caret) in reported.items():
        assert _points_at_the_error(name, line, column), (name, line, column, message)
        # The line is shown as written (indented), the caret under the column.
        line_text = BAD_SPECS[name][0].split("\n")[line - 1]
        assert shown.endswith(line_text)
        indent = len(shown) - len(line_text)
        assert caret.rstrip() == " " * (indent + column - 1) + "^"
    assert "twice" in reported["axis_twice.shard"][2]
    assert "wrld" in reported["unknown_mesh.shard"][2]
    assert "declared twice" in reported["duplicate.shard"][2]


def test_check_json_and_exit_codes(spec_dir: Path) -> None:
    result = run(
        "check",
        "--format",
        "json",
        str(spec_dir / "syntax.shard"),
        str(spec_dir / "good.shard"),
        str(spec_dir / "missing.shard"),
    )
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert data["ok"] is False
    by_name = {Path(f["file"]).name: f for f in data["files"]}
    assert by_name["good.shard"] == {
        "file": str(spec_dir / "good.shard"),
        "ok": True,
        "tensors": 5,
        "rules": 1,
        "errors": [],
        "warnings": [],
    }
    (syntax,) = by_name["syntax.shard"]["errors"]
    assert set(syntax) >= {"file", "line", "column", "message", "kind"}
    assert _points_at_the_error("syntax.shard", syntax["line"], syntax["column"])
    (missing,) = by_name["missing.shard"]["errors"]
    assert missing["file"] == str(spec_dir / "missing.shard") and missing["line"] is None

    ok = run("check", str(spec_dir / "good.shard"), *(str(p) for p in sorted(EXAMPLES.glob("*.shard"))))
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr == ""


# --- plan ---------------------------------------------------------------------------------
def _step_seconds(rounds: int, nbytes: int, alpha: float, beta: float) -> float:
    return rounds * alpha + nbytes / beta


def test_plan_pair_json_is_the_issue_schema_with_hand_computed_costs() -> None:
    result = run("plan", *HAR, "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) == PAIR_KEYS
    assert (data["src"], data["dst"], data["shape"], data["dtype"]) == (HAR[0], HAR[1], [1048576], "f32")
    for step in data["steps"]:
        assert set(step) == STEP_KEYS
        assert str(parse_layout(step["layout"])) == step["layout"]  # canonical text
    # Hierarchical all-reduce, by the cost table: n1 = 8 (300 GB/s), n0 = 2 (25 GB/s).
    quarter = 1048576 // 8 * 4  # bytes of one 1/8 piece
    expected = [
        ("reduce_scatter", 1, 0, None, "sum", "S1 | P0 over mesh[2,8]", 7 * quarter, 7, 300e9),
        ("all_reduce", 0, None, None, "sum", "S1 over mesh[2,8]", 2 * 1 * (quarter // 2), 2, 25e9),
        ("all_gather", 1, 0, None, None, "R over mesh[2,8]", 7 * quarter, 7, 300e9),
    ]
    assert len(data["steps"]) == len(expected)
    for step, (op, axis, dim, to_dim, reduce_op, layout, nbytes, rounds, beta) in zip(
        data["steps"], expected, strict=True
    ):
        assert (step["op"], step["axis"], step["dim"], step["to_dim"], step["reduce_op"], step["layout"]) == (
            op,
            axis,
            dim,
            to_dim,
            reduce_op,
            layout,
        )
        assert step["bytes"] == nbytes
        assert math.isclose(step["seconds"], _step_seconds(rounds, nbytes, 5e-6, beta), rel_tol=1e-12)
    assert data["total_bytes"] == sum(e[6] for e in expected)
    assert math.isclose(data["total_seconds"], sum(s["seconds"] for s in data["steps"]), rel_tol=1e-12)


def test_plan_pair_text_is_an_aligned_table() -> None:
    result = run(
        "plan",
        "R,S1 | P0 over mesh[2,2]",
        "S0,S1 over mesh[2,2]",
        "--shape",
        "32000x1024",
        "--alpha",
        "5us",
        "--bandwidth",
        "1e11",
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    table = [line for line in out[2:] if line.strip()]
    header, step, total = table
    assert header.split()[:3] == ["#", "op", "axis"]
    assert step.split()[:3] == ["1", "reduce_scatter", "0"]
    # Right-aligned last columns: every line of the table ends at the same column.
    assert len(header) == len(step) == len(total)
    # The Paddle seed's reduce-scatter: (2-1) * 16000*512*4 bytes = 31.25 MiB.
    assert "31.2 MiB" in step and "31.2 MiB" in total
    assert "\x1b[" not in result.stdout  # no colors into a pipe


def test_plan_spec_json_text_and_a_rule_matched_tensor(tmp_path: Path) -> None:
    spec = tmp_path / "model.shard"
    spec.write_text(GOOD_SPEC)
    data = json.loads(run("plan", str(spec), "--format", "json").stdout)
    assert [t["name"] for t in data["tensors"]] == ["emb", "h.0.w", "h.1.w", "h.2.w", "bias"]
    for t in data["tensors"]:
        # f32 tensors have no fp32 master: the step fetches the parameter's state-layout shard.
        fetch = ["param -> state"] if t["dtype"] == "f32" else []
        assert [leg["leg"] for leg in t["legs"]] == ["grad -> state", *fetch, "state -> param"]
        for leg in t["legs"]:
            assert set(leg) == PAIR_KEYS | {"leg"}
        assert t["total_bytes"] == sum(leg["total_bytes"] for leg in t["legs"])
    assert data["total_bytes"] == sum(t["total_bytes"] for t in data["tensors"])
    emb = data["tensors"][0]
    # grad R,S(tp) | P(dp) -> state S(dp),S(tp): one reduce-scatter over dp of the [19, 12] f32
    # piece: (2-1) * 19*12*4 bytes; param -> state: a local slice over dp; state -> param: one
    # all-gather of the same piece.
    assert [(s["op"], s["axis"], s["bytes"]) for leg in emb["legs"] for s in leg["steps"]] == [
        ("reduce_scatter", 0, 19 * 12 * 4),
        ("slice", 0, 0),
        ("all_gather", 0, 19 * 12 * 4),
    ]
    assert math.isclose(emb["legs"][0]["steps"][0]["seconds"], 5e-6 + 912 / 25e9, rel_tol=1e-12)
    assert data["tensors"][4]["total_bytes"] == 0  # bias: replicated everywhere
    # The step plan: the three bf16 h.*.w share one reduce-scatter and one all-gather, emb
    # (another wire dtype and reduce op) has its own: 4 collectives instead of 8, and the
    # bucketed time is the step's total.
    step = data["step"]
    assert [(b["stage"], b["op"], b["dtype"], len(b["members"])) for b in step["buckets"]] == [
        ("before the update", "reduce_scatter", "bf16", 3),
        ("before the update", "reduce_scatter", "f32", 1),
        ("after the update", "all_gather", "bf16", 3),
        ("after the update", "all_gather", "f32", 1),
    ]
    assert (step["collectives"], step["unbucketed_collectives"]) == (4, 8)
    assert math.isclose(data["total_seconds"], step["total_seconds"], rel_tol=1e-12)
    # Merging three 5-us collectives saves two latencies per stage.
    assert math.isclose(step["unbucketed_seconds"] - step["total_seconds"], 4 * 5e-6, rel_tol=1e-9)

    text = run("plan", str(spec)).stdout
    assert re.search(r"^\s+h\.\{0\.\.2\}\.w\s+3\s+5x3\s+bf16", text, re.M)  # one row for the three
    assert re.search(r"^\s+total\s+5\s", text, re.M)
    assert re.search(
        r"^\s+1\s+before\s+reduce_scatter\(axis=dp, op=avg\) bf16\s+world\s+3\s+h\.\{0\.\.2\}\.w\s", text, re.M
    )
    assert "4 collectives (8 unbucketed" in text

    ruled = run("plan", str(spec), "--tensor", "h.7.b", "--shape", "6", "--format", "json")
    assert ruled.returncode == 0, ruled.stderr
    (t,) = json.loads(ruled.stdout)["tensors"]
    assert (t["name"], t["shape"], t["dtype"]) == ("h.7.b", [6], "f32")
    assert [s["op"] for leg in t["legs"] for s in leg["steps"]] == ["reduce_scatter", "slice", "all_gather"]
    unknown = run("plan", str(spec), "--tensor", "nope")
    assert unknown.returncode == 1 and "no tensor named 'nope'" in unknown.stderr


def test_bad_arguments_give_one_message_and_an_exit_code(tmp_path: Path) -> None:
    cases = [
        (["plan", "S0 over mesh[2]", "R over mesh[2]"], 2, "--shape"),
        (["plan", "S0 over mesh[2", "R over mesh[2]", "--shape", "4"], 1, "SRC:1:"),
        (
            ["plan", "S0 over mesh[2,2]", "S0 over mesh[4] ranks 4..7", "--shape", "8", "--bandwidth", "1,2"],
            1,
            "2 values",
        ),
        (["plan", "S0 over mesh[2]", "R over mesh[2]", "--shape", "4x4"], 1, "2 dims"),
        (["plan", "S0 over mesh[2]", "R over mesh[2]", "--shape", "four"], 2, "not a shape"),
        (["plan", "S0 over mesh[2]", "R over mesh[2]", "--shape", "4", "--bandwidth", "1,2"], 1, "2 values"),
        (["plan", "S0 over mesh[2]", "R over mesh[2]", "--shape", "4", "--bandwidth", "-1"], 2, "positive"),
        (["plan", "S0 over mesh[2]", "R over mesh[2]", "--shape", "4", "--alpha", "1e999999999us"], 2, "too large"),
        (
            ["plan", "S0 over mesh[2]", "R over mesh[2]", "--shape", "4", "--max-local-bytes", "1e999999999GiB"],
            2,
            "too large a byte count",
        ),
        (
            ["plan", "S0 over mesh[2]", "R over mesh[2]", "--shape", "100", "--max-local-bytes", "100"],
            1,
            "max_local_bytes",
        ),
        (["plan", "S0 over mesh[2]"], 2, "looks like a layout"),
        (["plan", str(tmp_path / "none.shard")], 1, "cannot read"),
        (["show", "S0,S0 over mesh[2,2]", "--shape", "4x4"], 1, "LAYOUT:1:"),
        (
            [
                "render",
                "S0 over mesh[2]",
                "R over mesh[2]",
                "--shape",
                "4",
                "-o",
                str(tmp_path / "f" / "x.svg"),
                "--each",
            ],
            2,
            "--each",
        ),
        (["explain", "S0 over mesh[2]", "R over mesh[2]"], 2, "--shape"),
        (["nonsense"], 2, "unknown command"),
    ]
    for args, code, words in cases:
        result = run(*args)
        no_traceback(result)
        assert result.returncode == code, (args, result.stderr)
        assert words in result.stderr, (args, result.stderr)
        assert result.stdout == "", args


@pytest.mark.parametrize(
    ("read", "text", "value"),
    [
        (duration_arg, "5us", 5e-6),
        (duration_arg, " 2.5 ms ", 2.5e-3),
        (duration_arg, "7e-9", 7e-9),
        (duration_arg, ".5ns", 0.5e-9),
        (duration_arg, "0", 0.0),
        (bytes_arg, "64MiB", 64 * 2**20),
        (bytes_arg, "2GB", 2 * 10**9),
        (bytes_arg, "1e3", 1000),
        (bytes_arg, str(2**63 - 1), 2**63 - 1),
        (bandwidth_arg, "25e9,300e9", (25e9, 300e9)),
        (bandwidth_arg, "1e11", 1e11),
    ],
)
def test_option_values_read_as_written(read: Callable[[str], object], text: str, value: object) -> None:
    assert read(text) == value


@pytest.mark.parametrize(
    ("read", "text", "words"),
    [
        (duration_arg, "5xs", "is not a duration"),
        (duration_arg, "nan", "is not a duration"),
        (duration_arg, "-5us", "is negative"),
        (duration_arg, "1e999999999us", "too large"),  # beyond decimal's exponent range
        (duration_arg, "1e400", "too large"),  # beyond a float
        (bytes_arg, "1e999999999GiB", "too large"),
        (bytes_arg, str(2**63), "too large"),
        (bytes_arg, "1.5", "not a whole number"),
        (bytes_arg, "64 parsecs", "not a byte count"),
        (bandwidth_arg, "1e999999999", "positive and below infinity"),
        (bandwidth_arg, "1e9,0", "positive"),
        (bandwidth_arg, "inf", "not a finite number"),
    ],
)
def test_bad_option_values_are_usage_errors(read: Callable[[str], object], text: str, words: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        read(text)


# --- explain ------------------------------------------------------------------------------
def test_explain_shows_what_the_greedy_order_costs() -> None:
    src, dst = "R,R,R | P0 over mesh[2,8]", "R,S1,R over mesh[2,8]"
    result = run("explain", src, dst, "--shape", "16x16x16", "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data["chosen"]) == PAIR_KEYS
    greedy = data["greedy"]
    # DTensor's order: all-reduce the whole tensor over axis 0, then slice over axis 1.
    assert [(s["op"], s["axis"]) for s in greedy["steps"]] == [("all_reduce", 0), ("slice", 1)]
    elements = 16**3
    assert greedy["steps"][0]["bytes"] == 2 * 1 * math.ceil(elements / 2) * 4
    # The exact plan slices first and all-reduces an eighth of it.
    assert [(s["op"], s["axis"]) for s in data["chosen"]["steps"]] == [("slice", 1), ("all_reduce", 0)]
    assert data["chosen"]["total_bytes"] == 2 * 1 * math.ceil(elements / 16) * 4
    assert math.isclose(data["saved_seconds"], greedy["total_seconds"] - data["chosen"]["total_seconds"])
    assert data["saved_seconds"] > 0

    text = run("explain", src, dst, "--shape", "16x16x16").stdout
    assert "greedy baseline" in text and "saved" in text

    nested = json.loads(
        run("explain", "S10 over mesh[2,2]", "R over mesh[2,2]", "--shape", "8", "--format", "json").stdout
    )
    assert nested["greedy"] is None and "order" in nested["greedy_unavailable"]


# --- the main job, terminals and pipes ----------------------------------------------------
def test_the_main_job_on_the_bundled_example(tmp_path: Path) -> None:
    result = run(cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "check: ok" in out and "gpt2_small_dp2_tp2.shard" in out
    assert re.search(r"^\s+total\s+\d+\s", out, re.M)
    assert re.search(r"^buckets: \d+ collectives \(\d+ unbucketed.*modeled", out, re.M)
    assert "suggest: within this spec's own 732 MiB per rank (AdamW), no other layouts are 0.1% faster" in out
    picture = tmp_path / "out" / "gpt2_small_dp2_tp2.summary.svg"
    assert f"summary picture: {picture.relative_to(tmp_path)}" in out
    _svg(picture)  # parses
    assert "\x1b[" not in out and result.stderr == ""  # piped: no colors, no progress


def _run_on_terminal(*args: str, env: dict[str, str]) -> str:
    """Output of the script with a pseudo-terminal as stdout and stderr."""
    primary, secondary = pty.openpty()
    with subprocess.Popen([str(SCRIPT), *args], stdout=secondary, stderr=secondary, env=env) as proc:
        os.close(secondary)
        chunks = []
        while True:
            try:
                data = os.read(primary, 65536)
            except OSError:  # the terminal closes when the process ends
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=60) == 0
    os.close(primary)
    return b"".join(chunks).decode()


def test_colors_only_on_a_terminal_and_never_with_no_color(tmp_path: Path) -> None:
    spec = tmp_path / "model.shard"
    spec.write_text(GOOD_SPEC)
    colored = _run_on_terminal("plan", str(spec), env=plain_env())
    assert "\x1b[1m" in colored  # bold headings
    assert "planning 5/5" in colored  # progress, rewritten in place
    env = plain_env()
    env["NO_COLOR"] = "1"
    plain = _run_on_terminal("plan", str(spec), env=env)
    assert "\x1b[" not in plain.replace("\x1b[K", "")  # only progress clearing its line
    # The same text either way, colors aside.
    assert re.sub(r"\x1b\[[0-9;]*m", "", colored) == plain


def test_the_installed_script() -> None:
    """What run() stands for: the console script's exit code and output, in its own process."""
    for args in (["plan", "S0 over mesh[2]", "R over mesh[2]", "--shape", "4"], ["nonsense"]):
        script, here = run_script(*args), run(*args)
        assert (script.returncode, script.stdout, script.stderr) == (here.returncode, here.stdout, here.stderr)
    assert script.returncode == 2 and "unknown command" in script.stderr


def test_python_dash_m_cli() -> None:
    result = subprocess.run([sys.executable, "-m", "cli", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for command in ("check", "plan", "show", "render", "explain"):
        assert command in result.stdout
