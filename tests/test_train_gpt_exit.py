"""The tiny GPT example ends cleanly: trained on 4 ranks by torchrun, every rank exits 0 after
its last step, with the summary printed and no abort at exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES

TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.slow
def test_train_gpt_exits_zero_on_every_rank() -> None:
    assert TORCHRUN.exists(), f"torchrun is not installed next to {sys.executable}"
    result = subprocess.run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", "4", str(EXAMPLES / "train_gpt.py"), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "terminate called" not in output and "exitcode" not in output, output[-4000:]
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines if line.split() and line.split()[0].isdigit()] == ["1", "2"], lines
    assert lines[-1].startswith("optimizer state on rank 0: "), lines
