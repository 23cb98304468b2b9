"""Blocks of pieces: padded blocks for collectives, and boxes for point-to-point transfers.

A collective exchanges equal-sized blocks, but pieces are uneven (``torch.chunk``: trailing
pieces shorter or empty). ``pack`` cuts a tensor along one dim into ``n`` blocks of a given
padded shape (zeros fill what the tensor does not cover, and only that); ``unpack`` concatenates
received blocks along one dim and crops to the true shape. Both avoid copies when the blocks are
already contiguous runs of memory, and otherwise copy each region once (two copies at most: the
whole blocks, then the partial last one). ``region`` is the view of one box of a piece (a
point-to-point transfer's block, placed by ``Box.relative_to`` in the piece that sends or
receives it; box arithmetic is :mod:`shardlang.box`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def crop(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The leading ``shape[k]`` elements of every dim ``k`` of ``x`` (a view)."""
    for k, length in enumerate(shape):
        if x.shape[k] != length:
            x = x.narrow(k, 0, length)
    return x


def pack(x: torch.Tensor, dim: int, n: int, block: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """A ``[n, *block]`` tensor whose block ``i`` holds ``x``'s elements
    ``[i * block[dim], (i + 1) * block[dim])`` along ``dim``, zero-padded; ``x`` is at most
    ``block`` in every other dim and at most ``n * block[dim]`` along ``dim``. Written into
    ``out`` (``[n, *block]``, e.g. a member's part of a bucket buffer) when given, else a
    contiguous tensor (``x`` itself, viewed, when it already is one)."""
    block = tuple(block)
    blocks = as_blocks(x, dim, n, block)
    if blocks is not None:
        if out is None:
            return blocks
        out.copy_(blocks)
        return out
    b, length = block[dim], x.shape[dim]
    if out is None:
        out = x.new_empty((n, *block))
    _zero_padding(out, x.shape, dim)
    if x.numel() == 0:
        return out
    spread = crop(out.movedim(0, dim), [*x.shape[:dim], n, b, *x.shape[dim + 1 :]])
    whole, rest = divmod(length, b)
    if whole:
        spread.narrow(dim, 0, whole).copy_(x.narrow(dim, 0, whole * b).unflatten(dim, (whole, b)))
    if rest:
        spread.select(dim, whole).narrow(dim, 0, rest).copy_(x.narrow(dim, whole * b, rest))
    return out


def _zero_padding(out: torch.Tensor, shape: Sequence[int], dim: int) -> None:
    """Zero what of the ``[n, *block]`` blocks ``out`` a tensor of ``shape`` packed along ``dim``
    leaves uncovered, and nothing else: the pack writes the rest (zeroing all of it first would
    write every byte twice). E.g. 5 rows in blocks of 2 rows: block 2's second row, and nothing
    of blocks 0 and 1."""
    n, *block = out.shape
    for k, (length, b) in enumerate(zip(shape, block, strict=True)):
        if k != dim and length < b:
            out.narrow(k + 1, length, b - length).zero_()
    whole, rest = divmod(shape[dim], block[dim]) if block[dim] else (n, 0)
    if rest:
        out[whole].narrow(dim, rest, block[dim] - rest).zero_()
        whole += 1
    if whole < n:
        out.narrow(0, whole, n - whole).zero_()


def as_blocks(x: torch.Tensor, dim: int, n: int, block: Sequence[int]) -> torch.Tensor | None:
    """``x`` viewed as the ``[n, *block]`` blocks :func:`pack` makes, when they need no padding
    and are runs of its memory (so packing them is one copy); else ``None``."""
    if not blocks_fit(x.shape, dim, n, block) or not x.is_contiguous():
        return None
    return x.view(n, *block)


def blocks_fit(shape: Sequence[int], dim: int, n: int, block: Sequence[int]) -> bool:
    """Whether a contiguous tensor of ``shape`` is, as it lies in memory, the ``[n, *block]``
    blocks :func:`pack` makes of it along ``dim``: no padding, and each block a run of memory."""
    if shape[dim] != n * block[dim] or any(shape[k] != block[k] for k in range(len(shape)) if k != dim):
        return False
    return n == 1 or math.prod(block[:dim]) == 1


def unpack(blocks: torch.Tensor, dim: int, shape: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, *block]`` blocks concatenated along ``dim`` and cropped to ``shape``; a view of
    ``blocks`` when they are contiguous runs along ``dim``, else a new tensor. Written into
    ``out`` (of ``shape``, e.g. the parameter a gathered piece belongs to) when given, so that
    the result is copied once, from the blocks to where it is kept."""
    n, *block = blocks.shape
    if out is None and math.prod(block[:dim]) == 1 and blocks.is_contiguous():
        return crop(blocks.view(*block[:dim], n * block[dim], *block[dim + 1 :]), shape)
    if out is None:
        out = blocks.new_empty(tuple(shape))
    for target, source in unpack_copies(blocks, dim, out):
        target.copy_(source)
    return out


def unpack_copies(blocks: torch.Tensor, dim: int, out: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The copies (target view of ``out``, source view of ``blocks``) that :func:`unpack`
    makes into ``out``: at most two, the whole blocks and the partial last one; none when
    ``out`` is empty. Views only, so that a caller can make the copies of many tensors in one
    call (``torch._foreach_copy_``)."""
    n, *block = blocks.shape
    shape, b = out.shape, block[dim]
    if out.numel() == 0:
        return []
    spread = crop(blocks.movedim(0, dim), [*shape[:dim], n, b, *shape[dim + 1 :]])
    whole, rest = divmod(shape[dim], b)
    copies = []
    if whole:
        copies.append((out.narrow(dim, 0, whole * b).unflatten(dim, (whole, b)), spread.narrow(dim, 0, whole)))
    if rest:
        copies.append((out.narrow(dim, whole * b, rest), spread.select(dim, whole).narrow(dim, 0, rest)))
    return copies


def region(x: torch.Tensor, box: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The elements of ``x`` inside ``box`` (``[start, stop)`` per dim, relative to ``x``): a view."""
    for k, (start, stop) in enumerate(box):
        if start != 0 or stop != x.shape[k]:
            x = x.narrow(k, start, stop - start)
    return x
