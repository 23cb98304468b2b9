"""Running the ``shardlang`` command in tests (in this process, or the installed script), and the
inputs and SVG readers that several CLI test modules share."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

from cli.main import main

SCRIPT = Path(sys.executable).with_name("shardlang")
SVG = "{http://www.w3.org/2000/svg}"
# A partial sum on a [2, 8] mesh with a bandwidth per axis: a plan of several steps.
HAR = ["R | P01 over mesh[2,8]", "R over mesh[2,8]", "--shape", "1048576", "--bandwidth", "25e9,300e9"]


def run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``shardlang ARGS`` as the console script runs it (``sys.exit(cli.main.main())``), in this
    process with piped output: its exit code, stdout and stderr. A process costs a second of
    imports each; the installed script itself is run by test_the_installed_script and the
    terminal tests."""
    out, err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8"), io.StringIO()  # out has a .buffer
    here = Path.cwd()
    with mock.patch.dict(os.environ, env or plain_env(), clear=True), redirect_stdout(out), redirect_stderr(err):
        try:
            os.chdir(cwd or here)
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors and --help
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        finally:
            os.chdir(here)
    out.flush()
    printed = out.buffer.getvalue().decode()  # type: ignore[attr-defined]
    return subprocess.CompletedProcess(["shardlang", *args], code, printed, err.getvalue())


def run_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The installed console script; a bounded wait so that a hang fails the test."""
    assert SCRIPT.exists(), f"the console script {SCRIPT} is not installed (pip install -e .)"
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env=env or plain_env())


def plain_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("NO_COLOR", None)
    env["COLUMNS"] = "120"
    return env


def no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr + result.stdout, result.stderr


# Valid: a mesh with figures, tensors with and without grad and state layouts, a range and a rule.
GOOD_SPEC = """\
mesh world = [dp=2, tp=2]  bandwidth [25e9, 300e9]  latency 5us
tensor emb : f32[37, 24] {
  param = R,S(tp) over world
  grad  = R,S(tp) | P(dp) over world
  state = S(dp),S(tp) over world
}
tensor h.{0..2}.w : bf16[5, 3] {
  param = S(tp),R over world
  grad  = S(tp),R | P(dp):avg over world
  state = S(tp,dp),R over world
}
tensor bias : f32[3] { param = R over world }
rule "h.*.b" { param = R over world  grad = R | P(dp) over world  state = S(dp) over world }
"""


def _svg(path: Path) -> ET.Element:
    return ET.parse(path).getroot()


def _text(element: ET.Element) -> str:
    return " ".join(t.text or "" for t in element.iter(f"{SVG}text"))
