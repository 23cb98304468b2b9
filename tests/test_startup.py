"""What start-up imports (README, "The `shardlang` command"): the planning commands load
neither torch nor scipy (nor numpy, nor graphviz unless they draw). The check runs in a fresh
interpreter, since this one has imported everything already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "scipy", "numpy", "graphviz"})
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
