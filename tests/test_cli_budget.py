"""``shardlang plan`` (and ``explain``) and the search budget: ``--p2p`` past the budget falls back to the
collective plans with a note (what the command prints without ``--p2p``), and ``--max-states``
sets the budget of a pair's plan, or of each pair in a spec file's step plan."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.cli_support import no_traceback, run

# 4096 ranks: the point-to-point step from S(tp,dp) to S(tp) would send from every dp rank to
# every other (512 x 511 messages per tp column), far past the 50,000 states of the budget.
BIG = """
mesh world = [dp=512, tp=8]  bandwidth [25e9, 300e9]  latency [20us, 3us]
tensor w : bf16[4096, 64] {
  param = S(tp),R over world
  grad  = S(tp),R | P(dp):avg over world
  state = S(tp,dp),R over world
}
"""


def refused(*args: str) -> subprocess.CompletedProcess[str]:
    """``shardlang ARGS``, which must exit 1 without a traceback."""
    result = run(*args)
    no_traceback(result)
    assert result.returncode == 1, (result.returncode, result.stderr)
    return result


SAME_MESH = ["S0,S1 over mesh[2,2]", "S1,S0 over mesh[2,2]"]
CROSS = ["S0,S1 over mesh[2,2]", "S0,R over mesh[4] ranks 4..7"]


def test_p2p_past_the_budget_falls_back_to_the_collective_plan(tmp_path: Path) -> None:
    spec = tmp_path / "big.shard"
    spec.write_text(BIG)
    collective = run("plan", str(spec))
    fallback = run("plan", str(spec), "--p2p")
    no_traceback(fallback)
    assert fallback.returncode == 0, fallback.stderr
    assert fallback.stdout == collective.stdout
    assert "note: --p2p: tensor 'w':" in fallback.stderr and "search budget" in fallback.stderr
    assert "note: planned with collectives instead (as without --p2p)" in fallback.stderr
    json_fallback = run("plan", str(spec), "--p2p", "--format", "json")
    assert json_fallback.returncode == 0 and json_fallback.stdout == run("plan", str(spec), "--format", "json").stdout


def test_max_states_is_the_budget_of_a_pair() -> None:
    # one mesh: 10 states hold the collective search, not the point-to-point step as well
    small = run("plan", *SAME_MESH, "--shape", "8x8", "--p2p", "--max-states", "10")
    assert small.returncode == 0, small.stderr
    assert "note: planned with collectives instead" in small.stderr
    assert small.stdout == run("plan", *SAME_MESH, "--shape", "8x8", "--max-states", "10").stdout
    assert "point_to_point" in run("plan", *SAME_MESH, "--shape", "8x8", "--p2p").stdout
    # two meshes: point to point or nothing; the error names the budget given
    assert "max_states=3" in refused("plan", *CROSS, "--shape", "8x8", "--max-states", "3").stderr
    assert run("plan", *CROSS, "--shape", "8x8", "--max-states", "100000").returncode == 0


def test_max_states_is_the_budget_of_each_pair_of_a_spec_file(tmp_path: Path) -> None:
    spec = tmp_path / "big.shard"
    spec.write_text(BIG)
    said = refused("plan", str(spec), "--max-states", "1").stderr
    assert "tensor 'w':" in said and "max_states=1 " in said
    # --p2p falls back to the collective plan only where that fits the budget; here it does not
    assert run("plan", str(spec), "--max-states", "1", "--p2p").returncode == 1
    assert run("plan", str(spec), "--max-states", "100000").stdout == run("plan", str(spec)).stdout


def test_max_states_refuses_nonsense() -> None:
    for bad in ("0", "many"):
        assert run("plan", *SAME_MESH, "--shape", "8x8", "--max-states", bad).returncode == 2


def test_explain_takes_the_budget_its_error_names() -> None:
    """Every command whose error says to raise max_states takes --max-states: explain too."""
    said = refused("explain", *CROSS, "--shape", "8x8", "--max-states", "3").stderr
    assert "max_states=3" in said and "--max-states" in said
    assert run("explain", *CROSS, "--shape", "8x8", "--max-states", "100000").returncode == 0


def test_check_takes_the_budget_its_error_names(tmp_path: Path) -> None:
    """check plans every tensor's step, so its budget errors say to raise --max-states: it takes it."""
    spec = tmp_path / "big.shard"
    spec.write_text(BIG)
    result = refused("check", str(spec), "--max-states", "1")
    said = result.stdout + result.stderr
    assert "max_states=1 " in said and "--max-states" in said
    assert run("check", str(spec), "--max-states", "100000").returncode == 0
