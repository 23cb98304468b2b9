"""The benchmark pages' plots (SVG, matplotlib), drawn from the stored results only.

Each plot is a function of the results a page holds (``{stem: record}``, records as
``bench/results.py`` writes them) that returns a figure, or None when a result it needs is not
stored. Numbers come from the tables' cells (as the scripts printed them) or from a script's raw
``data``; nothing here is typed by hand. ``bench/render_docs.py`` saves them with
:func:`save`, which writes the same bytes for the same inputs (no date, fixed ids) and records
in the file which inputs it was drawn from (:func:`stamp`), so ``render_docs.py --check`` can
tell a stale plot without matplotlib.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

Record = dict[str, Any]
Plot = Callable[[dict[str, Record]], Any]

NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def needs(*stems: str) -> Callable[[Plot], Plot]:
    """The runs (data file stems) a plot reads: it is drawn when all are stored, and placed after
    the last of them on its page."""

    def mark(draw: Plot) -> Plot:
        draw.needs = stems  # type: ignore[attr-defined]
        return draw

    return mark


def number(cell: str) -> float | None:
    """The first number in a cell as printed (``"1.02 (zero)"`` -> 1.02, ``"-"`` -> None)."""
    m = NUMBER.search(cell or "")
    return float(m.group()) if m else None


def stamp(sources: Iterable[Path]) -> str:
    """What a plot was drawn from: the hash of this module's code and of each source file."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for path in sorted(sources):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return "shardlang-bench-plot sha256:" + digest.hexdigest()


def save(figure: Any, path: Path, description: str) -> None:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"Date": None, "Creator": "bench/render_docs.py", "Description": description}
    figure.savefig(path, format="svg", bbox_inches="tight", metadata=metadata)
    plt.close(figure)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "svg.hashsalt": "shardlang",  # fixed element ids: the same inputs give the same file
            "svg.fonttype": "none",  # text as text: readable and searchable in the SVG
            "font.size": 9,
            "axes.grid": True,
            "grid.alpha": 0.3,
        }
    )
    return plt


def _tables(record: Record, column: str) -> list[dict[str, Any]]:
    return [t for t in record["tables"] if column in t["columns"]]


def _column(table: dict[str, Any], column: str) -> list[tuple[str, float | None]]:
    at = table["columns"].index(column)
    return [(row[0], number(row[at])) for row in table["rows"]]


def _short(title: str) -> str:
    return title.split(" (")[0]


def _hbars(
    groups: list[tuple[str, list[tuple[str, float]]]], xlabel: str, title: str, line: float | None = None
) -> Any:
    """Horizontal bars: one colour per group, one bar per label (labels in first-seen order)."""
    plt = _pyplot()
    labels = list(dict.fromkeys(label for _, bars in groups for label, _ in bars))
    height = 0.8 / max(len(groups), 1)
    figure, ax = plt.subplots(figsize=(8, 0.45 * len(labels) * max(1, len(groups) * 0.6) + 1.2))
    for k, (name, bars) in enumerate(groups):
        values = dict(bars)
        ys = [i + k * height for i, label in enumerate(labels) if label in values]
        ax.barh(ys, [values[label] for label in labels if label in values], height, label=name)
    ax.set_yticks([i + height * (len(groups) - 1) / 2 for i in range(len(labels))], labels)
    ax.invert_yaxis()
    if line is not None:
        ax.axvline(line, color="black", linewidth=0.8)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    if len(groups) > 1:
        ax.legend()
    figure.tight_layout()
    return figure


@needs("step")
def step_speed(records: dict[str, Record]) -> Any:
    """bench_step: each model's training step time against DDP's, per variant."""
    if "step" not in records:
        return None
    groups = [
        (_short(t["title"]), [(v, x) for v, x in _column(t, "x DDP") if x is not None])
        for t in _tables(records["step"], "train step ms")
    ]
    return _hbars(groups, "train step time, x DDP's (lower is faster)", "Training step, 4 gloo ranks", line=1.0)


@needs("memory")
def memory_held(records: dict[str, Record]) -> Any:
    """bench_memory: held memory per rank and the optimizer's prediction, per variant."""
    if "memory" not in records:
        return None
    rows: dict[str, tuple[float, float | None]] = {}
    for t in records["memory"]["tables"]:
        if t["title"].startswith("4 ranks"):
            at = t["columns"].index("predicted MiB")
            for row in t["rows"]:
                rows.setdefault(row[0], (number(row[1]) or 0.0, number(row[at])))
    plt = _pyplot()
    labels = list(rows)
    figure, ax = plt.subplots(figsize=(8, 0.4 * len(labels) + 1.2))
    ax.barh(range(len(labels)), [rows[k][0] for k in labels], 0.7, label="held MiB (measured)")
    predicted = [(i, rows[k][1]) for i, k in enumerate(labels) if rows[k][1] is not None]
    ax.plot([p for _, p in predicted], [i for i, _ in predicted], "kd", label="memory_report() prediction")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("MiB per rank (the largest over ranks)")
    ax.set_title("Memory per rank, 4 gloo ranks")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    figure.tight_layout()
    return figure


@needs("memory", "memory_ranks")
def memory_ranks(records: dict[str, Record]) -> Any:
    """bench_memory at 2, 4 and 8 ranks: held memory against DDP's, per variant in every run."""
    if "memory" not in records or "memory_ranks" not in records:
        return None
    by_variant: dict[str, dict[int, float]] = {}
    for stem in ("memory_ranks", "memory"):
        for t in records[stem]["tables"]:
            ranks = int(number(t["title"]) or 0)
            for variant, ratio in _column(t, "x DDP"):
                if ratio is not None:
                    by_variant.setdefault(variant, {})[ranks] = ratio
    plt = _pyplot()
    figure, ax = plt.subplots(figsize=(8, 4.5))
    for variant, points in by_variant.items():
        if len(points) > 1:
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], "o-", label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xticks(
        sorted({x for p in by_variant.values() for x in p}),
        [str(x) for x in sorted({x for p in by_variant.values() for x in p})],
    )
    ax.set_xlabel("ranks")
    ax.set_ylabel("held memory per rank, x DDP's")
    ax.set_title("Memory per rank against DDP's, by number of ranks")
    ax.legend(fontsize=7)
    figure.tight_layout()
    return figure


