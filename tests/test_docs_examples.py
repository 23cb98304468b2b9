"""The README and the docs site show only what runs: every ```python block is executed, every
``$ shardlang ...`` transcript is compared with the command's real output, and every option of
the README's and the CLI page's command summaries exists.

How a page marks its python blocks (an HTML comment on the line before the fence, invisible on
the site and on GitHub; a block without one fails the test, so none is left unchecked):

* ``<!-- run -->``: executed in this process, the page's ``run`` blocks one after another in one
  namespace, as a reader would paste them;
* ``<!-- run ranks=N -->``: the block alone is one program, run on N gloo ranks
  (``runtime.testing.run_ranks``) with the default process group initialized, as under torchrun;
* ``<!-- included: PATH, run ... by tests/TEST.py -->``: the block only includes the file PATH
  (``--8<--``), which that test runs (under torchrun); checked to be so.

Each page's blocks run in order in a temporary folder holding links to the repository's
``docs`` and ``examples``, so that relative paths read as in a checkout and what a block writes
(a checkpoint) goes nowhere else. Transcripts run in the repository root with a fixed terminal
width; ``…`` in a transcript stands for any text within its line (a solve time).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from cli.main import build_parser
from runtime.testing import run_ranks
from tests.conftest import REPO

SHARDLANG = Path(sys.executable).with_name("shardlang")
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*(?P<text>.*?)\s*-->\s*$")
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^":]+)(?::(?P<start>\d+):(?P<end>\d+))?"$')
# The terminal width argparse and the tables see: the transcripts were written at it.
ENV = os.environ | {"COLUMNS": "100", "LINES": "50"}


@attrs.frozen
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    info: str  # the fence's info string: "python", "console", ""
    marker: str | None  # the HTML comment before it, if any
    text: str  # its content, dedented, snippets not expanded

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> Iterator[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        body = "\n".join(line[indent:] for line in lines[i + 1 : end])
        yield Block(page, i + 1, opening["info"].strip(), marker_before(lines, i), body + "\n")
        i = end + 1


def marker_before(lines: list[str], fence_index: int) -> str | None:
    """The HTML comment just before a fence; an admonition's title line (``??? example``) and blank
    lines may stand between, as when a collapsed block includes a file."""
    j = fence_index - 1
    while j >= 0 and (not lines[j].strip() or lines[j].lstrip().startswith(("???", "!!!"))):
        j -= 1
    found = MARKER.match(lines[j]) if j >= 0 else None
    return found["text"] if found else None


def expand(text: str) -> str:
    """The text with each ``--8<--`` line replaced by the lines it includes, as the site shows it."""
    out = []
    for line in text.splitlines():
        snippet = SNIPPET.match(line.strip())
        if not snippet:
            out.append(line)
            continue
        included = (REPO / snippet["path"]).read_text(encoding="utf-8").splitlines()
        if snippet["start"]:
            included = included[int(snippet["start"]) - 1 : int(snippet["end"])]
        out.extend(included)
    return "\n".join(out) + "\n"


def python_blocks(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.info.split()[:1] == ["python"]]


def transcripts(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.text.startswith("$ shardlang")]


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


RUNNABLE = [p for p in PAGES if python_blocks(p)]
WITH_TRANSCRIPTS = [p for p in PAGES if transcripts(p)]


def test_the_collector_finds_the_examples() -> None:
    """A parsing slip must not turn into a test of nothing: the pages named here have blocks."""
    names = {page_id(p) for p in RUNNABLE}
    assert {"README.md", "docs/tutorials/first-spec.md", "docs/tutorials/checkpoints.md"} <= names
    assert {"README.md", "docs/reference/cli.md"} <= {page_id(p) for p in WITH_TRANSCRIPTS}


# ---- python examples ----


def _run_on_rank(rank: int, world_size: int, code: str, where: str, folder: str) -> None:
    """One rank of a ``run ranks=N`` block: the default group is up (``run_ranks``)."""
    os.chdir(folder)
    exec(compile(code, where, "exec"), {"__name__": "__main__"})


def ranks_of(marker: str) -> int | None:
    found = re.fullmatch(r"run(?: ranks=(\d+))?", marker)
    if not found:
        return None
    return int(found[1]) if found[1] else 1


def check_included(block: Block) -> None:
    found = re.fullmatch(r"included: (?P<path>\S+), run .* by (?P<test>tests/\S+\.py)", block.marker or "")
    assert found, f"{block.where}: expected 'included: PATH, run ... by tests/TEST.py', got {block.marker!r}"
    snippet = SNIPPET.match(block.text.strip())
    assert snippet and snippet["path"] == found["path"], f"{block.where}: the block must include {found['path']}"
    test = REPO / found["test"]
    assert test.is_file(), f"{block.where}: {found['test']} does not exist"
    assert Path(found["path"]).name in test.read_text(encoding="utf-8"), (
        f"{block.where}: {found['test']} does not run {found['path']}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=page_id)
def test_python_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("docs", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__main__"}
    for block in python_blocks(page):
        assert block.marker is not None, f"{block.where}: a python block without a run marker (this file says which)"
        if block.marker.startswith("included:"):
            check_included(block)
            continue
        ranks = ranks_of(block.marker)
        assert ranks is not None, f"{block.where}: unknown marker {block.marker!r}"
        code = expand(block.text)
        if ranks == 1:
            exec(compile(code, block.where, "exec"), namespace)
        else:
            run_ranks(_run_on_rank, ranks, (code, block.where, str(tmp_path)), timeout=240)


# ---- transcripts ----


def commands(block: Block) -> Iterator[tuple[str, str]]:
    """Each ``$ command`` of a transcript with the output shown under it."""
    command, output = None, []
    for line in expand(block.text).splitlines():
        if line.startswith("$ "):
            if command is not None:
                yield command, "\n".join(output)
            command, output = line[2:], []
        else:
            output.append(line)
    if command is not None:
        yield command, "\n".join(output)


def matches(shown: str, real: str) -> bool:
    shown_lines = [line.rstrip() for line in shown.rstrip("\n").splitlines()]
    real_lines = [line.rstrip() for line in real.rstrip("\n").splitlines()]
    if len(shown_lines) != len(real_lines):
        return False
    for want, got in zip(shown_lines, real_lines, strict=True):
        pattern = ".*".join(re.escape(part) for part in want.split("…"))
        if not re.fullmatch(pattern, got):
            return False
    return True


@pytest.mark.parametrize("page", WITH_TRANSCRIPTS, ids=page_id)
def test_transcripts_match_the_command(page: Path) -> None:
    assert SHARDLANG.exists(), f"shardlang is not installed next to {sys.executable}"
    for block in transcripts(page):
        for command, shown in commands(block):
            argv = shlex.split(command)
            assert argv[0] == "shardlang", f"{block.where}: a transcript runs shardlang, not {argv[0]}"
            done = subprocess.run(
                [str(SHARDLANG), *argv[1:]], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120
            )
            real = done.stdout + done.stderr
            assert matches(shown, real), f"{block.where}: `{command}` now prints\n{real}\nbut the page shows\n{shown}"


# ---- command summaries ----

SUMMARIES = [REPO / "README.md", REPO / "docs" / "reference" / "cli.md"]


def summary_lines(page: Path) -> Iterator[tuple[Block, list[str]]]:
    """The argv of each command line of a page's first plain block that lists ``shardlang`` calls."""
    for block in blocks(page):
        if block.info or not block.text.startswith("shardlang"):
            continue
        for line in block.text.splitlines():
            line = line.split("  #")[0].replace("[", " ").replace("]", " ")
            argv = shlex.split(line.split("shardlang", 1)[1]) if "shardlang" in line else []
            if argv or line.strip().endswith("shardlang"):
                yield block, argv
        return


