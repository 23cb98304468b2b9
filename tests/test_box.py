"""Box arithmetic against brute force: every box is checked as the set of indices it holds."""

from __future__ import annotations

import itertools
import random

import torch

from shardlang import parse_layout
from shardlang.box import Box, row_major_strides


def _cells(box: Box) -> set[tuple[int, ...]]:
    return set(itertools.product(*(range(lo, hi) for lo, hi in box)))


def _random_box(rng: random.Random, ndim: int) -> Box:
    return Box((lo, lo + rng.randint(0, 4)) for lo in (rng.randint(0, 4) for _ in range(ndim)))


def test_numel_shape_intersect_contains_relative_against_index_sets() -> None:
    rng = random.Random(11)
    for _ in range(400):
        ndim = rng.randint(1, 3)
        a, b = _random_box(rng, ndim), _random_box(rng, ndim)
        assert a.numel == len(_cells(a))
        assert a.shape == tuple(len(range(lo, hi)) for lo, hi in a)
        assert a.empty == (not _cells(a))
        common = a.intersect(b)
        if common is None:
            assert not (_cells(a) & _cells(b))
        else:
            assert _cells(common) == _cells(a) & _cells(b)
        if not b.empty:
            assert a.contains(b) == (_cells(b) <= _cells(a))
        shifted = {tuple(i - lo for i, (lo, _) in zip(cell, b, strict=True)) for cell in _cells(a)}
        assert _cells(a.relative_to(b)) == shifted


def test_row_major_strides_are_torchs_contiguous_strides() -> None:
    rng = random.Random(5)
    shapes = [(), (3,), (2, 3, 4), (4, 0, 3), (0,), (1, 1, 5)]
    shapes += [tuple(rng.randint(0, 4) for _ in range(rng.randint(1, 4))) for _ in range(50)]
    for shape in shapes:
        assert row_major_strides(shape) == torch.empty(shape).stride(), shape


def test_a_box_is_its_tuple_and_its_repr_reads_back() -> None:
    box = Box([(0, 4), (2, 6)])
    assert box == ((0, 4), (2, 6)) and hash(box) == hash(((0, 4), (2, 6)))
    assert eval(repr(box)) == box and isinstance(eval(repr(box)), Box)
    assert box.text() == "[0:4, 2:6]"
    assert Box() == () and Box().numel == 1


def test_layout_pieces_are_boxes_that_slice_the_tensor_as_torch_chunk() -> None:
    layout = parse_layout("S1,R over mesh[2,3]")
    full = torch.arange(7 * 5).reshape(7, 5)
    chunks = torch.chunk(full, 3, dim=0)
    for rank in range(6):
        piece = layout.rank_piece((7, 5), rank)
        assert isinstance(piece, Box)
        held = full[tuple(slice(lo, hi) for lo, hi in piece)]
        assert torch.equal(held, chunks[rank % 3])
        assert piece.shape == tuple(held.shape)
