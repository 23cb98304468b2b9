"""Packing pieces into padded blocks and back, against torch.nn.functional.pad and torch.cat."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.memory.packing import as_blocks, crop, pack, unpack


def _pad_to(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    pads: list[int] = []
    for have, want in reversed(list(zip(x.shape, shape, strict=True))):
        pads += [0, want - have]
    return F.pad(x, pads)


@st.composite
def _cases(draw: st.DrawFn) -> tuple[torch.Tensor, int, int, list[int]]:
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    n = draw(st.integers(1, 4))
    block = [draw(st.integers(0, 4)) for _ in range(ndim)]
    shape = [draw(st.integers(0, b)) for b in block]
    shape[dim] = draw(st.integers(0, n * block[dim]))
    x = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    if draw(st.booleans()) and ndim > 1:  # a non-contiguous view with the same values
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    return x, dim, n, block


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_pack_is_padded_blocks(case: tuple[torch.Tensor, int, int, list[int]]) -> None:
    x, dim, n, block = case
    packed = pack(x, dim, n, block)
    assert packed.shape == (n, *block) and packed.is_contiguous()
    padded = _pad_to(x, [n * b if k == dim else b for k, b in enumerate(block)])
    expected = torch.stack(torch.split(padded, block[dim], dim=dim)) if block[dim] else torch.zeros(n, *block)
    assert torch.equal(packed, expected)
    # Into a kept buffer that holds an earlier step's blocks: the padding is zeroed again.
    kept = torch.full((n, *block), float("nan"))
    assert pack(x, dim, n, block, out=kept) is kept and torch.equal(kept, expected)


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_unpack_inverts_pack(case: tuple[torch.Tensor, int, int, list[int]]) -> None:
    x, dim, n, block = case
    blocks = torch.arange(n * torch.Size(block).numel(), dtype=torch.float32).reshape(n, *block)
    out = unpack(blocks, dim, list(x.shape))
    assert torch.equal(out, crop(torch.cat(list(blocks), dim=dim), list(x.shape)))
    assert torch.equal(unpack(pack(x, dim, n, block), dim, list(x.shape)), x)


@settings(max_examples=100, deadline=None)
@given(_cases(), st.booleans())
def test_unpack_into_and_from_strided_blocks(case: tuple[torch.Tensor, int, int, list[int]], strided: bool) -> None:
    """Unpacking into a given tensor, and from blocks that are columns of a bucket's result
    (rows of other tensors' chunks between them), gives what torch.cat and a crop give."""
    x, dim, n, block = case
    numel = torch.Size(block).numel()
    rows = torch.arange(n * (numel + 3), dtype=torch.float32).reshape(n, numel + 3)
    blocks = (rows[:, 2 : 2 + numel] if strided else rows[:, :numel].contiguous()).reshape(n, *block)
    expected = crop(torch.cat(list(blocks), dim=dim), list(x.shape))
    assert torch.equal(unpack(blocks, dim, list(x.shape)), expected)
    out = torch.full(tuple(x.shape), -1.0)
    unpack(blocks, dim, list(x.shape), out=out)
    assert torch.equal(out, expected)


@settings(max_examples=100, deadline=None)
@given(_cases())
def test_as_blocks_only_when_pack_is_one_copy(case: tuple[torch.Tensor, int, int, list[int]]) -> None:
    x, dim, n, block = case
    blocks = as_blocks(x, dim, n, block)
    padded = list(x.shape) != [n * b if k == dim else b for k, b in enumerate(block)]
    if padded or not x.is_contiguous():
        assert blocks is None
    elif n == 1 or torch.Size(block[:dim]).numel() == 1:
        assert blocks is not None and blocks.data_ptr() == x.data_ptr()
        assert torch.equal(blocks, pack(x, dim, n, block))
    else:  # blocks are not runs of x's memory
        assert blocks is None
