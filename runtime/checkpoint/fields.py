"""Typed reads of the parsed metadata (JSON): every value checked for its type before it is
used, and every failure a :class:`CheckpointError` naming the metadata file and the field,
as a path from the top (``tensors["w"].pieces[0].box``).

JSON nested deeper than any metadata could be (Python's decoder would give up with a
``RecursionError``) is reported at the field where it becomes too deep (:func:`too_deep`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from runtime.checkpoint.errors import CheckpointError

MAX_DEPTH = 64  # metadata nests 7 levels (pieces' boxes); optimizer hyperparameters a few more
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},]')


def field(path: str, key: str | int) -> str:
    """The path of ``key`` (an object's key or a list's index) inside the field ``path``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if _IDENTIFIER.match(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key)}]"


class Fields:
    """Reads values of the metadata file ``source``, each at a field path."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, message: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: field {path or '(the top)'} {message}")

    def get(self, obj: dict[str, Any], key: str, path: str) -> Any:
        if key not in obj:
            raise self.fail(field(path, key), "is missing")
        return obj[key]

    def object(self, value: Any, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"must be an object, not {_kind(value)}")
        return value

    def list(self, value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(path, f"must be a list, not {_kind(value)}")
        return value

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"must be a string, not {_kind(value)}")
        return value

    def count(self, value: Any, path: str, *, least: int = 0, below: int | None = None) -> int:
        """An integer ``least <= value`` (``< below`` when given); JSON's true and false are not."""
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(path, f"must be an integer, not {_kind(value)}")
        if value < least or (below is not None and value >= below):
            bounds = f"at least {least}" + (f" and below {below}" if below is not None else "")
            raise self.fail(path, f"is {value}; it must be {bounds}")
        return value


def too_deep(text: str, limit: int = MAX_DEPTH) -> str | None:
    """The field of the JSON ``text`` in which values nest more than ``limit`` deep (the
    innermost named field above that point, within the first levels), or ``None``. A scan
    of brackets and strings that needs no recursion (and no valid JSON)."""
    stack: list[list[Any]] = []  # per open bracket: [kind, the key or index of the value inside, expecting a key]
    for token in _TOKEN.finditer(text):
        t = token.group()
        if t in "{[":
            if len(stack) >= limit:
                return _named_prefix([frame[1] for frame in stack])
            stack.append(["{", None, True] if t == "{" else ["[", 0, False])
        elif t in "}]":
            if stack:
                stack.pop()
        elif t == ",":
            if stack and stack[-1][0] == "[":
                stack[-1][1] += 1
            elif stack:
                stack[-1][2] = True
        elif stack and stack[-1][2]:  # a key of an object
            stack[-1][2] = False
            try:
                stack[-1][1] = json.loads(t)
            except ValueError:
                stack[-1][1] = t[1:-1]
    return None


def _named_prefix(keys: list[Any], levels: int = 8) -> str:
    """The path of ``keys`` cut to its first ``levels`` and to the last object key in them."""
    keys = keys[:levels]
    while keys and not isinstance(keys[-1], str):
        keys.pop()
    path = ""
    for key in keys:
        path = field(path, key if isinstance(key, str | int) else "?")
    return path or "(the top)"


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number"}.get(
        type(value), type(value).__name__
    )
