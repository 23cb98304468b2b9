"""``python -m shardlang``: the ``shardlang`` command (``cli.main``), for environments without
the console script on the PATH. The command lives in ``cli``, the layer that joins the
language, the planner and the runtime; this is only its door."""

from cli.main import entry

if __name__ == "__main__":
    entry()
