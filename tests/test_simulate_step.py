"""The simulator runs a compiled optimizer step (``runtime.execution.simulate.simulate_step``): a
ZeRO-2 step's buckets over ``mesh[dp=4]`` (gradients ``R,R | P(dp):avg`` reduce-scattered into
states ``S(dp),R``, the new parameters' ``S(dp),R`` pieces all-gathered back to ``R,R``), run by
the bucket runner on every rank at once. Its results equal the full tensors sliced by hand
(``torch.chunk`` of the average of every rank's gradient; the full parameter on every rank), with
uneven and empty pieces, buckets cut small, buckets launched during backward (``overlap``: in
flight together in their slots) and with fresh buffers, and equal the same stage run by 4 gloo
processes bit for bit.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch

from planner.legs import AFTER, BEFORE, StepTensor
from planner.step import plan_step
from runtime.errors import DistributedError, ReshardError
from runtime.execution.buckets import run_stage
from runtime.execution.simulate import simulate_step
from runtime.execution.step_program import compile_step
from runtime.testing import run_ranks
from shardlang import parse_layout

MESH = "mesh[dp=4]"
SHAPES = {"w": (7, 3), "b": (5,), "e": (2, 2), "u": (9,)}  # 2,2,2,1 / 2,2,1,0 / 1,1,0,0 / 3,3,3,0 rows
WORLD = 4


def _tensors() -> list[StepTensor]:
    tensors = []
    for name, shape in SHAPES.items():
        rest = ",R" * (len(shape) - 1)
        tensors.append(
            StepTensor(
                name=name,
                shape=shape,
                param=parse_layout(f"R{rest} over {MESH}"),
                grad=parse_layout(f"R{rest} | P(dp):avg over {MESH}"),
                state=parse_layout(f"S(dp){rest} over {MESH}"),
                param_dtype="f32",
                grad_dtype="f32",
                state_dtype="f32",
                fetch_param=False,
            )
        )
    return tensors


def _programs(bucket_bytes: int | None, overlap: bool) -> dict[int, Any]:
    tensors = _tensors()
    return {
        rank: compile_step(plan_step(tensors, rank, bucket_bytes=bucket_bytes, overlap=overlap), rank)
        for rank in range(WORLD)
    }


def _grad(name: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s gradient of ``name``: small integers, so that every sum is exact."""
    generator = torch.Generator().manual_seed(100 * rank + len(name) + sum(SHAPES[name]))
    return torch.randint(-8, 9, SHAPES[name], generator=generator).float()


def _param(name: str) -> torch.Tensor:
    return torch.arange(torch.Size(SHAPES[name]).numel(), dtype=torch.float32).view(SHAPES[name]) + 0.5


def _rows(full: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``S(dp)`` rows of ``full``, by hand: the ``torch.chunk`` block (empty past
    the last block)."""
    blocks = torch.chunk(full, WORLD, dim=0)
    return blocks[rank] if rank < len(blocks) else full[0:0]


def _legs(program: Any, what: str) -> dict[str, int]:
    return {leg.tensor: i for i, leg in enumerate(program.plan.legs) if leg.what == what}


def _inputs(programs: dict[int, Any], stage: str) -> dict[int, dict[int, torch.Tensor]]:
    inputs = {}
    for rank, program in programs.items():
        if stage == BEFORE:
            inputs[rank] = {i: _grad(n, rank) for n, i in _legs(program, "grad -> state").items()}
        else:
            inputs[rank] = {i: _rows(_param(n), rank).clone() for n, i in _legs(program, "state -> param").items()}
    return inputs


@pytest.mark.parametrize("kept_buffers", [True, False])
@pytest.mark.parametrize(("bucket_bytes", "overlap"), [(None, False), (16, False), (16, True)])
def test_a_simulated_zero2_step_equals_the_full_tensors_sliced_by_hand(
    bucket_bytes: int | None, overlap: bool, kept_buffers: bool
) -> None:
    programs = _programs(bucket_bytes, overlap)
    if bucket_bytes is not None:  # the small cap makes several buckets of each kind
        assert sum(b.op == "reduce_scatter" for b in programs[0].plan.buckets) >= 3
    reduced = simulate_step(programs, BEFORE, _inputs(programs, BEFORE), kept_buffers=kept_buffers)
    gathered = simulate_step(programs, AFTER, _inputs(programs, AFTER), kept_buffers=kept_buffers)
    for rank, program in programs.items():
        for name, leg in _legs(program, "grad -> state").items():
            average = sum(_grad(name, r) for r in range(WORLD)) / WORLD
            assert torch.equal(reduced[rank][leg], _rows(average, rank)), (rank, name)
        for name, leg in _legs(program, "state -> param").items():
            assert torch.equal(gathered[rank][leg], _param(name)), (rank, name)


def test_ranks_that_post_different_collectives_are_an_error_not_a_hang() -> None:
    programs = _programs(None, False)
    programs[3] = compile_step(plan_step(_tensors()[:1], 3), 3)  # rank 3 plans one tensor only
    inputs = _inputs(programs, BEFORE)
    with pytest.raises(DistributedError, match=r"the ranks \[0, 1, 2, 3\] posted different collectives"):
        simulate_step(programs, BEFORE, inputs, timeout=5)


def test_a_rank_that_fails_is_the_error_raised_and_its_peers_stop_waiting() -> None:
    programs = _programs(None, False)
    inputs = _inputs(programs, BEFORE)
    leg = _legs(programs[2], "grad -> state")["w"]
    inputs[2] = {**inputs[2], leg: torch.zeros(3, 3)}
    with pytest.raises(ReshardError, match=r"rank 2 holds a piece of f32 \[3, 3\]"):
        simulate_step(programs, BEFORE, inputs, timeout=60)


def _real(rank: int, world_size: int) -> dict[str, Any]:
    programs = {rank: _programs(16, True)[rank]}
    wait = datetime.timedelta(seconds=60)
    out = {}
    for stage in (BEFORE, AFTER):
        done = run_stage(programs[rank], stage, _inputs(programs, stage)[rank], device_meshes={}, timeout=wait)
        out[stage] = {leg: x.clone() for leg, x in done.items()}
    return out


@pytest.mark.slow
def test_the_simulated_step_equals_the_step_on_gloo_processes() -> None:
    real = run_ranks(_real, WORLD, timeout=120)
    programs = _programs(16, True)
    for stage in (BEFORE, AFTER):
        simulated = simulate_step(programs, stage, _inputs(programs, stage))
        for rank in range(WORLD):
            assert simulated[rank].keys() == real[rank][stage].keys()
            for leg, x in simulated[rank].items():
                assert torch.equal(x, real[rank][stage][leg]), (stage, rank, leg)
