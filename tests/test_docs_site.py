"""The docs site's structure: an API page lists every public name of the four public modules,
and every page under docs/ is in mkdocs.yml's nav (``mkdocs build --strict`` in ``make docs``
checks links and renders the pages; this checks, without mkdocs installed, what a new name or
page needs)."""

from __future__ import annotations

import importlib
import re

import pytest

from tests.conftest import REPO

API = REPO / "docs" / "api"
DIRECTIVE = re.compile(r"^::: (?P<module>[\w.]+)\n(?P<options>(?:[ ]{4}.*\n|\n)*)", re.MULTILINE)


def documented() -> dict[str, set[str] | None]:
    """Per ``:::`` target on the API pages, the members it lists (None: all of them)."""
    found: dict[str, set[str] | None] = {}
    for page in API.glob("*.md"):
        for m in DIRECTIVE.finditer(page.read_text(encoding="utf-8")):
            listed = re.findall(r"^ {8}- (\w+)$", m["options"], re.MULTILINE)
            found[m["module"]] = set(listed) if "members:" in m["options"] else None
    return found


@pytest.mark.parametrize("module", ["shardlang", "planner", "runtime", "runtime.optim"])
def test_every_public_name_has_an_api_entry(module: str) -> None:
    names = set(importlib.import_module(module).__all__)
    pages = documented()
    assert module in pages, f"no '::: {module}' on a page under docs/api/"
    members = pages[module]
    if members is None:
        return
    missing = sorted(n for n in names if n not in members and f"{module}.{n}" not in pages)
    assert not missing, f"docs/api: {module} lists no entry for {missing}"
    unknown = sorted(members - names - {n for n in members if hasattr(importlib.import_module(module), n)})
    assert not unknown, f"docs/api: {module} lists names it does not have: {unknown}"


def test_every_page_is_in_the_nav() -> None:
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    missing = sorted(p for p in pages if not re.search(rf"(:\s*|-\s+){re.escape(p)}\s*$", nav, re.MULTILINE))
    assert not missing, f"pages under docs/ missing from mkdocs.yml's nav: {missing}"


def test_the_readme_stays_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 200, f"README.md has {lines} lines: move detail into docs/"
