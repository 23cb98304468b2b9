"""Flat state buffers: every state of many tensors in one buffer per (state, dtype, device).

Each tensor's state is a view of the buffer (``FlatStates.view``); tensors lie in the order
they were given, so the states of tensors stepped together form one contiguous range, and the
optimizer math runs as a few whole-range ops (``as_flat``) instead of one op per tensor.

A step never writes the buffers it reads: :meth:`FlatStates.fresh` gives the second set of
buffers (a copy of the first where not every tensor of a buffer is stepped, since the others
keep their values), the math writes into their views, and :meth:`FlatStates.replace` swaps the
two sets when the whole step has succeeded; a failed step leaves the first set as it was. The
second set is kept between steps (``spare_bytes``): allocating buffers of megabytes anew every
step costs more than the math on them (the allocator returns them to the system, and every
page faults again on first touch).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from runtime.memory.buffers import KeptViews, Scratch

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
        self._spare: dict[Key, torch.Tensor] | None = None
        # run(): per (tensors, state), the range of its buffer they lie in one after another
        # (key, start, end), or None; their places never change, and steps ask alike.
        self._runs: dict[tuple[tuple[int, ...], str], tuple[Key, int, int] | None] = {}
        self._views = KeptViews()  # view()'s, per buffer

    def has(self, tensor: int, state: str) -> bool:
        return (tensor, state) in self._where

    def run(
        self, tensors: Sequence[int], state: str, buffers: Mapping[Key, torch.Tensor] | None = None
    ) -> torch.Tensor | None:
        """The states ``state`` of ``tensors`` as one range of their buffer (of ``buffers``
        when given) when they lie there one after another, else ``None``."""
        ask = (tuple(tensors), state)
        if ask not in self._runs:
            self._runs[ask] = self._range(ask[0], state)
        where = self._runs[ask]
        if where is None:
            return None
        key, start, end = where
        source = self.buffers if buffers is None else buffers
        return source[key][start:end]

    def _range(self, tensors: tuple[int, ...], state: str) -> tuple[Key, int, int] | None:
        if not tensors or not all((t, state) in self._where for t in tensors):
            return None
        key, start, _ = self._where[(tensors[0], state)]
        end = start
        for t in tensors:
            other, offset, shape = self._where[(t, state)]
            if other != key or offset != end:
                return None
            end += math.prod(shape)
        return key, start, end

    def view(self, tensor: int, state: str, buffers: Mapping[Key, torch.Tensor] | None = None) -> torch.Tensor:
        """The tensor's state, a view of its buffer (of ``buffers`` when given): made once per
        buffer, since the two sets of buffers live as long as this (a view costs microseconds,
        and a step asks for one per tensor and state)."""
        key, offset, shape = self._where[(tensor, state)]
        buffer = (self.buffers if buffers is None else buffers)[key]
        return self._views.get((tensor, state, id(buffer)), (buffer,), _piece, buffer, offset, shape)[0]

    def fresh(self, stepped: Iterable[int]) -> dict[Key, torch.Tensor]:
        """The buffers a step of the tensors ``stepped`` writes (the second set)."""
        if self._spare is None:
            self._spare = {key: torch.empty_like(buffer) for key, buffer in self.buffers.items()}
        chosen = set(stepped)
        for key, buffer in self.buffers.items():
            if not self._members[key] <= chosen:
                self._spare[key].copy_(buffer)
        return dict(self._spare)

    def replace(self, buffers: Mapping[Key, torch.Tensor]) -> None:
        """Make ``buffers`` (from :meth:`fresh`) the states; the old ones become the spare set."""
        self._spare, self.buffers = self.buffers, dict(buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    @property
    def spare_bytes(self) -> int:
        return 0 if self._spare is None else sum(b.numel() * b.element_size() for b in self._spare.values())


def as_flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One 1-d view covering ``tensors`` when they are contiguous and lie one after another
    in memory (views of one flat buffer, in order), else ``None``."""
    if not tensors:
        return None
    first = tensors[0]
    itemsize = first.element_size()
    end = first.data_ptr()
    count = 0
    for t in tensors:
        if t.numel() == 0:
            continue
        if t.dtype != first.dtype or t.data_ptr() != end or not t.is_contiguous():
            return None
        end += t.numel() * itemsize
        count += t.numel()
    if count and first.numel() == 0:  # the run starts at its first non-empty tensor
        first = next(t for t in tensors if t.numel())
    return first.as_strided((count,), (1,), first.storage_offset())


def flat_or_copy(
    tensors: Sequence[torch.Tensor], dtype: torch.dtype, scratch: Scratch | None = None, name: str = ""
) -> torch.Tensor:
    """``tensors`` as one 1-d tensor of ``dtype``: a view when they already are one, else a
    copy (into ``scratch``'s buffer ``name`` when given)."""
    flat = as_flat(tensors)
    if flat is not None and flat.dtype == dtype:
        return flat
    if not tensors:
        return torch.empty(0, dtype=dtype)
    numel, device = sum(t.numel() for t in tensors), tensors[0].device
    out = (
        torch.empty(numel, dtype=dtype, device=device) if scratch is None else scratch.take(name, numel, dtype, device)
    )
    for view, t in zip(pieces_of(out, [t.shape for t in tensors]), tensors, strict=True):
        view.copy_(t)
    return out


def _piece(buffer: torch.Tensor, offset: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    return [buffer[offset : offset + math.prod(shape)].view(shape)]


def pieces_of(flat: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Views of ``flat``, one after another, of ``shapes``."""
    views, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        views.append(flat[offset : offset + n].view(shape))
        offset += n
    return views


def scatter_back(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` into ``tensors`` (in order), unless it already is their memory."""
    same = as_flat(tensors)
    if same is not None and same.data_ptr() == flat.data_ptr():
        return
    for t, view in zip(tensors, pieces_of(flat, [t.shape for t in tensors]), strict=True):
        t.copy_(view)
