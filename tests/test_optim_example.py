"""examples/train_gpt.py under torchrun: 4 CPU ranks, 2 steps of a tiny GPT."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_train_gpt_two_steps_on_four_ranks() -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    command += ["examples/train_gpt.py", "--steps", "2"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [row[0] for row in rows] == ["1", "2"], done.stdout
    for _, loss, sent, planned, collectives, sums in rows:
        assert math.isfinite(float(loss))
        # Rank 0 is at coordinate 0 of every group: it sends what the plans say, to the byte.
        assert sent == planned and int(sent.replace(",", "")) > 0
        assert int(collectives) > int(sums) == 3
