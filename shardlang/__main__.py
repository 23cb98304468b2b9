"""``python -m shardlang``: the ``shardlang`` command."""

import sys

from cli.main import main

sys.exit(main())
