"""Shared test fixtures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


SHARED_CONFORMANCE = REPO.parent / "shared" / "conformance"
# A verbatim copy, so that a clone without ../shared still runs these checks; the test below
# keeps it identical to the shared original wherever that exists.
VENDORED_CONFORMANCE = REPO / "tests" / "conformance"


def conformance_dir() -> Path:
    """The independent reference data: ``../shared/conformance`` beside the checkout, else the
    vendored copy. Missing data is a failure, never a skip."""
    for candidate in (SHARED_CONFORMANCE, VENDORED_CONFORMANCE):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"no conformance data at {SHARED_CONFORMANCE} or {VENDORED_CONFORMANCE}")


@pytest.fixture(scope="session")
def reshard_costs() -> list[dict[str, Any]]:
    path = conformance_dir() / "reshard_costs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
