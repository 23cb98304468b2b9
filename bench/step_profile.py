"""Reading a profiled training step (``bench_step.py``): the collectives and the allocator's
peak inside each variant's last training step and ``optimizer.step()``, from the windows the
bench marks with ``record_function("bench|VARIANT|train")`` and ``"bench|VARIANT|step"``; and
the bytes a variant holds after it (tensors, optimizer states, DDP's buckets)."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import profile


def walk(nodes: Iterable[Any]) -> Iterator[Any]:
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children)


MESSAGES = ("c10d::send", "c10d::recv_")  # the profiler's names of point-to-point messages


def profile_counts(prof: profile, keys: Iterable[str]) -> dict[str, dict[str, int]]:
    """Per variant, from the profiled steps: c10d collectives (barriers excluded) inside its
    last training step and its last ``optimizer.step()``, and the allocator's peak above the
    start of each (allocation events of all threads, in time order)."""
    from torch._C._profiler import _EventType

    windows: dict[str, list[tuple[int, int]]] = {}
    events: list[tuple[int, bool]] = []  # (start, whether a point-to-point message)
    allocations: list[tuple[int, int]] = []
    for e in walk(prof.profiler.kineto_results.experimental_event_tree()):
        if e.typed[0] == _EventType.Allocation:
            if e.typed[1].device.type == "cpu":
                allocations.append((e.start_time_ns, e.typed[1].alloc_size))
        elif e.name.startswith("bench|"):
            windows.setdefault(e.name, []).append((e.start_time_ns, e.end_time_ns))
        elif e.name.startswith("c10d::") and "barrier" not in e.name:
            events.append((e.start_time_ns, e.name in MESSAGES))
    events.sort()
    # Messages posted one after another are one collective (runtime.comm.collectives: gloo's all_gather).
    collectives = [t for k, (t, message) in enumerate(events) if not (message and k and events[k - 1][1])]
    allocations.sort()
    times = [t for t, _ in allocations]
    held = list(itertools.accumulate(size for _, size in allocations))

    def count(start: int, end: int) -> int:
        return bisect.bisect_right(collectives, end) - bisect.bisect_left(collectives, start)

    def peak(start: int, end: int) -> int:
        i, j = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        base = held[i - 1] if i else 0
        return max([base, *held[i:j]]) - base

    out = {}
    for key in keys:
        train = max(windows.get(f"bench|{key}|train", [(0, 0)]))
        step = max(windows.get(f"bench|{key}|step", [(0, 0)]))
        out[key] = {
            "collectives_train": count(*train),
            "collectives_step": count(*step),
            "peak_train": peak(*train),
            "peak_step": peak(*step),
        }
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def nbytes(tensors: Iterable[Any]) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors if isinstance(t, torch.Tensor))


def torch_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return nbytes(v for state in optimizer.state.values() for v in state.values())


def ddp_bucket_bytes(module: nn.Module) -> int | None:
    """Bytes of the DDP reducer's gradient buckets (they exist beside ``param.grad``)."""
    try:
        data = module._get_ddp_logging_data()  # type: ignore[operator]
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
        return sum(int(s) for s in str(sizes).split(",") if s.strip())
    except (AttributeError, RuntimeError, ValueError):
        return None


def attribute_bytes(optimizer: Any, name: str) -> int | None:
    """``optimizer.<name>`` as a number of bytes, called if it is a method; None if absent."""
    value = getattr(optimizer, name, None)
    if callable(value):
        value = value()
    return int(value) if isinstance(value, (int, float)) else None
