"""The generated benchmark pages, plots and README table (``make bench-docs``): drawn from the
stored results, with the command, commit and date of each run beside its numbers, and found
stale when the data changes (``tests/test_docs_site.py`` runs the ``--check`` itself)."""

from __future__ import annotations

import datetime
import importlib
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


# A number with a unit of time, size, rate, or a ratio or percentage: what a measurement looks like.
MEASURED = re.compile(
    r"(?<![\w.])(?P<value>\d[\d,]*(?:\.\d+)?)\s?(?P<unit>ms|us|ns|s|[KMGT]iB|[KMG]B/s|[KMG]B|x|%)(?![\w/])"
)

# The numbers with units on the pages that are not measurements, page by page: a setting's
# default, a limit, a test's tolerance or parameter, a figure the cost model computes. A reason
# that starts with "=" names the constant it is (``module.NAME``, times a factor after ``*``),
# and the test checks that the page says its value.
NOT_MEASURED: dict[str, dict[str, str]] = {
    "docs/calibration.md": {
        "5 us": "=planner.cost.DEFAULT_ALPHA",
        "100 GB/s": "=planner.cost.DEFAULT_BANDWIDTH",
        "4 KiB": "the sweep's smallest size, runtime.measure.calibrate.SWEEP_BYTES",
        "256 KiB": "a size of runtime.measure.calibrate.SWEEP_BYTES",
        "724 KiB": "a size of runtime.measure.calibrate.SWEEP_BYTES",
        "768 KiB": "the known break on an axis of 4, computed (tests/test_calibrate_dist.py)",
        "1 MiB": "=runtime.comm.collectives.GATHER_MESSAGES_BYTES",
        "16 MiB": "the sweep's largest size (runtime.measure.calibrate.SWEEP_BYTES), and a synthetic test's",
        "45 s": "=runtime.measure.calibrate.DEFAULT_BUDGET",
        "128 KiB": "torch's parallel grain of 32768 f32 elements",
        "1%": "=planner.fit.POOL_LEVEL",
        "10%": "the fit's outlier floor, and the noise of tests/test_calibration_fit.py's synthetic timings",
        "3%": "tests/test_calibration_fit.py: synthetic noise",
        "5%": "tests/test_calibration_fit.py: synthetic noise",
        "15%": "tests/test_calibration_fit.py: a synthetic jump",
        "16%": "tests/test_calibration_fit.py: the synthetic slopes' spread",
        "30%": "tests/test_calibration_fit.py: its tolerance",
        "50%": "tests/test_calibration_fit.py: a synthetic jump",
        "2x": "tests/test_calibration_fit.py: synthetic axes",
        "3x": "tests/test_calibration_fit.py: synthetic axes",
        "4x": "the ratio of two sweep sizes",
        "1 ms": "tests/test_calibration_fit.py: a synthetic axis's extra cost",
        "2.8 MiB": "tests/test_calibration_fit.py: a synthetic sweep's end",
    },
    "docs/gpu.md": {"10%": "tests/test_cuda.py's memory tolerance"},
    "docs/language.md": {"16 MiB": "=shardlang.parser.MAX_SOURCE_BYTES"},
    "docs/memory.md": {
        "32 MiB": "=planner.legs.DEFAULT_BUCKET_BYTES",
        "4 MiB": "=planner.legs.DEFAULT_OVERLAP_BUCKET_BYTES",
        "74 MiB": "the bench model's size (19.4M f32 parameters)",
        "64 KiB": "bench/bench_memory.py's mmap threshold, a setting",
    },
    "docs/reference/cost-model.md": {
        "5 us": "=planner.cost.DEFAULT_ALPHA",
        "100 GB/s": "=planner.cost.DEFAULT_BANDWIDTH",
        "2 x": "a formula of the cost table",
    },
    "docs/reference/optimizers.md": {
        "2 s": "=runtime.optim.commit.FAILURE_NOTICE",
        "5 s": "=runtime.measure.flops.DEFAULT_BUDGET",
    },
    "docs/reference/planner.md": {
        "5 us": "=planner.cost.DEFAULT_ALPHA",
        "100 GB/s": "=planner.cost.DEFAULT_BANDWIDTH",
    },
    "docs/reference/runtime.md": {"64 MiB": "=runtime.execution.executor.KEPT_BYTES"},
    "docs/reference/step-plans.md": {
        "32 MiB": "=planner.legs.DEFAULT_BUCKET_BYTES",
        "4 MiB": "=planner.legs.DEFAULT_OVERLAP_BUCKET_BYTES",
        "1 MiB": "the least of planner.bucket_cap.CAPS",
        "5%": "=planner.bucket_cap.SLACK",
        "1.25x": "=planner.bucket_cap.SLOWER",
        "4x": "=planner.bucket_cap.LARGER",
        "16 MiB": "=planner.bucket_cap.FLOOR",
        "25 MB": "DDP's default bucket_cap_mb",
        "64 MiB": "the cost model's cap for 7B on [dp=4, tp=8], computed by planner.bucket_cap",
        "2 GiB": "the cost model's cap for 7B on [dp=512, tp=8], computed",
        "20 us": "the cost model's latency in that example",
        "9.2x": "modeled by planner.bucket_cap",
        "1.49 s": "modeled by planner.bucket_cap",
        "162 ms": "modeled by planner.bucket_cap",
    },
    "docs/reference/suggest.md": {"32 MiB": "=planner.legs.DEFAULT_BUCKET_BYTES"},
    "docs/tutorials/calibrating.md": {
        "5 us": "=planner.cost.DEFAULT_ALPHA",
        "100 GB/s": "=planner.cost.DEFAULT_BANDWIDTH",
        "4 KiB": "the sweep's smallest size, runtime.measure.calibrate.SWEEP_BYTES",
        "16 MiB": "the sweep's largest size, runtime.measure.calibrate.SWEEP_BYTES",
    },
    "docs/tutorials/first-spec.md": {
        "5 us": "=planner.cost.DEFAULT_ALPHA",
        "100 GB/s": "=planner.cost.DEFAULT_BANDWIDTH",
    },
    "docs/tutorials/overlap.md": {"4 MiB": "=planner.legs.DEFAULT_OVERLAP_BUCKET_BYTES"},
    "docs/tutorials/specs-for-models.md": {"440 KiB": "the --memory budget the tutorial passes to suggest"},
}

