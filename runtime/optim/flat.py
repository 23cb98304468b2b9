"""Flat state buffers: every state of many tensors in one buffer per (state, dtype, device).

Each tensor's state is a view of the buffer (``FlatStates.view``); tensors lie in the order
they were given, so the states of tensors stepped together form one contiguous range, and the
optimizer math runs as a few whole-range ops (``as_flat``) instead of one op per tensor.

A step never writes the buffers it reads: :meth:`FlatStates.fresh` gives new buffers (empty
where every tensor of a buffer is stepped, else a copy, since the others keep their values),
the math writes into their views, and :meth:`FlatStates.replace` swaps them in when the whole
step has succeeded; a failed step drops them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

Key = tuple[str, torch.dtype, torch.device]


class FlatStates:
    """The states of tensors numbered ``0..``; ``entries`` gives, per tensor, its number, the
    shape of each state it keeps here, and their dtype and device."""

    def __init__(self, entries: Iterable[tuple[int, Mapping[str, tuple[int, ...]], torch.dtype, torch.device]]) -> None:
        self._where: dict[tuple[int, str], tuple[Key, int, tuple[int, ...]]] = {}
        sizes: dict[Key, int] = {}
        self._members: dict[Key, set[int]] = {}
        for tensor, shapes, dtype, device in entries:
            for state, shape in shapes.items():
                key = (state, dtype, device)
                offset = sizes.get(key, 0)
                self._where[(tensor, state)] = (key, offset, tuple(shape))
                sizes[key] = offset + math.prod(shape)
                self._members.setdefault(key, set()).add(tensor)
        self.buffers: dict[Key, torch.Tensor] = {
            key: torch.zeros(size, dtype=key[1], device=key[2]) for key, size in sizes.items()
        }

    def has(self, tensor: int, state: str) -> bool:
        return (tensor, state) in self._where

    def view(self, tensor: int, state: str, buffers: Mapping[Key, torch.Tensor] | None = None) -> torch.Tensor:
        """The tensor's state, a view of its buffer (of ``buffers`` when given)."""
        key, offset, shape = self._where[(tensor, state)]
        source = self.buffers if buffers is None else buffers
        return source[key][offset : offset + math.prod(shape)].view(shape)

    def fresh(self, stepped: Iterable[int]) -> dict[Key, torch.Tensor]:
        """New buffers for a step of the tensors ``stepped``."""
        chosen = set(stepped)
        return {
            key: torch.empty_like(buffer) if self._members[key] <= chosen else buffer.clone()
            for key, buffer in self.buffers.items()
        }

    def replace(self, buffers: Mapping[Key, torch.Tensor]) -> None:
        self.buffers = dict(buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def as_flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One 1-d view covering ``tensors`` when they are contiguous and lie one after another
    in the same storage (views of one flat buffer, in order), else ``None``."""
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    start = end = first.storage_offset()
    for t in tensors:
        if t.dtype != first.dtype or not t.is_contiguous() or t.storage_offset() != end:
            return None
        if t.numel() and t.untyped_storage().data_ptr() != storage:
            return None
        end += t.numel()
    return first.as_strided((end - start,), (1,), start)


def flat_or_copy(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``tensors`` as one 1-d tensor of ``dtype``: a view when they already are one, else a copy."""
    flat = as_flat(tensors)
    if flat is not None and flat.dtype == dtype:
        return flat
    if not tensors:
        return torch.empty(0, dtype=dtype)
    out = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    offset = 0
    for t in tensors:
        out[offset : offset + t.numel()].view(t.shape).copy_(t)
        offset += t.numel()
    return out


def scatter_back(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` into ``tensors`` (in order), unless it already is their storage."""
    if as_flat(tensors) is not None and as_flat(tensors).data_ptr() == flat.data_ptr():  # type: ignore[union-attr]
        return
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
