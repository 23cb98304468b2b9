"""The benchmarks' one JSON format, so that their tables on the docs site are generated, never typed.

    parser = argparse.ArgumentParser(...)
    results.add_json_option(parser)
    ...
    results.write(args.json, "collectives", [results.table("Median ms", ["buffer", ...], rows)], data=raw)

A file holds what a table needs to be read a year later: the command that produced it, the
commit (and whether the tree had uncommitted changes), the date, the machine (platform, CPUs,
load average when written, Python and torch versions), then the script's tables (title,
columns, rows of cells as printed, a note) and optionally its raw numbers under ``data``.
Scripts that print markdown tables need not build them: ``results.main(main, "Name")`` runs
their ``main`` with ``--json PATH`` taken off the command line and keeps what they print.
``bench/render_docs.py`` (``make bench-docs``) turns the files stored under
``docs/benchmarks/data/`` into the benchmark pages under ``docs/benchmarks/``, their plots, and
the generated blocks of README.md and the docs pages that quote them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import io
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

SCHEMA = "shardlang.bench/1"
REPO = Path(__file__).resolve().parent.parent


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the results with their command, commit, date and machine here "
        "(store under docs/benchmarks/data/ and run `make bench-docs` to put them on the docs site)",
    )


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], note: str = "") -> dict[str, Any]:
    """One table: cells are written as given (format numbers as the script prints them)."""
    if any(len(row) != len(columns) for row in rows):
        raise ValueError(f"table {title!r}: every row needs {len(columns)} cells")
    return {"title": title, "columns": list(columns), "rows": [[str(c) for c in row] for row in rows], "note": note}


class _Tee(io.TextIOBase):
    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


@contextlib.contextmanager
def printed() -> Iterator[io.StringIO]:
    """What the block prints, still printed as it goes: for scripts that print markdown tables,
    whose tables :func:`markdown_tables` then reads back."""
    kept = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, kept)):
        yield kept


def markdown_tables(text: str) -> list[dict[str, Any]]:
    """The markdown tables in ``text``, each titled by the nearest non-empty line before it; the
    lines after a table, up to the next one's title, are its note. A cell may hold ``\\|``."""
    found, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if not (lines[i].startswith("|") and i + 1 < len(lines) and set(lines[i + 1]) <= set("|-: ")):
            i += 1
            continue
        at = next((j for j in range(i - 1, -1, -1) if lines[j].strip()), None)
        rows = _rows(lines, i)
        found.append((at, i, i + len(rows), rows))
        i += len(rows)
    tables = []
    for k, (at, _, end, rows) in enumerate(found):
        title = "" if at is None else lines[at].strip()
        cells = [[_unescape(c.strip()) for c in _CELL.split(row.strip().strip("|"))] for row in rows]
        body = [row for row in cells[2:] if len(row) == len(cells[0])]
        stop = found[k + 1][0] if k + 1 < len(found) and found[k + 1][0] is not None else len(lines)
        note = " ".join(line.strip() for line in lines[end:stop] if line.strip())
        tables.append(table(title.replace("**", "").strip().rstrip(":"), cells[0], body, note))
    return tables


_CELL = re.compile(r"(?<!\\) \| ")


def _unescape(cell: str) -> str:
    return cell.replace("\\|", "|")


def _rows(lines: list[str], start: int) -> list[str]:
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[start:end]


def main(run: Callable[[], None], bench: str) -> None:
    """Run a script's ``main`` with ``--json PATH`` taken from the command line: what it prints
    is kept, and its markdown tables (or, without any, the printed text) written with their
    provenance. For scripts that print their own tables; ``write`` is for those that build them."""
    argv = list(sys.argv)
    path = None
    if "--json" in sys.argv[1:]:
        at = sys.argv.index("--json", 1)
        if at + 1 >= len(sys.argv):
            sys.exit("--json needs a PATH")
        path = Path(sys.argv[at + 1])
        del sys.argv[at : at + 2]
    with printed() as shown:
        run()
    text = shown.getvalue()
    tables = markdown_tables(text)
    write(path, bench, tables, data=None if tables else {"printed": text}, argv=argv)


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def provenance(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Where and how the numbers were made."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0])
    if script.is_absolute() and script.is_relative_to(REPO):
        argv[0] = str(script.relative_to(REPO))
    return {
        "command": " ".join([".venv/bin/python", *(shlex.quote(a) for a in argv)]),
        # A copy of the tree made with git archive (the GPU machine's) names its commit in
        # SHARDLANG_COMMIT: git there would find whatever repository holds the copy.
        "commit": os.environ.get("SHARDLANG_COMMIT") or _git("rev-parse", "HEAD") or None,
        # Tracked files changed and not committed: the numbers are of a tree no commit names.
        "dirty": "SHARDLANG_COMMIT" not in os.environ and bool(_git("status", "--porcelain", "--untracked-files=no")),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
            "torch": _version("torch"),
        },
    }


def write(
    path: Path | None,
    bench: str,
    tables: Sequence[dict[str, Any]],
    *,
    data: Any = None,
    argv: Sequence[str] | None = None,
) -> dict[str, Any] | None:
    """Write the results to ``path`` (nothing when it is None) and say so; returns what was written."""
    if path is None:
        return None
    record = {"schema": SCHEMA, "bench": bench, **provenance(argv), "tables": list(tables), "data": data}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return record


def read(path: Path) -> dict[str, Any]:
    """A results file, checked to be of this format."""
    record = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a benchmark results file ({SCHEMA})")
    for key in ("bench", "command", "commit", "date", "machine", "tables"):
        if key not in record:
            raise ValueError(f"{path}: no field {key!r}")
    return record