UNITS = {
    "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "%": 0.01, "x": 1.0,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9,
    "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9,
}  # fmt: skip


def _blank(match: re.Match) -> str:
    return "\n" * match[0].count("\n")  # keep the line numbers


def typed_numbers(text: str) -> list[tuple[int, str]]:
    """(line, phrase) of each number that looks measured, outside the generated blocks, fenced
    code (commands and transcripts, checked by tests/test_docs_examples.py), inline code and
    HTML comments."""
    text = re.sub(r"<!-- bench:(\S+) -->.*?<!-- /bench:\1 -->", _blank, text, flags=re.DOTALL)
    text = re.sub(r"^( *)(```+|~~~+).*?^\1\2", _blank, text, flags=re.DOTALL | re.MULTILINE)
    text = re.sub(r"<!--.*?-->", _blank, text, flags=re.DOTALL)
    text = re.sub(r"`[^`\n]*(?:\n[^`\n]*)?`", _blank, text)
    return [(n, m[0]) for n, line in enumerate(text.splitlines(), 1) for m in MEASURED.finditer(line)]


def _hand_written_pages() -> list[Path]:
    """README.md and every page under docs/ but those bench/render_docs.py writes whole."""
    whole = set(render_docs.outputs(DATA)) - set(render_docs.BLOCKS)
    return [REPO / "README.md", *(p for p in sorted((REPO / "docs").rglob("*.md")) if p not in whole)]


def test_no_measured_number_is_typed_outside_the_generated_blocks() -> None:
    """Times, sizes, rates and ratios on README.md and every docs page come from stored runs,
    inside ``<!-- bench:NAME -->`` blocks that ``make bench-docs`` fills; the others are listed
    in :data:`NOT_MEASURED` with what they are."""
    typed = []
    for page in _hand_written_pages():
        name = str(page.relative_to(REPO))
        allowed = NOT_MEASURED.get(name, {})
        typed += [f"{name}:{n}: {phrase!r}" for n, phrase in typed_numbers(page.read_text()) if phrase not in allowed]
    assert not typed, (
        "numbers typed by hand where a measurement belongs: render them from docs/benchmarks/data/ "
        "(a block in bench/render_docs.py's BLOCKS), or, if one is a setting, a limit or a modeled "
        "figure, list it in NOT_MEASURED with what it is:\n  " + "\n  ".join(typed)
    )


def test_what_is_not_measured_is_on_its_page_and_says_its_constant() -> None:
    """Each entry of NOT_MEASURED is still on its page (no stale excuse), and one that names a
    constant says the constant's value."""
    for name, allowed in NOT_MEASURED.items():
        found = {phrase for _, phrase in typed_numbers((REPO / name).read_text())}
        assert not set(allowed) - found, f"{name}: no longer says {sorted(set(allowed) - found)}: drop them"
        for phrase, reason in allowed.items():
            if not reason.startswith("="):
                continue
            path, _, factor = reason[1:].partition("*")
            module, _, attr = path.rpartition(".")
            value = getattr(importlib.import_module(module), attr)
            value = value.total_seconds() if isinstance(value, datetime.timedelta) else value
            m = MEASURED.fullmatch(phrase)
            said = float(m["value"].replace(",", "")) * UNITS[m["unit"]]
            assert said == pytest.approx(value * float(factor or 1), rel=1e-9), (
                f"{name}: {phrase!r} but {path} = {value}"
            )


def test_the_guard_catches_a_typed_measurement() -> None:
    """The guard fails on a typed number, and not on one inside a block, code or a comment."""
    page = "Took 0.93x DDP.\n<!-- bench:x -->\n1.5 ms\n<!-- /bench:x -->\n`32 MiB` and\n```\n4 s\n```\n12 GiB held\n"
    assert typed_numbers(page) == [(1, "0.93x"), (9, "12 GiB")]
    assert typed_numbers("an inline <!-- bench:y -->1.40x<!-- /bench:y --> ratio, 3 ranks, 2(n-1)") == []
