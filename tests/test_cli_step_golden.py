"""Golden bucket tables of ``shardlang plan FILE.shard`` (tests/golden/cli_step/): each
``*.buckets.txt`` starts with a ``# RUN:`` line (the command, run in that folder), then comment
lines with the numbers worked by hand, then the exact bucket section the command prints, with
NO_COLOR and a fixed terminal width.

Beside the text, the step plan in JSON is checked against the same hand-worked numbers, so a
golden file copied from a wrong output would fail here too; and the README's `shardlang plan`
example must be what the command prints.
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest

from tests.cli_support import no_traceback, plain_env, run
from tests.conftest import REPO

GOLDEN = Path(__file__).parent / "golden" / "cli_step"
CASES = sorted(GOLDEN.glob("*.buckets.txt"))
README = REPO / "docs" / "reference" / "step-plans.md"  # where the README's example moved
README_COMMAND = "shardlang plan examples/paddle_embedding_2x2.shard --tensor embedding_0.w_0"


def _env() -> dict[str, str]:
    env = plain_env()
    env["NO_COLOR"] = "1"
    env["COLUMNS"] = "100"
    return env


def read_golden(path: Path) -> tuple[list[str], str]:
    """The command's arguments (after ``shardlang``) and the expected text."""
    lines = path.read_text().splitlines()
    command = lines[0].removeprefix("# RUN: ")
    assert command != lines[0] and command.startswith("shardlang "), f"{path.name}: the first line is '# RUN: ...'"
    expected = [line for line in lines[1:] if not line.startswith("#")]
    return shlex.split(command)[1:], "\n".join(expected) + "\n"


