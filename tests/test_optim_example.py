"""examples/train_gpt.py under the installed torchrun: 4 CPU ranks, 2 steps of a tiny GPT. One
run serves both tests: what the steps print, and a clean end (every rank exits 0 after its last
step, with the summary printed and no abort at exit)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, REPO

TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.fixture(scope="module")
def two_steps() -> subprocess.CompletedProcess[str]:
    assert TORCHRUN.exists(), f"torchrun is not installed next to {sys.executable}"
    command = [str(TORCHRUN), "--standalone", "--nproc-per-node", "4", str(EXAMPLES / "train_gpt.py"), "--steps", "2"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_train_gpt_two_steps_on_four_ranks(two_steps: subprocess.CompletedProcess[str]) -> None:
    done = two_steps
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [row[0] for row in rows] == ["1", "2"], done.stdout
    for _, loss, sent, planned, collectives, sums in rows:
        assert math.isfinite(float(loss))
        # Rank 0 is at coordinate 0 of every group: it sends what the plans say, to the byte.
        assert sent == planned and int(sent.replace(",", "")) > 0
        assert int(collectives) > int(sums) == 3


@pytest.mark.slow
def test_train_gpt_exits_zero_on_every_rank(two_steps: subprocess.CompletedProcess[str]) -> None:
    output = two_steps.stdout + two_steps.stderr
    assert two_steps.returncode == 0, output[-4000:]
    assert "terminate called" not in output and "exitcode" not in output, output[-4000:]
    lines = two_steps.stdout.splitlines()
    assert [line.split()[0] for line in lines if line.split() and line.split()[0].isdigit()] == ["1", "2"], lines
    assert lines[-1].startswith("optimizer state on rank 0: "), lines
