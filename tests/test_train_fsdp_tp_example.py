"""examples/train_fsdp_tp.py under torchrun: 4 CPU ranks, 2 steps of FSDP2 over TP with ShardedCAME."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_train_fsdp_tp_two_steps_on_four_ranks() -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    command += ["examples/train_fsdp_tp.py", "--steps", "2"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "mlp.c_fc.weight: (_StridedShard(dim=0, sf=2), Shard(dim=0)) -> S(tp,dp),R over mesh[dp=2,tp=2]"
    rows = [line.split() for line in lines if line.split()[:1] in (["1"], ["2"])]
    assert [row[0] for row in rows] == ["1", "2"], done.stdout
    for _, loss, sent, planned, collectives in rows:
        assert math.isfinite(float(loss))
        # FSDP2 reduced the gradients: the step sends only CAME's statistics, as planned.
        assert sent == planned and int(sent.replace(",", "")) > 0 and int(collectives) > 0
    assert lines[-1].startswith("optimizer state on rank 0: ")
