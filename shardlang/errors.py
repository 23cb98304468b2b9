"""The exceptions of shardlang.

Every error a user can cause is a :class:`ShardlangError`. When the error comes from text
(a layout string or a spec file) it carries the position, and ``str(error)`` renders as::

    gpt.shard:4:15: mesh axis 0 is used twice (by dim 0 and by dim 1)
        param = S0,S0 over mesh[2,2]
                  ^
"""

from __future__ import annotations

import bisect
import re

import attrs

LINE_BREAK = re.compile("\r\n|[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
"""Where a line ends, in every line and column shardlang reports: at each line break that
``str.splitlines`` knows (``\\r\\n`` is one break). The grammar counts the same characters as
whitespace and ends a comment at any of them, so a line shown with an error never holds one."""


@attrs.frozen
class SourcePosition:
    """A place in a text: 1-based line and column, the text of that line, and its file."""

    line: int
    column: int
    line_text: str
    filename: str | None = None

    @classmethod
    def in_text(cls, text: str, line: int, column: int, filename: str | None = None) -> SourcePosition:
        """The position at 1-based ``line`` and ``column`` of ``text``, lines ending at every line
        break :data:`LINE_BREAK` matches (clamped to the text)."""
        return LineIndex(text).at_line(line, column, filename)

    @classmethod
    def at_offset(cls, text: str, offset: int, filename: str | None = None) -> SourcePosition:
        """The position of the character at ``offset`` of ``text`` (0-based, in characters)."""
        return LineIndex(text).at_offset(offset, filename)

    def prefix(self) -> str:
        return f"{self.filename or '<text>'}:{self.line}:{self.column}"

    def caret(self) -> str:
        # Tabs keep their width so the caret lines up under the offending character.
        pad = "".join("\t" if ch == "\t" else " " for ch in self.line_text[: self.column - 1])
        return f"    {self.line_text}\n    {pad}^"


class LineIndex:
    """Where every line of one text starts, so that positions cost a binary search (a spec of a
    million tensors gives each its position)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.starts = [0]
        self.ends: list[int] = []
        for match in LINE_BREAK.finditer(text):
            self.ends.append(match.start())
            self.starts.append(match.end())
        self.ends.append(len(text))

    def at_offset(self, offset: int, filename: str | None = None) -> SourcePosition:
        offset = max(0, min(offset, len(self.text)))
        index = bisect.bisect_right(self.starts, offset) - 1
        # An offset inside a two-character break (between "\r" and "\n") is the end of its line.
        column = min(offset, self.ends[index]) - self.starts[index] + 1
        return self.at_line(index + 1, column, filename)

    def at_line(self, line: int, column: int, filename: str | None = None) -> SourcePosition:
        line = max(1, min(line, len(self.starts)))
        line_text = self.text[self.starts[line - 1] : self.ends[line - 1]]
        column = max(1, min(column, len(line_text) + 1))
        return SourcePosition(line=line, column=column, line_text=line_text, filename=filename)


class ShardlangError(Exception):
    """Base of every error shardlang raises on bad input."""

    def __init__(self, message: str, position: SourcePosition | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.position = position

    def at(self, position: SourcePosition | None) -> ShardlangError:
        """The same error placed at ``position`` (kept if it already has one)."""
        if self.position is not None or position is None:
            return self
        return type(self)(self.message, position)

    def __str__(self) -> str:
        if self.position is None:
            return self.message
        return f"{self.position.prefix()}: {self.message}\n{self.position.caret()}"

    def to_json(self) -> dict[str, object]:
        pos = self.position
        return {
            "file": pos.filename if pos else None,
            "line": pos.line if pos else None,
            "column": pos.column if pos else None,
            "message": self.message,
            "kind": type(self).__name__,
        }


class ParseError(ShardlangError):
    """The text does not follow the grammar."""


class LayoutError(ShardlangError):
    """A mesh or layout that is well formed but means nothing (axis used twice, ...)."""


class SpecError(ShardlangError):
    """A spec file that parses but is inconsistent (duplicate tensor, rank mismatch, ...)."""


class InteropError(ShardlangError):
    """A layout that another framework's representation cannot express, or the reverse."""
