"""The most bytes of storages alive at once, measured outside the code under test: the tests'
``TorchDispatchMode`` watches note every tensor an op makes, and each storage counts once while
a tensor of it lives (tests/test_muon_waves_dist.py, tests/test_reshard_copies_dist.py)."""

from __future__ import annotations

import weakref
from typing import Any

import torch


class LiveStorages:
    """The storages of the tensors noted and the most bytes of them alive at once (``peak``);
    storages of the tensors in ``held`` (made before) are not counted."""

    def __init__(self, held: tuple[torch.Tensor, ...] = ()) -> None:
        self.peak = 0
        self._held = {t.untyped_storage().data_ptr() for t in held}
        self._alive: dict[int, tuple[int, list[weakref.ref]]] = {}  # storage address: bytes, its tensors

    def note(self, out: Any) -> None:
        """An op's output (a tensor, a list or tuple of them, or anything else): its new storages
        noted, those whose tensors are all gone dropped, the peak updated."""
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self._held:
                storage = t.untyped_storage()
                self._alive.setdefault(storage.data_ptr(), (storage.nbytes(), []))[1].append(weakref.ref(t))
        live = 0
        for address, (nbytes, refs) in list(self._alive.items()):
            refs[:] = [r for r in refs if r() is not None]
            if refs:
                live += nbytes
            else:
                del self._alive[address]
        self.peak = max(self.peak, live)
