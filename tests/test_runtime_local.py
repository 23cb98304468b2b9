"""Single-process checks of the runtime: measured bytes against the cost model, plan caching,
and the error when torch.distributed is not initialized."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import planner
from runtime import DistributedError, reshard
from runtime.execution import executor, reshard_program
from runtime.execution.program import bytes_sent, compile_plan
from shardlang import parse_layout
from shardlang.dtypes import ITEMSIZE
from tests.test_runtime_support import layouts, meshes, shapes


@st.composite
def _plans(draw: st.DrawFn) -> planner.Plan:
    mesh = draw(meshes())
    shape = draw(shapes())
    src, dst = draw(layouts(mesh, len(shape))), draw(layouts(mesh, len(shape)))
    dtype = draw(st.sampled_from(["f32", "bf16", "f64"]))
    return planner.plan(src, dst, shape, dtype)


@settings(max_examples=300, deadline=None)
@given(_plans())
def test_bytes_sent_match_the_cost_model_on_the_busiest_rank(plan: planner.Plan) -> None:
    mesh = plan.src.mesh
    moves = {rank: compile_plan(plan, rank) for rank in mesh.ranks}
    for i, step in enumerate(plan.steps):
        sent = [bytes_sent(moves[rank][i], ITEMSIZE[plan.dtype]) for rank in mesh.ranks]
        assert max(sent) == step.bytes
        busiest = mesh.rank_at((0,) * mesh.ndim)
        assert sent[mesh.ranks.index(busiest)] == step.bytes


def test_plans_are_made_once_per_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """And compiled once per rank: the step program the bucket runner runs is cached with it."""
    calls, compiled = [], []
    real, compile_step = planner.plan, reshard_program.compile_step
    monkeypatch.setattr(planner, "plan", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr(reshard_program, "compile_step", lambda *a, **k: compiled.append(a) or compile_step(*a, **k))
    executor._planned_program.cache_clear()
    src, dst = parse_layout("S0,R over mesh[2]"), parse_layout("R,R over mesh[2]")
    first = executor._program(src, dst, (5, 3), "f32", None, False, 1, "t")
    for _ in range(3):
        assert executor._program(src, dst, (5, 3), "f32", None, False, 1, "t") is first
    assert len(calls) == 1 and len(compiled) == 1
    assert first.source_shape == (2, 3)
    # One leg, one bucket: the plan's all_gather, its step 0.
    assert [(b.bucket.op, b.bucket.members[0].step) for b in first.steps.buckets] == [("all_gather", 0)]


def test_reshard_needs_an_initialized_process_group() -> None:
    assert not dist.is_initialized(), "this test needs a process without a default process group"
    layout = parse_layout("R over mesh[1]")
    with pytest.raises(DistributedError, match=r"tensor 'w': torch\.distributed is not initialized"):
        reshard(torch.zeros(3), layout, layout, global_shape=(3,), name="w")
