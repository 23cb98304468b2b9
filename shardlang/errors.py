"""The exceptions of shardlang.

Every error a user can cause is a :class:`ShardlangError`. When the error comes from text
(a layout string or a spec file) it carries the position, and ``str(error)`` renders as::

    gpt.shard:4:15: mesh axis 0 is used twice (by dim 0 and by dim 1)
        param = S0,S0 over mesh[2,2]
                  ^
"""

from __future__ import annotations

import attrs


@attrs.frozen
class SourcePosition:
    """A place in a text: 1-based line and column, the text of that line, and its file."""

    line: int
    column: int
    line_text: str
    filename: str | None = None

    @classmethod
    def in_text(cls, text: str, line: int, column: int, filename: str | None = None) -> SourcePosition:
        # Lines end at "\n" only, as lark counts them (str.splitlines also splits at "\r",
        # "\x0c", "\u2028", ... and would show the wrong line); a "\r" before it is not shown.
        lines = text.split("\n")
        line = max(1, min(line, len(lines)))
        line_text = lines[line - 1].removesuffix("\r")
        return cls(line=line, column=max(1, min(column, len(line_text) + 1)), line_text=line_text, filename=filename)

    @classmethod
    def at_offset(cls, text: str, offset: int, filename: str | None = None) -> SourcePosition:
        offset = max(0, min(offset, len(text)))
        line = text.count("\n", 0, offset) + 1
        column = offset - (text.rfind("\n", 0, offset) + 1) + 1
        return cls.in_text(text, line, column, filename)

    def prefix(self) -> str:
        return f"{self.filename or '<text>'}:{self.line}:{self.column}"

    def caret(self) -> str:
        # Tabs keep their width so the caret lines up under the offending character.
        pad = "".join("\t" if ch == "\t" else " " for ch in self.line_text[: self.column - 1])
        return f"    {self.line_text}\n    {pad}^"


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
