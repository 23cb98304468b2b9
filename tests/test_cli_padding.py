"""The chunk-padding warning of ``shardlang check`` and ``shardlang plan``: a tensor whose step
sends more than 1.25x its data because its pieces are padded, named with the ratio, its most
padded layout and one that pads less. Numbers worked by hand from torch.chunk's pieces."""

from __future__ import annotations

import json
from pathlib import Path

from cli.plan_report import padding
from shardlang import parse_layout
from tests.cli_support import no_traceback, run

# 6 rows on 4 ranks: torch.chunk pieces of 2 rows (2, 2, 2, 0), 8 rows sent for 6: 1.33x.
# 10 rows: pieces of 3 (3, 3, 3, 1), 12 for 10: 1.2x, under the threshold.
SPEC = """
mesh world = [dp=4]
tensor t : f32[6, 16384] { param = R,R over world  grad = R,R | P(dp):avg over world  state = S(dp),R over world }
tensor u : f32[10, 16384] { param = R,R over world  grad = R,R | P(dp):avg over world  state = S(dp),R over world }
tensor v : f32[6, 16] { param = R,R over world  grad = R,R | P(dp):avg over world  state = S(dp),R over world }
"""
# By hand: t's reduce-scatter and all-gather each send 3 padded pieces of 2 x 16384 floats
# (384 KiB), 768 KiB in all, for 6/8 of it, 576 KiB; dp on the columns divides them evenly.
# v pads alike but sends 384 B: under the 64 KiB floor.
WARNING = (
    "warning: tensor t: chunk padding: its step sends 768 KiB per rank for 576 KiB of data (1.33x); "
    "state = S(dp),R over world pads 1.33x; R,S(dp) over world pads 1.00x"
)


def test_padding_of_a_layout() -> None:
    assert padding(parse_layout("S0,R over mesh[4]"), (6, 5)) == 8 / 6
    assert padding(parse_layout("S(1,0),R over mesh[2,4]"), (11008, 3)) == 11008 / 11008
    # 11008 rows on 32768 ranks: pieces of 1 row, 32768 rows sent (the 2.98x)
    assert padding(parse_layout("S(1,0),R over mesh[4096,8]"), (11008, 4096)) == 32768 / 11008
    assert padding(parse_layout("S0,S1 over mesh[3,4]"), (10, 6)) == (12 / 10) * (8 / 6)


def test_check_and_plan_warn_of_padding(tmp_path: Path) -> None:
    path = tmp_path / "padded.shard"
    path.write_text(SPEC)
    checked = run("check", str(path))
    no_traceback(checked)
    assert checked.returncode == 0
    assert checked.stderr.splitlines() == [f"{path}: {WARNING}"]
    data = json.loads(run("check", str(path), "--format", "json").stdout)
    assert data["ok"] and data["files"][0]["warnings"] == [WARNING]
    planned = run("plan", str(path))
    assert planned.returncode == 0 and planned.stdout.rstrip().splitlines()[-1] == WARNING
    assert json.loads(run("plan", str(path), "--format", "json").stdout)["warnings"] == [WARNING]
    # the advice taken: no warning
    path.write_text(
        SPEC.replace(
            "tensor t : f32[6, 16384] { param = R,R over world  grad = R,R | P(dp):avg over world  state = S(dp),R",
            "tensor t : f32[6, 16384] { param = R,R over world  grad = R,R | P(dp):avg over world  state = R,S(dp)",
        )
    )
    assert run("check", str(path)).stderr == ""
