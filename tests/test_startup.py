"""What start-up imports (README, "The `shardlang` command"): the planning commands load
neither torch nor scipy nor highspy (nor numpy, nor graphviz unless they draw), and ``import runtime``
(its optimizers and checkpoints too) leaves ``torch.distributed.tensor`` (about a second) out
until a DTensor exists. Each check runs in a fresh interpreter, since this one has imported
everything already; a DTensor handed to ``reshard`` is still refused."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from runtime import ReshardError, reshard
from shardlang import parse_layout
from shardlang.interop import is_dtensor

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "gpt2_small_dp2_tp2.shard")
PAIR = ["S0,R over mesh[2,2]", "R,R over mesh[2,2]", "--shape", "8x8"]

# Runs the commands in one interpreter, their output discarded; prints their exit codes and
# the heavy modules loaded, as JSON.
CLI_SCRIPT = """
import contextlib, io, json, sys
from cli.main import main
codes = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes.append(main(argv))
        except SystemExit as e:
            codes.append(e.code)
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "scipy", "highspy", "numpy", "graphviz"})
print(json.dumps([codes, heavy]))
"""


def _fresh(code: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True
    )
    return done.stdout


def test_planning_commands_import_neither_torch_nor_scipy() -> None:
    commands = [
        ["--help"],
        ["check", EXAMPLE],
        ["plan", *PAIR],
        ["plan", EXAMPLE],
        ["show", PAIR[0], "--shape", "8x8"],
        ["explain", *PAIR],
    ]
    codes, heavy = json.loads(_fresh(CLI_SCRIPT, json.dumps(commands)))
    assert codes == [0] * len(commands)
    assert heavy == []


def test_import_runtime_leaves_dtensor_out() -> None:
    code = "import sys, runtime, runtime.optim, runtime.checkpoint; print('torch.distributed.tensor' in sys.modules)"
    loaded = _fresh(code)
    assert loaded == "False\n"


@pytest.fixture
def world() -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def test_a_dtensor_is_still_refused(world: None) -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    piece = torch.zeros(4, 8)
    dtensor = DTensor.from_local(piece, mesh, (Shard(0), Replicate()))
    assert is_dtensor(dtensor)
    assert not is_dtensor(piece)
    src, dst = parse_layout(PAIR[0]), parse_layout(PAIR[1])
    with pytest.raises(ReshardError) as caught:
        reshard(dtensor, src, dst, global_shape=(8, 8))
    assert caught.value.message == (
        "the tensor: reshard takes this rank's piece as a plain torch.Tensor, not a DTensor (pass its to_local())"
    )
