"""The docs site's structure: an API page lists every public name of the four public modules,
and every page under docs/ is in mkdocs.yml's nav (``mkdocs build --strict`` in ``make docs``
checks links and renders the pages; this checks, without mkdocs installed, what a new name or
page needs)."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("module", ["shardlang", "planner", "runtime", "runtime.optim"])
def test_every_public_name_is_in_all(module: str) -> None:
    """What the package's ``__init__`` exports is its ``__all__`` (which the API pages are checked
    against): a public name imported there and left out of ``__all__`` would have no API entry."""
    package = importlib.import_module(module)
    public = {n for n, v in vars(package).items() if not n.startswith("_") and not inspect.ismodule(v)}
    public -= {"annotations"}  # from __future__ import annotations
    missing = sorted(public - set(package.__all__))
    assert not missing, f"{module} exports {missing} outside __all__: add them (and to docs/api/)"


def test_every_page_is_in_the_nav() -> None:
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    missing = sorted(p for p in pages if not re.search(rf"(:\s*|-\s+){re.escape(p)}\s*$", nav, re.MULTILINE))
    assert not missing, f"pages under docs/ missing from mkdocs.yml's nav: {missing}"


def test_the_readme_stays_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 200, f"README.md has {lines} lines: move detail into docs/"


def test_the_generated_benchmark_page_is_what_the_data_gives() -> None:
    """``make bench-docs`` was run after the last change to docs/benchmarks/data/ (or the renderer):
    the benchmark pages, the README's and the index's generated blocks, and the plots (by the
    inputs each records; tests/test_bench_docs.py draws them)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "render_docs.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr or done.stdout


def test_bench_results_round_trip(tmp_path: Path) -> None:
    """A script's printed markdown table, written with its provenance and read back."""
    from bench import results

    text = "**small** (4 ranks):\n\n| variant | ms |\n|---|---|\n| DDP | 100.1 |\n| ours | 90.0 |\n"
    tables = results.markdown_tables(text)
    assert tables == [results.table("small (4 ranks)", ["variant", "ms"], [["DDP", "100.1"], ["ours", "90.0"]])]
    written = results.write(tmp_path / "r.json", "demo", tables, argv=["bench/demo.py", "--x", "a b"])
    read = results.read(tmp_path / "r.json")
    assert read == written
    assert read["command"] == ".venv/bin/python bench/demo.py --x 'a b'"
    assert read["tables"] == tables and read["date"].endswith("UTC") and read["machine"]["cpus"]


def test_the_readme_links_to_files_that_exist() -> None:
    """The site's build checks the pages' links; the README is not a page, so its links are checked here."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets, "no links found"
    missing = sorted({t for t in targets if "://" not in t and not (REPO / t).exists()})
    assert not missing, f"README.md links to missing files: {missing}"
