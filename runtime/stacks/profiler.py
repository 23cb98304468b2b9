"""A profiled optimizer step saved for ``shardlang timeline`` (docs/stacks/profiler.md).

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model(x).loss.backward()
        optimizer.step()
    save_trace(profile, optimizer, "trace.rank{rank}.json")

Every bucket of a step shows in ``torch.profiler``'s trace as two named ranges, its start and
its wait, and so does every other stage of the step: the math, the commit flags, backward's
hooks (docs/stacks/profiler.md has the table). :func:`save_trace` writes the trace as
``profile.export_chrome_trace`` does (it opens in Perfetto as before) and adds, under the key
:data:`TRACE_KEY`, the optimizer's step plan: what each bucket moves and the seconds the cost
model gave it. ``shardlang timeline TRACE.json`` draws the two side by side.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from runtime.optim import OptimizerError, ShardedOptimizer

# The trace's top-level key holding the step plan; the Chrome trace format keeps other keys as
# the trace's metadata, so Perfetto and TensorBoard read the file as before.
TRACE_KEY = "shardlang"


def save_trace(profile: torch.profiler.profile, optimizer: Any, path: str | os.PathLike[str]) -> Path | None:
    """Write the finished ``profile``'s Chrome trace to ``path`` with ``optimizer``'s step plan
    (a sharded optimizer, or one that accelerate or Lightning wraps). ``{rank}`` in the path is
    replaced by this process's rank and every rank writes its own; without it only rank 0
    writes. Call it after the profiled step, before a step whose parameters or bucket size
    differ. Returns the path written, or ``None`` on a rank that writes nothing."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, ShardedOptimizer):
        raise OptimizerError(f"save_trace needs a sharded optimizer, got {type(inner).__name__}")
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    text = str(path)
    if "{rank}" not in text and rank != 0:
        return None
    target = Path(text.replace("{rank}", str(rank)))
    target.parent.mkdir(parents=True, exist_ok=True)
    # torch writes the trace to a file only: one beside the target, read back and replaced.
    handle, scratch = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
    os.close(handle)
    try:
        profile.export_chrome_trace(scratch)
        trace = json.loads(Path(scratch).read_text(encoding="utf-8"))
        trace[TRACE_KEY] = {
            "rank": rank,
            "world_size": world_size,
            "optimizer": type(inner).__name__,
            "step_plan": inner.step_plan().to_json(),
        }
        Path(scratch).write_text(json.dumps(trace), encoding="utf-8")
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.remove(scratch)
    return target
