"""Buckets on real gloo process groups: many tensors' moves in one collective each, exact.

Random layout pairs (random nesting, partial ops, uneven shapes with empty pieces, f32/bf16/i64)
are planned twelve at a time as the ``grad -> state`` legs of one step plan, so buckets mix
tensors of other shapes, dims and padding; the stage's results must equal the torch.chunk
block of each full tensor (or reduce back to it, for a partial target), each bucket must run
one collective, and the busiest rank must send the bucket's planned bytes. With kept buffers
each batch runs again with its inputs written where their all_gathers send them from
(``StageRun.places``, as an optimizer writes its new parameters): the same results, and that
many elements fewer copied.
"""

from __future__ import annotations

import datetime
import functools
import io

import pytest
import torch

from planner.legs import BEFORE, StepTensor
from planner.step import plan_step
from runtime import recording, torch_dtype, unshard
from runtime.execution.buckets import StageRun, run_stage
from runtime.execution.step_program import compile_step
from runtime.memory.buffers import Scratch
from runtime.testing import run_ranks
from shardlang import parse_layout
from tests.test_reshard_dist import Case, corpus
from tests.test_runtime_support import full_tensor, reference_piece, source_pieces

BATCH = 12
MESHES = [
    ("mesh[4]", corpus("mesh[4]", 48, 21)),
    ("mesh[2,2]", corpus("mesh[2,2]", 48, 22)),
    ("mesh[2,2] ranks [2,0,3,1]", corpus("mesh[2,2] ranks [2,0,3,1]", 48, 23)),
]


def step_plan(cases: list[Case], rank: int, bucket_bytes: int | None = None):
    tensors = []
    for i, (src_text, dst_text, shape, dtype, _) in enumerate(cases):
        src, dst = parse_layout(src_text), parse_layout(dst_text)
        tensors.append(
            StepTensor(
                name=f"case{i}",
                shape=shape,
                param=dst,
                grad=src,
                state=dst,
                param_dtype=dtype,
                grad_dtype=dtype,
                state_dtype=dtype,
                fetch_param=False,
            )
        )
    return plan_step(tensors, rank, bucket_bytes=bucket_bytes)


def _batches(cases: list[Case]) -> list[list[Case]]:
    return [cases[i : i + BATCH] for i in range(0, len(cases), BATCH)]


