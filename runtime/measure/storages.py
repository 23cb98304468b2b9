"""What an object's tensors hold, counted through their storages: the measurement that the
optimizers' own memory accounting (``memory_report``) is checked against (docs/memory.md,
"Predicting it"), in the tests and in ``bench/bench_fake_world.py``."""

from __future__ import annotations

import gc

import torch


def storage_bytes(root: object, skip: set[int]) -> dict[int, int]:
    """Per storage (its address) the bytes of every tensor reachable from ``root`` through
    containers and object attributes, less the storages in ``skip`` (addresses): each storage
    once, however many tensors view it."""
    found: dict[int, int] = {}
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, type(gc), type(storage_bytes), str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in skip:
                found[storage.data_ptr()] = storage.nbytes()
            continue
        todo.extend(gc.get_referents(obj))
    return found