def _lines(table: dict[str, Any], x_label: str, y_label: str, title: str, columns: list[str] | None = None) -> Any:
    plt = _pyplot()
    figure, ax = plt.subplots(figsize=(8, 4.5))
    xs = [number(row[0]) for row in table["rows"]]
    for column in columns or table["columns"][1:]:
        ys = [number(c) for c in (row[table["columns"].index(column)] for row in table["rows"])]
        ax.plot(xs, ys, "o-", label=column)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(title)
    ax.legend(fontsize=7)
    figure.tight_layout()
    return figure


@needs("collectives")
def collectives(records: dict[str, Record]) -> Any:
    """bench_collectives: each gloo collective's time by buffer size."""
    if "collectives" not in records:
        return None
    table = records["collectives"]["tables"][0]
    columns = [c for c in table["columns"][1:] if " / " not in c]
    return _lines(table, "buffer KiB", "median ms", "gloo collectives, 4 ranks", columns)


@needs("calibration")
def calibration_scatter(records: dict[str, Record]) -> Any:
    """bench_calibration: each chosen plan's predicted time against its measured time, per model."""
    if "calibration" not in records:
        return None
    pairs = records["calibration"]["data"]["pairs"]
    plt = _pyplot()
    figure, ax = plt.subplots(figsize=(6, 6))
    for which, marker in (("default", "x"), ("calibrated", "o")):
        ax.scatter(
            [r[f"{which}_measured"] * 1e3 for r in pairs],
            [r[f"{which}_predicted"] * 1e3 for r in pairs],
            marker=marker,
            label=f"{which} model",
            alpha=0.7,
        )
    values = [r[f"{w}_{k}"] * 1e3 for r in pairs for w in ("default", "calibrated") for k in ("measured", "predicted")]
    low, high = min(v for v in values if v > 0), max(values)
    ax.plot([low, high], [low, high], "k-", linewidth=0.8, label="predicted = measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured ms (median of the slowest rank)")
    ax.set_ylabel("predicted ms")
    ax.set_title("Chosen plans: predicted against measured")
    ax.legend()
    figure.tight_layout()
    return figure


@needs("calibration_sweep")
def calibration_sweep(records: dict[str, Record]) -> Any:
    """bench_calibration_sweep: each kind's median time by size (the sweep's medians over runs)."""
    if "calibration_sweep" not in records:
        return None
    plt = _pyplot()
    figure, ax = plt.subplots(figsize=(8, 4.5))
    for t in records["calibration_sweep"]["tables"]:
        if "median" in t["columns"]:
            points = [(number(row[0]), number(row[t["columns"].index("median")])) for row in t["rows"]]
            points = [(x, y) for x, y in points if x and y]
            ax.plot([x for x, _ in points], [y for _, y in points], "o-", label=t["title"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("table KiB (the bytes the cost model counts)")
    ax.set_ylabel("median ms")
    ax.set_title("Calibration sweep, [4] gloo ranks")
    ax.legend(fontsize=7)
    figure.tight_layout()
    return figure


@needs("planner_speed")
def planner_speed(records: dict[str, Record]) -> Any:
    """bench_planner_speed: the median plan time per mesh, ours and DTensor's where both plan."""
    if "planner_speed" not in records:
        return None
    table = records["planner_speed"]["tables"][0]
    ours = [(row[0], number(row[2])) for row in table["rows"]]
    both = [(row[0], [float(x) for x in NUMBER.findall(row[6])[:2]]) for row in table["rows"]]
    groups = [
        ("all pairs, ours", [(m, v) for m, v in ours if v is not None]),
        ("pairs DTensor can express, ours", [(m, v[0]) for m, v in both if len(v) == 2]),
        ("pairs DTensor can express, DTensor", [(m, v[1]) for m, v in both if len(v) == 2]),
    ]
    figure = _hbars(groups, "median ms per pair", "Planner speed per mesh")
    figure.axes[0].set_xscale("log")
    return figure


@needs("optimizer")
def optimizer_step(records: dict[str, Record]) -> Any:
    """bench_optim: the optimizer step's median time per optimizer and layout."""
    table = next((t for t in records["optimizer"]["tables"] if "step ms" in t["columns"]), None)
    if table is None:
        return None
    bars = [(label, ms) for label, ms in _column(table, "step ms") if ms is not None]
    return _hbars([("step ms", bars)], "median step ms", "Optimizer step")


@needs("reshard")
def reshard(records: dict[str, Record]) -> Any:
    """bench_reshard: each pair's reshard time against DTensor's, per tensor size."""
    table = next((t for t in records["reshard"]["tables"] if "ours/DTensor" in t["columns"]), None)
    if table is None:
        return None
    mb, ratio = table["columns"].index("MB"), table["columns"].index("ours/DTensor")
    sizes = list(dict.fromkeys(row[mb] for row in table["rows"]))
    groups = [
        (f"{size} MB", [(row[0], number(row[ratio]) or 0.0) for row in table["rows"] if row[mb] == size])
        for size in sizes
    ]
    return _hbars(groups, "reshard time, x DTensor's (lower is faster)", "Reshard, 4 gloo ranks", line=1.0)
