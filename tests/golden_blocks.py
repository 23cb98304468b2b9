"""Golden files of named blocks: ``== NAME`` on a line of its own, then the block's lines
(tests/golden/checkpoint_errors.txt, tests/golden/replica_errors.txt)."""

from __future__ import annotations

from pathlib import Path


def golden_blocks(path: Path) -> dict[str, list[str]]:
    """Each block's lines by its name."""
    cases: dict[str, list[str]] = {}
    for block in path.read_text().split("\n== ")[1:]:
        name, *lines = block.rstrip("\n").split("\n")
        cases[name] = lines
    return cases
