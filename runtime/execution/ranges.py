"""Named ranges of ``torch.profiler`` traces for the stages of an optimizer step, one naming
scheme for all: ``shardlang <where>: <what>`` (the table in docs/stacks/profiler.md). The
buckets' own start and wait ranges (``runtime.execution.buckets``) follow it too.

Nothing is built when no profiler runs: a name made from a bucket's members costs more than
the rest of a small step's bookkeeping, so it is passed as a function, called only under a
profiler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

BACKWARD, COMMIT = "backward", "commit"
UPDATE = "the update"  # between the stages "before the update" and "after the update"

# Looked up once: a step under overlap enters a range per gradient, and without a profiler the
# lookups and a new null context would be most of its cost.
# ``profiling()``: whether a profiler runs (a caller may ask once for many ranges).
profiling = torch.autograd._profiler_enabled
_NOTHING = contextlib.nullcontext()


def profiled(where: str, what: str | Callable[[], str]) -> contextlib.AbstractContextManager[object]:
    """The range ``shardlang {where}: {what}`` while a profiler runs, else nothing."""
    if not profiling():
        return _NOTHING
    return torch.profiler.record_function(f"shardlang {where}: {what if isinstance(what, str) else what()}")