class _CopyCount:
    """Elements copied by ``torch._foreach_copy_`` (how a stage packs its buckets) while active."""

    def __init__(self) -> None:
        self.elements = 0

    def __enter__(self) -> _CopyCount:
        self._copy = torch._foreach_copy_

        def counted(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
            self.elements += sum(t.numel() for t in targets)
            self._copy(targets, sources)

        torch._foreach_copy_ = counted
        return self

    def __exit__(self, *_: object) -> None:
        torch._foreach_copy_ = self._copy


def _placed_run(program, inputs: dict, buffers: Scratch) -> tuple[list[bytes], int, int]:
    """The stage run again with every input that has a place written there first: its
    results, the elements placed and the elements the stage copied."""
    run = StageRun(program, BEFORE, device_meshes={}, timeout=datetime.timedelta(seconds=60), buffers=buffers)
    places = run.places(list(inputs), torch.device("cpu"))
    for leg, place in places.items():
        place.copy_(inputs[leg])
    with _CopyCount() as copied:
        run.feed({leg: places.get(leg, x) for leg, x in inputs.items()})
        results = run.finish()
    pieces = [_to_bytes(results[k].contiguous()) for k in sorted(results)]
    return pieces, sum(p.numel() for p in places.values()), copied.elements


def _run(rank: int, world_size: int) -> list:
    out = []
    buffers = Scratch()  # shared by every run, as an optimizer shares it between steps
    for _, cases in MESHES:
        for batch in _batches(cases):
            for bucket_bytes in (None, 64):  # default buckets, and buckets cut small
                plan = step_plan(batch, rank, bucket_bytes)
                inputs = {}
                for i, (src_text, _, shape, dtype, seed) in enumerate(batch):
                    full = full_tensor(shape, torch_dtype(dtype), seed)
                    leg = next(k for k, leg in enumerate(plan.legs) if leg.tensor == f"case{i}")
                    inputs[leg] = source_pieces(full, parse_layout(src_text), seed)[rank]
                program = compile_step(plan, rank)
                with recording() as log, _CopyCount() as copied:
                    # Kept buffers with the default buckets, fresh ones with the small buckets.
                    results = run_stage(
                        program,
                        BEFORE,
                        inputs,
                        device_meshes={},
                        timeout=datetime.timedelta(seconds=60),
                        buffers=buffers if bucket_bytes is None else None,
                    )
                pieces = [_to_bytes(results[k].contiguous()) for k in sorted(results)]
                placed = _placed_run(program, inputs, buffers) if bucket_bytes is None else None
                records = [(r.step, r.bytes_sent, len(r.tensor.split(","))) for r in log.records]
                out.append((pieces, records, copied.elements, placed))
    return out


def _to_bytes(t: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(t.clone(), buffer)
    return buffer.getvalue()


@functools.cache
def _results() -> list:
    return run_ranks(_run, 4, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_index", range(len(MESHES)))
def test_bucketed_moves_equal_the_blocks_of_the_full_tensors(mesh_index: int) -> None:
    results = _results()
    per_mesh = len(_batches(MESHES[0][1])) * 2
    mesh_text, cases = MESHES[mesh_index]
    runs = [(batch, bucket_bytes) for batch in _batches(cases) for bucket_bytes in (None, 64)]
    shared = placed_total = 0
    for r, (batch, bucket_bytes) in enumerate(runs):
        got = {rank: results[rank][mesh_index * per_mesh + r] for rank in range(4)}
        plan = step_plan(batch, 0, bucket_bytes)
        before = [(k, b) for k, b in enumerate(plan.buckets) if b.stage == BEFORE]
        if bucket_bytes is None:
            shared += sum(len(leg.communicating) for leg in plan.legs if leg.stage == BEFORE) - len(before)
        for rank, (pieces, records, copied, placed) in got.items():
            assert [step for step, *_ in records] == [k for k, _ in before], f"{mesh_text} rank {rank}"
            if placed is not None:
                placed_pieces, placed_elements, placed_copied = placed
                assert placed_pieces == pieces, f"{mesh_text} rank {rank}: placed inputs changed the results"
                assert placed_copied == copied - placed_elements, f"{mesh_text} rank {rank}: placed inputs copied"
                placed_total += placed_elements
        for k, bucket in before:
            sent = [next(s for step, s, *_ in records if step == k) for _, records, *_ in got.values()]
            assert max(sent) == bucket.bytes, f"{mesh_text} bucket {k}: sent {sent}, planned {bucket.bytes}"
        for i, (src_text, dst_text, shape, dtype, seed) in enumerate(batch):
            dst = parse_layout(dst_text)
            full = full_tensor(shape, torch_dtype(dtype), seed)
            out = {rank: torch.load(io.BytesIO(pieces[i])) for rank, (pieces, *_) in got.items()}
            label = f"{mesh_text} {src_text} -> {dst_text} {shape} {dtype}"
            if dst.partial:
                assert torch.equal(unshard(out, dst), full), label
                continue
            for rank, piece in out.items():
                assert torch.equal(piece, reference_piece(full, dst, rank)), f"{label}: rank {rank}"
    assert shared > 0, "no two tensors shared a collective"
    assert placed_total > 0, "no input had a place"


@pytest.mark.slow
def test_buckets_hold_many_tensors() -> None:
    """The corpus really mixes tensors: buckets carry tensors of different shapes, and every
    collective runs some bucket of several tensors."""
    mixed, shared_ops = 0, set()
    for _, cases in MESHES:
        for batch in _batches(cases):
            plan = step_plan(batch, 0)
            for bucket in plan.buckets:
                shapes = {plan.legs[m.leg].hops[m.hop].plan.shape for m in bucket.members}
                mixed += len(shapes) > 1
                if len(bucket.members) > 1:
                    shared_ops.add(bucket.op)
    assert mixed >= 10
    assert shared_ops == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}
