"""What a reshard copies and holds, measured on gloo ranks outside the runtime: every byte an op
writes into a buffer on the calling rank (copies, clones, the zeros of padding) while
``reshard`` runs, counted by a ``TorchDispatchMode``, less what the collective layer does
inside a collective (``runtime.comm.collectives``: the backend's own work); and every storage
made under the mode while a tensor of it lives.

The copies are the planner's copy table (``Plan.copied_bytes``, planner/copies.py): per step,
the most any rank of the step's group copies. The table leaves out one copy on purpose: the
all_reduce of the caller's own piece copies it first (the caller's tensor is never written),
which the fitted all_reduce line holds. A leading-dimension all_gather sends from the piece
itself, so at its peak a reshard holds its result and nothing else.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import planner
from runtime import reshard
from runtime.testing import run_ranks
from shardlang import parse_layout
from tests.live_storages import LiveStorages

WORLD = 4
_COPIES = {"aten.copy_.default", "aten.zero_.default", "aten.fill_.Scalar", "aten._foreach_copy_.default"}
_MADE = {"aten.clone.default", "aten.cat.default", "aten.stack.default", "aten._to_copy.default"}


class _Watch(TorchDispatchMode):
    """The elements ops write into buffers (``written``), except while ``paused`` (inside a
    collective), and the most bytes of storages made under the mode and alive at once
    (``live.peak``: each storage once while a tensor of it lives; views of the tensors in ``held``,
    made before, are none)."""

    def __init__(self, held: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.written, self.paused = 0, False
        self.live = LiveStorages(held)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if not self.paused and name in _COPIES:
            targets = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.written += sum(t.numel() for t in targets)
        out = func(*args, **(kwargs or {}))
        if not self.paused and name in _MADE:
            self.written += out.numel()
        self.live.note(out)
        return out


def _paused(watch: list[_Watch], fn: Any) -> Any:
    """``fn`` run with the current watch paused: the collective layer's own work."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not watch:
            return fn(*args, **kwargs)
        watch[0].paused = True
        try:
            return fn(*args, **kwargs)
        finally:
            watch[0].paused = False

    return run


def _watched(rank: int, world: int, cases: list[tuple[str, str, tuple[int, ...]]]) -> list[tuple[int, int, int]]:
    """Per case, this rank's (elements written, peak bytes alive, result bytes) of its second
    call (the first makes the buffers kept between calls)."""
    import runtime.comm.collectives as collectives
    import runtime.execution.run as run

    watch: list[_Watch] = []
    run.start_collective = _paused(watch, run.start_collective)
    collectives.PendingCollective.wait = _paused(watch, collectives.PendingCollective.wait)
    found = []
    for src_text, dst_text, shape in cases:
        src, dst = parse_layout(src_text), parse_layout(dst_text)
        generator = torch.Generator().manual_seed(rank)
        piece = torch.randn(src.rank_piece(shape, rank).shape, generator=generator)
        reshard(piece, src, dst, global_shape=shape)
        dist.barrier()
        watch[:] = [_Watch((piece,))]
        with watch[0]:
            out = reshard(piece, src, dst, global_shape=shape)
        found.append((watch[0].written, watch[0].live.peak, out.untyped_storage().nbytes()))
        watch.clear()
        del out
    return found


D1 = f" over mesh[dp={WORLD}]"
D2 = " over mesh[a=2, b=2]"
CASES = [
    ("S(dp),R" + D1, "R,R" + D1, (64, 48)),  # all_gather of the leading dim: sent from the piece
    ("S(dp),R" + D1, "R,R" + D1, (62, 48)),  # ... uneven: the short piece is padded
    ("R,S(dp)" + D1, "R,R" + D1, (48, 64)),  # all_gather of dim 1: unpacked
    ("R,R | P(dp)" + D1, "S(dp),R" + D1, (64, 48)),  # reduce_scatter of the leading dim: no copy
    ("R,R | P(dp)" + D1, "S(dp),R" + D1, (62, 48)),  # ... uneven: packed
    ("R,R | P(dp)" + D1, "R,S(dp)" + D1, (48, 64)),  # reduce_scatter of dim 1: packed
    ("S(dp),R" + D1, "R,S(dp)" + D1, (64, 48)),
    ("R,R | P(dp)" + D1, "R,R" + D1, (64, 48)),  # all_reduce of the caller's piece: copied first
    ("R,R | P(a),P(b)" + D2, "R,R" + D2, (64, 48)),  # the second all_reduce in place
    ("S(a),S(b)" + D2, "R,R" + D2, (64, 48)),
    ("R,R | P(a)" + D2, "S(a),R" + D2, (64, 48)),
]


@pytest.fixture(scope="module")
def watched() -> list[list[tuple[int, int, int]]]:
    return run_ranks(_watched, WORLD, (CASES,), timeout=240)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{s} -> {d} {list(shape)}" for s, d, shape in CASES])
def test_a_reshard_copies_what_the_copy_table_prices(watched: list, case: int) -> None:
    """The most elements any rank writes is, step by step, what ``Plan.copied_bytes`` prices
    (plus the caller's piece where the first communicating step is an all_reduce)."""
    src_text, dst_text, shape = CASES[case]
    src, dst = parse_layout(src_text), parse_layout(dst_text)
    plan = planner.plan(src, dst, shape, "f32")
    priced = sum(plan.copied_bytes()) // 4
    first = next(step for step in plan.steps if step.op not in ("slice", "partial"))
    written = [per_rank[case][0] for per_rank in watched]
    expected = [priced] * WORLD
    if first.op == "all_reduce":
        expected = [priced + src.rank_piece(shape, rank).numel for rank in range(WORLD)]
    assert max(written) == max(expected), ([s.describe() for s in plan.steps], written, expected)


def test_a_leading_dim_gather_holds_its_result_and_nothing_more() -> None:
    """A 16 MiB ``S(dp),R -> R,R`` on 4 ranks: at its peak the call holds its result (16 MiB)
    and no other storage (its piece is sent from where it lies)."""
    shape = (2048, 2048)
    per_rank = run_ranks(_watched, WORLD, ([("S(dp),R" + D1, "R,R" + D1, shape)],), timeout=240)
    for rank, [(_, peak, result)] in enumerate(per_rank):
        assert result == 2048 * 2048 * 4
        assert peak == result, f"rank {rank}: {peak - result} bytes beyond the result"
