"""Turning DOT text into the asked format with Graphviz's ``dot``, and writing it out."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import BinaryIO

from cli.terminal import is_terminal
from shardlang.errors import ShardlangError

FORMATS = ("dot", "svg", "png")
_SUFFIXES = {".dot": "dot", ".gv": "dot", ".svg": "svg", ".png": "png"}
INSTALL_DOT = (
    "Graphviz's `dot` program was not found on PATH, so no {fmt} can be drawn. Install it: "
    "Debian/Ubuntu `sudo apt-get install graphviz`, Fedora `sudo dnf install graphviz`, "
    "macOS `brew install graphviz`, conda `conda install -c conda-forge graphviz`. "
    "Meanwhile `--format dot` writes the picture as DOT text, without `dot`."
)


class RenderError(ShardlangError):
    """``dot`` is missing or failed, or the output cannot be written."""


def output_format(fmt: str | None, output: str | None) -> str:
    """The asked format, else the one the output file's suffix names, else SVG."""
    if fmt is not None:
        return fmt
    if output and output != "-":
        return _SUFFIXES.get(Path(output).suffix.lower(), "svg")
    return "svg"


def draw(dot_text: str, fmt: str) -> bytes:
    if fmt == "dot":
        return dot_text.encode()
    import graphviz  # here, not at the top: only drawing needs it, and every command imports this module

    try:
        return graphviz.pipe("dot", fmt, dot_text.encode(), quiet=True)
    except graphviz.ExecutableNotFound:
        raise RenderError(INSTALL_DOT.format(fmt=fmt.upper())) from None
    except graphviz.CalledProcessError as e:
        detail = (e.stderr or b"").decode(errors="replace").strip()
        raise RenderError(f"`dot -T{fmt}` failed: {detail or e}") from None


def write(data: bytes, output: str | None, fmt: str, stdout: BinaryIO | None = None) -> str | None:
    """Write to ``output`` (``-`` or nothing: standard output); the path written, if a file."""
    if output is None or output == "-":
        if fmt == "png" and is_terminal(sys.stdout):
            raise RenderError("a PNG is binary; give -o FILE.png (or pipe the output)")
        stream = stdout or sys.stdout.buffer
        stream.write(data)
        stream.flush()
        return None
    path = Path(output)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    except OSError as e:
        raise RenderError(f"cannot write {output}: {e.strerror or e}") from None
    return str(path)
