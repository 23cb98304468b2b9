"""``shardlang plan``'s output does not grow with the rank count: the same spec over 64 and
over 131,072 ranks, where the plan itself is the same (every shape divides evenly at both
sizes, so no chunk padding changes the cost model's choice or the buckets), prints the same
lines, numbers aside: no rank lists, no per-group rows, groups in the axis or ``a..b step s``
notation (docs/cli.md, "plan"). The oracle is the 64-rank output's skeleton, not a stored one.

Where the bench (bench/bench_scale.py) sees outputs grow with ranks, the plan differs: shapes
that pad at 131,072 ranks make every step larger than the bucket cap (one bucket per step) and
add a padding warning per tensor group, or the planner picks other steps."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.cli_support import no_traceback, run

# dp >= 3 at both sizes so that a flat dp group is a strided run (``0..48 step 16``) in both.
SMALL, LARGE = 4, 8192  # x fsdp=2 x tp=8: 64 and 131,072 ranks
ROWS = 131072  # divisible by tp x dp x fsdp at both sizes; 16 columns: every step fits one bucket
SPEC = """
mesh world = [dp={dp}, fsdp=2, tp=8]  bandwidth 25e9  latency 20us
tensor layers.{{0..3}}.w : bf16[{rows}, 16] {{
  param = S(tp),R over world
  grad  = S(tp),R | P(dp,fsdp):avg over world
  state = S(tp,dp,fsdp),R over world
}}
tensor layers.{{0..3}}.o : bf16[{rows}, 16] {{
  param = R,S(tp) over world
  grad  = R,S(tp) | P(dp,fsdp):avg over world
  state = S(dp,fsdp),S(tp) over world
}}
"""
# a number with its unit, or a float in JSON; a rank list would keep its brackets and commas
NUMBER = re.compile(r"\d+(\.\d+)?(e-?\d+)?( ?(us|ms|s|B|KiB|MiB|GiB|GB/s|x))?")


def skeleton(text: str) -> list[str]:
    """The lines of ``text`` with every number (and its unit) one mark and runs of blanks one."""
    return [re.sub(r"\s+", " ", NUMBER.sub("#", line)).strip() for line in text.splitlines()]


def shape_of(value: Any) -> Any:
    """A JSON value's structure: keys, list lengths and strings' skeletons; numbers one mark."""
    if isinstance(value, dict):
        return {k: shape_of(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape_of(v) for v in value]
    if isinstance(value, str):
        return " ".join(skeleton(value))
    return "#" if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _plan(tmp_path: Path, dp: int, *extra: str) -> str:
    spec = tmp_path / f"model_{dp}.shard"
    spec.write_text(SPEC.format(dp=dp, rows=ROWS))
    got = run("plan", str(spec), *extra)
    no_traceback(got)
    assert got.returncode == 0, got.stderr
    return got.stdout.replace(str(spec), "SPEC")


# rank 0's flat group: dp's a strided run (0..48 step 16 of 64 ranks), fsdp's two ranks [0,8]
FLAT = {(): None, ("--flat-axis", "dp"): r"ranks 0\.\.\d+ step 16 ", ("--flat-axis", "fsdp"): r"ranks \[0,8\] "}


@pytest.mark.parametrize("extra", list(FLAT), ids=["plan", "flat-dp", "flat-fsdp"])
def test_plan_text_is_the_same_at_64_and_131072_ranks(tmp_path: Path, extra: tuple[str, ...]) -> None:
    small, large = _plan(tmp_path, SMALL, *extra), _plan(tmp_path, LARGE, *extra)
    assert "mesh[dp=8192,fsdp=2,tp=8]" in large  # the large spec was planned
    assert skeleton(large) == skeleton(small)
    group = FLAT[extra]
    if group:
        assert re.search(group, large) and re.search(group, small)
    # the only growth left is the digits of the larger numbers: a few bytes per line
    assert len(large) <= len(small) + 8 * len(small.splitlines())


def test_plan_json_is_the_same_at_64_and_131072_ranks(tmp_path: Path) -> None:
    small = json.loads(_plan(tmp_path, SMALL, "--format", "json"))
    large = json.loads(_plan(tmp_path, LARGE, "--format", "json"))
    assert large["meshes"] != small["meshes"]
    assert shape_of(large) == shape_of(small)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_pair_plan_is_the_same_at_64_and_131072_ranks(fmt: str) -> None:
    def pair(dp: int) -> str:
        mesh = f"mesh[dp={dp},fsdp=2,tp=8]"
        src, dst = f"S(tp),R | P(dp,fsdp) over {mesh}", f"S(tp,dp,fsdp),R over {mesh}"
        got = run("plan", src, dst, "--shape", f"{ROWS}x16", "--format", fmt)
        no_traceback(got)
        assert got.returncode == 0, got.stderr
        return got.stdout

    small, large = pair(SMALL), pair(LARGE)
    if fmt == "json":
        assert shape_of(json.loads(large)) == shape_of(json.loads(small))
    else:
        assert skeleton(large) == skeleton(small)
