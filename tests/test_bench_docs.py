"""The generated benchmark pages, plots and README table (``make bench-docs``): drawn from the
stored results, with the command, commit and date of each run beside its numbers, and found
stale when the data changes (``tests/test_docs_site.py`` runs the ``--check`` itself)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import plots  # bench/plots.py
import render_docs  # bench/render_docs.py

DATA = render_docs.DATA


def _records() -> dict[str, dict]:
    return render_docs._records(DATA)


@pytest.fixture
def data_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "data"
    shutil.copytree(DATA, copy)
    return copy


def _edit(path: Path, change) -> None:
    record = json.loads(path.read_text(encoding="utf-8"))
    change(record)
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def test_the_readme_table_is_rendered_from_the_stored_runs() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- bench:speed-and-memory -->\n(.*?)\n<!-- /bench:speed-and-memory -->", readme, re.DOTALL)
    assert block, "README.md has no generated speed-and-memory block"
    records = _records()
    assert block[1] == render_docs.readme_table(records)
    for stem in ("step", "memory"):  # each run's command, commit and date under the table
        record = records[stem]
        assert record["command"] in block[1] and record["commit"][:10] in block[1] and record["date"] in block[1]
    memory = next(t for t in records["memory"]["tables"] if t["title"].startswith("4 ranks"))
    for row in memory["rows"]:  # every measured variant with its held MiB, as the run printed it
        cells = rf"^\| {re.escape(row[0])} \|.*\| {re.escape(row[1])} \| {re.escape(row[2])} \|"
        assert re.search(cells, block[1], re.M), row[0]


def test_a_changed_number_makes_the_readme_and_pages_stale(data_copy: Path) -> None:
    """The check can fail: a held MiB changed in the stored run changes the README's table, the
    page that shows the run and the plot drawn from it."""

    def change(record: dict) -> None:
        next(t for t in record["tables"] if t["title"].startswith("4 ranks"))["rows"][3][1] = "999.9"

    assert not render_docs.stale(DATA), "run `make bench-docs`"
    _edit(data_copy / "memory.json", change)
    assert "999.9" in render_docs.readme_table(render_docs._records(data_copy))
    stale = render_docs.stale(data_copy)
    assert "README.md" in stale
    assert "docs/benchmarks/history/training-step.md" in stale
    assert "docs/benchmarks/plots/memory_held.svg" in stale
    assert "docs/benchmarks/plots/step_speed.svg" not in stale  # drawn from step.json only


def test_every_run_on_the_pages_shows_its_command_commit_and_date() -> None:
    records = _records()
    shown = set()
    for path, text in render_docs.outputs(DATA).items():
        if path.suffix != ".md" or path.parent.name not in ("benchmarks", "history"):
            continue
        for m in re.finditer(r"^#{2,3} .*\(`(\w+)\.json`\)", text, re.M):
            record = records[m[1]]
            after = text[m.end() : m.end() + 2000]
            assert f"- command: `{record['command']}`" in after, m[0]
            assert f"commit: {record['commit'][:10]}" in after and f"date: {record['date']}" in after, m[0]
            shown.add(m[1])
    assert shown == set(records), f"runs on no page: {set(records) - shown}"


def test_every_page_under_docs_benchmarks_is_generated() -> None:
    """No hand-typed page: each is an output of the renderer (the index's numbers sit in blocks)."""
    generated = set(render_docs.outputs(DATA))
    for page in (REPO / "docs" / "benchmarks").rglob("*.md"):
        assert page in generated, f"{page.relative_to(REPO)} is not written by bench/render_docs.py"
        text = page.read_text(encoding="utf-8")
        assert render_docs.GENERATED in text or "<!-- bench:" in text, page


def test_the_plots_are_drawn_from_the_stored_results(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="pip install -e '.[test]' installs matplotlib")
    written = render_docs.draw(DATA, tmp_path)
    jobs = render_docs.plot_jobs(DATA)
    assert {p.name for p in written} == {p.name for p in jobs} and len(written) >= 5
    for path in written:
        svg = path.read_text(encoding="utf-8")
        assert svg.startswith("<?xml") and "<svg" in svg
        assert jobs[render_docs.PLOTS / path.name][1] in svg  # the stamp of its inputs
        committed = render_docs.PLOTS / path.name
        assert committed.exists(), f"{committed} missing: run `make bench-docs`"
        assert jobs[committed][1] in committed.read_text(encoding="utf-8")
    again = render_docs.draw(DATA, tmp_path / "again")
    assert [p.read_bytes() for p in written] == [p.read_bytes() for p in again], "the same data drew other bytes"


def test_the_plots_show_the_stored_numbers() -> None:
    pytest.importorskip("matplotlib", reason="pip install -e '.[test]' installs matplotlib")
    records = _records()
    figure = plots.step_speed(records)
    tables = [t for t in records["step"]["tables"] if "train step ms" in t["columns"]]
    bars = [p for p in figure.axes[0].patches]
    expected = [plots.number(row[t["columns"].index("x DDP")]) for t in tables for row in t["rows"]]
    assert sorted(round(b.get_width(), 6) for b in bars) == sorted(expected)
    labels = [t.get_text() for t in figure.axes[0].get_yticklabels()]
    assert labels == list(dict.fromkeys(row[0] for t in tables for row in t["rows"]))

    pairs = records["calibration"]["data"]["pairs"]
    figure = plots.calibration_scatter(records)
    for collection, which in zip(figure.axes[0].collections, ("default", "calibrated"), strict=True):
        points = collection.get_offsets().tolist()
        assert points == [[r[f"{which}_measured"] * 1e3, r[f"{which}_predicted"] * 1e3] for r in pairs]

    figure = plots.memory_held(records)
    held = [b.get_width() for b in figure.axes[0].patches]
    memory = next(t for t in records["memory"]["tables"] if t["title"].startswith("4 ranks"))
    assert held[: len(memory["rows"])] == [float(row[1]) for row in memory["rows"]]


MEASURED = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|us|s|MiB|GiB|KiB|MB|GB/s|x|%)(?!\w)")


@pytest.mark.parametrize("name", ["README.md", "docs/index.md", "docs/benchmarks/index.md"])
def test_no_measured_number_is_typed_outside_the_generated_blocks(name: str) -> None:
    """Times, sizes, rates and ratios on these pages come from stored runs, inside the blocks."""
    text = (REPO / name).read_text(encoding="utf-8")
    text = re.sub(r"<!-- bench:(\S+) -->.*?<!-- /bench:\1 -->", "", text, flags=re.DOTALL)
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # commands and transcripts (checked elsewhere)
    typed = [line for line in text.splitlines() if MEASURED.search(line)]
    assert not typed, f"{name}: numbers typed by hand (render them from docs/benchmarks/data/): {typed}"