@pytest.mark.parametrize("page", SUMMARIES, ids=page_id)
def test_command_summary_names_real_options(page: Path) -> None:
    """Every ``--option`` a summary shows is in its command's ``--help`` (the usage lines are
    abbreviations, so only the options' names are checked)."""
    found = list(summary_lines(page))
    assert found, f"{page_id(page)}: no command summary found"
    for block, argv in found:
        command = argv[0] if argv and not argv[0].startswith("-") and argv[0] in SUBCOMMANDS else ""
        for option in (a.split("=")[0] for a in argv if a.startswith("--")):
            assert option in help_text(command), f"{block.where}: `shardlang {command}` has no option {option}"


@functools.cache  # the two summaries ask for the same commands' help
def help_text(command: str) -> str:
    done = subprocess.run(
        [str(SHARDLANG), *([command] if command else []), "--help"], env=ENV, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


# The command's own subcommands, read from its parser so that a new one is checked too.
SUBCOMMANDS = tuple(
    next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
)


# ---- refreshing the transcripts ----


def real_output(command: str) -> str:
    argv = shlex.split(command)
    done = subprocess.run([str(SHARDLANG), *argv[1:]], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


def merged(shown: str, real: str) -> str:
    """The real output, each of its lines that a shown line with ``…`` still matches kept as shown."""
    wildcards = [line for line in shown.split("\n") if "…" in line]
    out = []
    for got in real.rstrip("\n").split("\n"):
        out.append(next((want for want in wildcards if matches(want, got)), got))
    return "\n".join(out)


def refresh(page: Path) -> bool:
    """Rewrite the page's transcripts with what the commands print now (a shown line with ``…``
    that still matches is kept). Whether anything changed."""
    lines = page.read_text(encoding="utf-8").splitlines(keepends=True)
    changed = False
    for block in reversed(transcripts(page)):
        new = []
        for command, shown in commands(block):
            real = real_output(command)
            if not matches(shown, real):
                changed = True
                shown = merged(shown, real)
            new += [f"$ {command}\n", *(line + "\n" for line in shown.split("\n") if shown)]
        start = block.line  # the fence is line ``block.line``: its content starts at that index
        lines[start : start + len(block.text.splitlines())] = new
    if changed:
        page.write_text("".join(lines), encoding="utf-8")
    return changed


if __name__ == "__main__":
    # .venv/bin/python -m tests.test_docs_examples: after a change to what a command prints, rewrite the
    # pages' transcripts from the commands' real output (then read the diff before committing).
    for page in WITH_TRANSCRIPTS:
        if refresh(page):
            print(f"rewrote {page_id(page)}")


# ---- command lines and spec examples without a transcript ----

# A program a command line in a block may run: shardlang (as installed, or under torchrun with
# --no-python), or a script of the repository (under torchrun or python).
PROGRAM = re.compile(r"^(?:\.venv/bin/)?shardlang$|^(?:examples|bench)/\w+\.py$")


def command_lines(page: Path) -> Iterator[tuple[Block, str, list[str]]]:
    """(block, program, its arguments) for each line of a page's plain or console blocks that runs
    shardlang or a script of the repository, a ``torchrun`` or ``python`` in front of it skipped
    (transcripts included: their commands are also run, by test_transcripts_match_the_command)."""
    for block in blocks(page):
        if block.info not in ("", "console", "shell", "bash", "sh"):
            continue
        for line in block.text.splitlines():
            line = line.removeprefix("$ ").split("  #")[0].replace("[", " ").replace("]", " ")
            try:
                argv = shlex.split(line)
            except ValueError:
                continue
            at = next((i for i, a in enumerate(argv) if PROGRAM.match(a)), None)
            if at is None or (at > 0 and Path(argv[0]).name not in ("torchrun", "python", "python3")):
                continue
            program = "shardlang" if argv[at].endswith("shardlang") else argv[at]
            yield block, program, argv[at + 1 :]


WITH_COMMANDS = [p for p in PAGES if any(True for _ in command_lines(p))]


@functools.cache
def program_help(program: str, command: str) -> str:
    argv = [str(SHARDLANG)] if program == "shardlang" else [sys.executable, str(REPO / program)]
    done = subprocess.run(
        [*argv, *([command] if command else []), "--help"], cwd=REPO, env=ENV, capture_output=True, text=True
    )
    assert done.returncode == 0, f"{program} {command} --help: {done.stderr}"
    return done.stdout


def test_the_command_lines_are_found() -> None:
    """Pages whose command lines the next test checks (a parsing slip must not check nothing)."""
    found = {(page_id(p), program) for p in WITH_COMMANDS for _, program, _ in command_lines(p)}
    assert {
        ("docs/tutorials/calibrating.md", "shardlang"),
        ("docs/tutorials/training.md", "examples/train_gpt.py"),
        ("docs/tutorials/fsdp2-tp.md", "examples/train_fsdp_tp.py"),
        ("README.md", "shardlang"),
    } <= found


@pytest.mark.parametrize("page", WITH_COMMANDS, ids=page_id)
def test_command_lines_name_real_options(page: Path) -> None:
    """Every ``--option`` of a command line shown on a page (one that is not a transcript too: a
    ``torchrun`` line, a summary) is in its program's ``--help``, and its subcommand exists."""
    for block, program, argv in command_lines(page):
        command = ""
        if program == "shardlang" and argv and not argv[0].startswith("-") and argv[0] in SUBCOMMANDS:
            command = argv[0]
        text = program_help(program, command)
        for option in (a.split("=")[0] for a in argv if a.startswith("--")):
            assert re.search(rf"{re.escape(option)}\b", text), f"{block.where}: `{program} {command}` has no {option}"


SPEC_START = re.compile(r"^(?:#[^\n]*\n)*(?:mesh|tensor|rule)\b", re.MULTILINE)


def spec_blocks(page: Path) -> list[Block]:
    """Plain blocks that are spec text (they start with ``mesh``, ``tensor`` or ``rule``, after
    comments), shown by hand; those that include a file of the repository are that file."""
    return [b for b in blocks(page) if not b.info and not SNIPPET.match(b.text.strip()) and SPEC_START.match(b.text)]


SPEC_PAGES = [p for p in PAGES if spec_blocks(p)]
WORLD = "mesh world = [dp=2, tp=2]\n"  # what a fragment that names `world` without declaring it reads


@pytest.mark.parametrize("page", SPEC_PAGES, ids=page_id)
def test_spec_examples_parse(page: Path) -> None:
    """Every spec shown on a page parses, a fragment over an undeclared ``world`` under one."""
    import shardlang

    assert SPEC_PAGES, "no spec example found"
    for block in spec_blocks(page):
        text = block.text if re.search(r"^mesh world\b", block.text, re.MULTILINE) else WORLD + block.text
        try:
            shardlang.parse_spec(text, filename=block.where)
        except shardlang.SpecError as e:
            pytest.fail(f"{block.where}: the spec shown does not parse: {e}")
