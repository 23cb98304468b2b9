"""Working buffers kept between steps.

A training step moves and updates buffers of megabytes. Allocated anew each step, such a buffer
costs more than the work on it: the allocator hands large blocks back to the system when they
are freed, so every page faults again on first touch (a flat AdamW update of 0.9M elements
takes 3 ms into kept buffers and 7-10 ms into new ones on this project's CPU machines). The
sharded optimizers and the buckets they run therefore keep their buffers.
"""

from __future__ import annotations

import torch


class Scratch:
    """Buffers kept between steps, by name, grown to the largest size asked (see the module
    doc for why they are kept); :meth:`take` gives a 1-d view of the first ``numel``."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