def bucket_section(stdout: str) -> str:
    """From the ``buckets`` heading to the end."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("buckets"))
    return "\n".join(lines[start:]) + "\n"


@pytest.mark.parametrize("path", CASES, ids=[p.name.removesuffix(".buckets.txt") for p in CASES])
def test_bucket_table_is_the_golden_text(path: Path) -> None:
    args, expected = read_golden(path)
    result = run(*args, cwd=GOLDEN, env=_env())
    no_traceback(result)
    assert result.returncode == 0, result.stderr
    assert bucket_section(result.stdout) == expected


def test_there_are_golden_cases() -> None:
    assert {p.name for p in CASES} >= {"zero2.buckets.txt", "zero2.flat_dp.buckets.txt"}


def _step(*options: str) -> dict:
    result = run("plan", "zero2.shard", "--format", "json", *options, cwd=GOLDEN, env=_env())
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["step"]


def _buckets(step: dict) -> list[tuple[str, str, list[str], int, int]]:
    """Per bucket: stage (first word), op, its tensors in buffer order, bytes, buffer bytes."""
    names = [leg["tensor"] for leg in step["legs"]]
    return [
        (b["stage"].split()[0], b["op"], [names[m["leg"]] for m in b["members"]], b["bytes"], b["buffer_bytes"])
        for b in step["buckets"]
    ]


ALL = ["attn.qkv", "attn.proj", "ln.weight", "head"]
# Half of each local gradient piece crosses dp (n = 2): [32, 32], [32, 32], [48], [20, 16] f32.
SENT = {"attn.qkv": 2048, "attn.proj": 2048, "ln.weight": 96, "head": 640}


def _seconds(nbytes: int) -> float:
    """One round over dp (10 us) plus the bytes at 25 GB/s."""
    return 10e-6 + nbytes / 25e9


def test_zero2_is_one_reduce_scatter_and_one_all_gather() -> None:
    step = _step()
    total = sum(SENT.values())
    assert _buckets(step) == [
        ("before", "reduce_scatter", ALL, total, 2 * total),
        ("before", "all_to_all", ["head"], 320, 640),
        ("after", "all_gather", ALL, total, 2 * total),
        ("after", "all_to_all", ["head"], 320, 640),
    ]
    assert [math.isclose(b["seconds"], _seconds(b["bytes"]), rel_tol=1e-12) for b in step["buckets"]] == [True] * 4
    assert (step["collectives"], step["unbucketed_collectives"]) == (4, 10)
    assert math.isclose(step["unbucketed_seconds"] - step["total_seconds"], 6 * 10e-6, rel_tol=1e-9)
    # The parameter's state shard of every f32 tensor is a local slice: in no bucket.
    fetches = [leg for leg in step["legs"] if leg["leg"] == "param -> state"]
    assert len(fetches) == 4
    assert {s["op"] for leg in fetches for hop in leg["hops"] for s in hop["plan"]["steps"]} == {"slice"}


def test_flat_zero2_joins_the_state_gather_to_the_parameters() -> None:
    step = _step("--flat-axis", "dp")
    assert all(len(leg["hops"]) == 2 for leg in step["legs"])
    total = sum(SENT.values())
    assert _buckets(step) == [
        ("before", "reduce_scatter", ALL, total, 2 * total),
        ("before", "all_gather", ["head"], 640, 1280),
        ("after", "all_gather", [*ALL, "head"], total + 640, 2 * (total + 640)),
    ]
    assert (step["collectives"], step["unbucketed_collectives"]) == (3, 10)


def test_a_bucket_cap_cuts_in_leg_order() -> None:
    step = _step("--bucket-bytes", "8KiB")
    assert step["bucket_bytes"] == 8192
    cuts = [(stage, op, names) for stage, op, names, _, _ in _buckets(step)]
    assert cuts == [
        ("before", "reduce_scatter", ["attn.qkv", "attn.proj"]),
        ("before", "reduce_scatter", ["ln.weight", "head"]),
        ("before", "all_to_all", ["head"]),
        ("after", "all_gather", ["attn.qkv", "attn.proj"]),
        ("after", "all_gather", ["ln.weight", "head"]),
        ("after", "all_to_all", ["head"]),
    ]
    assert max(b["buffer_bytes"] for b in step["buckets"]) <= 8192
    # A cap of 1 byte: every step its own collective.
    alone = _step("--bucket-bytes", "1")
    assert alone["collectives"] == alone["unbucketed_collectives"] == 10


def test_overlap_reverses_the_buckets_before_the_update_and_marks_when_each_starts() -> None:
    step = _step("--overlap", "--prefetch", "--bucket-bytes", "8KiB")
    cuts = [(stage, op, names) for stage, op, names, _, _ in _buckets(step)]
    assert cuts == [
        ("before", "reduce_scatter", ["head", "ln.weight", "attn.proj"]),
        ("before", "reduce_scatter", ["attn.qkv"]),
        ("before", "all_to_all", ["head"]),
        ("after", "all_gather", ["attn.qkv", "attn.proj"]),
        ("after", "all_gather", ["ln.weight", "head"]),
        ("after", "all_to_all", ["head"]),
    ]
    assert [b["launch"] for b in step["buckets"]] == ["during backward"] * 3 + ["after step"] * 3
    assert {b["launch"] for b in _step()["buckets"]} == {"in step"}
    # Without a cap, --overlap cuts at 4 MiB: everything here fits one bucket per kind.
    assert _step("--overlap")["bucket_bytes"] == 4 * 2**20


@pytest.mark.parametrize(
    ("options", "code", "words"),
    [
        (["--bucket-bytes", "0"], 2, "at least 1 byte"),
        (["--bucket-bytes", "lots"], 2, "not a byte count"),
        (["--flat-axis", "d-p"], 2, "not a mesh axis"),
        (["--flat-axis", "pp"], 1, "--flat-axis pp: tensor 'attn.qkv'"),
        (["--flat-axis", "2"], 1, "out of range"),
    ],
)
def test_bad_step_options_give_one_message(options: list[str], code: int, words: str) -> None:
    result = run("plan", "zero2.shard", *options, cwd=GOLDEN, env=_env())
    no_traceback(result)
    assert (result.returncode, result.stdout) == (code, ""), result.stderr
    assert words in result.stderr


def test_step_options_apply_to_spec_files_only() -> None:
    result = run("plan", "S0 over mesh[2]", "R over mesh[2]", "--shape", "4", "--flat-axis", "0")
    assert result.returncode == 2 and "apply to a spec file" in result.stderr
    drawn = run("render", "zero2.shard", "--tensor", "head", "--flat-axis", "dp", "--format", "dot", cwd=GOLDEN)
    assert drawn.returncode == 2 and "--flat-axis" in drawn.stderr
    checked = run("check", "zero2.shard", "--flat-axis", "tp", cwd=GOLDEN)
    assert checked.returncode == 0, checked.stderr


def readme_example() -> str:
    """The output under the docs' transcript line ``$`` :data:`README_COMMAND`."""
    lines = README.read_text().splitlines()
    start = lines.index(f"$ {README_COMMAND}") + 1
    return "\n".join(lines[start : lines.index("```", start)]) + "\n"


def test_the_readme_shows_what_the_command_prints() -> None:
    result = run(*shlex.split(README_COMMAND)[1:], cwd=REPO, env=_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout == readme_example()


ERRORS = Path(__file__).parent / "golden" / "cli_errors.txt"


def _error_cases() -> list[tuple[list[str], int, str]]:
    """(arguments after ``shardlang``, exit code, stderr) of every case in the golden file."""
    cases = []
    for block in ERRORS.read_text().split("\n\n"):
        lines = [line for line in block.splitlines() if line]
        if not lines or not lines[0].startswith("# RUN: "):
            continue
        command = shlex.split(lines[0].removeprefix("# RUN: "))
        code = int(lines[1].removeprefix("# EXIT: "))
        cases.append((command[1:], code, "\n".join(lines[2:]) + "\n"))
    return cases


def test_there_are_error_cases() -> None:
    assert len(_error_cases()) >= 6


@pytest.mark.parametrize(("args", "code", "stderr"), _error_cases(), ids=lambda v: None)
def test_an_error_message_is_the_golden_text(args: list[str], code: int, stderr: str) -> None:
    result = run(*args, cwd=GOLDEN, env=_env())
    no_traceback(result)
    assert (result.returncode, result.stderr) == (code, stderr)
