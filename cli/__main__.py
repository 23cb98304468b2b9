"""``python -m cli``: the ``shardlang`` command (the language package imports nothing above it,
so the command's module entry point lives here)."""

from cli.main import entry

entry()
