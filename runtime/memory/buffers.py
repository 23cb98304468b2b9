"""Working buffers kept between steps.

A training step moves and updates buffers of megabytes. Allocated anew each step, such a buffer
costs more than the work on it: the allocator hands large blocks back to the system when they
are freed, so every page faults again on first touch (a flat AdamW update of 0.9M elements
takes 3 ms into kept buffers and 7-10 ms into new ones on this project's CPU machines). The
sharded optimizers and the buckets they run therefore keep their buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Scratch:
    """Buffers kept between steps, by name, grown to the largest size asked (see the module
    doc for why they are kept); :meth:`take` gives a 1-d view of the first ``numel``. With
    ``keep_at_most`` (bytes), a larger request gets a new buffer of its own, not kept."""

    def __init__(self, keep_at_most: int | None = None) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self._keep_at_most = keep_at_most
        self.allocations = 0  # buffers allocated so far: views taken since are of the buffers now

    def take(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self._keep_at_most is not None and numel * dtype.itemsize > self._keep_at_most:
            return torch.empty(numel, dtype=dtype, device=device)
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
            self.allocations += 1
        return buffer[:numel]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def nbytes_of(self, named: Callable[[str], bool]) -> int:
        """Bytes of the buffers whose names ``named`` accepts."""
        return sum(b.numel() * b.element_size() for (name, *_), b in self._buffers.items() if named(name))


class KeptViews:
    """Views that every step makes alike from the same tensors (a bucket's places in its send
    buffer, a parameter's piece, a flat range's pieces): made once per key and kept while
    ``held``, what they view, is the same (tensors: the same objects; anything else: equal).
    Python's per-view cost (microseconds each) on a model of many small tensors is a large part
    of a step's time otherwise. What is kept keeps its tensors alive, so keys must be bounded
    (one per leg or bucket of a plan) and ``held`` must name only tensors kept anyway. ``make``
    may return ``None``: nothing to keep (what it made is not a view), nothing kept."""

    def __init__(self) -> None:
        self._kept: dict[tuple, tuple[tuple[object, ...], list]] = {}

    def get(self, key: tuple, held: tuple[object, ...], make: Callable[..., list | None], *args: object) -> list | None:
        kept = self._kept.get(key)
        if kept is not None:
            for a, b in zip(kept[0], held, strict=True):  # a loop, not all(): it runs per leg and step
                if a is not b and (isinstance(a, torch.Tensor) or a != b):
                    break
            else:
                return kept[1]
        views = make(*args)
        if views is not None:
            self._kept[key] = (held, views)
        return views
