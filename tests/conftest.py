"""Shared test fixtures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def conformance_dir() -> Path:
    """The independent reference data (``../shared/conformance`` beside the checkout).

    Missing data is a failure, never a skip: these tests are the independent check.
    """
    for candidate in (REPO.parent / "shared" / "conformance", REPO / "shared" / "conformance"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"no shared/conformance beside {REPO}; the conformance tests need it")


@pytest.fixture(scope="session")
def reshard_costs() -> list[dict[str, Any]]:
    path = conformance_dir() / "reshard_costs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
