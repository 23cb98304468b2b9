"""Every Python module of the repository is short: under 600 lines, so that each has one job
(tests included: their shared cases live in helper modules such as tests/optim_support.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import REPO

MAX_LINES = 600


def python_files(repo: Path) -> list[Path]:
    """The tracked ``.py`` files (``git ls-files``); outside a git checkout, every ``.py`` file
    below ``repo`` but in hidden folders and virtual environments."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "*.py"], cwd=repo, capture_output=True, text=True, check=False, timeout=60
    )
    if listed.returncode == 0:
        return [repo / name for name in listed.stdout.split("\0") if name]
    return [
        p
        for p in repo.rglob("*.py")
        if not any(part.startswith(".") or part == "site-packages" for part in p.relative_to(repo).parts[:-1])
    ]


def long_modules(repo: Path) -> dict[str, int]:
    """Each module of ``MAX_LINES`` lines or more, and its length."""
    lengths = {str(p.relative_to(repo)): len(p.read_text().splitlines()) for p in python_files(repo) if p.is_file()}
    return {name: n for name, n in sorted(lengths.items()) if n >= MAX_LINES}


def test_every_python_module_is_under_600_lines() -> None:
    files = python_files(REPO)
    assert len(files) > 100 and REPO / "tests" / "conftest.py" in files, "the files were not found"
    long = long_modules(REPO)
    assert not long, f"modules of {MAX_LINES} lines or more (split them by topic, one job each): {long}"
