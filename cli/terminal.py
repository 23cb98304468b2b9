"""What the terminal allows: colors only on a terminal, progress only on a terminal."""

from __future__ import annotations

import os
from typing import TextIO

import attrs

_CODES = {"bold": "1", "dim": "2", "green": "32", "yellow": "33", "cyan": "36"}


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or fake stream
        return False


@attrs.frozen
class Style:
    """ANSI styling that is a no-op unless ``enabled``."""

    enabled: bool = False

    @classmethod
    def for_stream(cls, stream: TextIO) -> Style:
        # NO_COLOR (https://no-color.org) and TERM=dumb switch colors off even on a terminal.
        wanted = "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"
        return cls(enabled=wanted and is_terminal(stream))

    def __call__(self, text: str, *styles: str) -> str:
        if not self.enabled or not styles:
            return text
        return f"\x1b[{';'.join(_CODES[s] for s in styles)}m{text}\x1b[0m"


class Progress:
    """``planning 12/50`` rewritten in place on a terminal; silent when the stream is piped."""

    def __init__(self, label: str, total: int, stream: TextIO) -> None:
        self.label = label
        self.total = total
        self.stream = stream
        self.count = 0
        self.active = is_terminal(stream) and total > 1

    def advance(self, what: str = "") -> None:
        self.count += 1
        if self.active:
            line = f"{self.label} {self.count}/{self.total} {what}"
            self.stream.write("\r\x1b[K" + line[:100])
            self.stream.flush()

    def close(self) -> None:
        if self.active:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
