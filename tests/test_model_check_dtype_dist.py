"""A bf16 or f64 model with a spec that declares f32: ``shardlang check --model`` warns for
each tensor and prices the step with the model's dtypes, and that price is what the optimizer
on 2 gloo ranks plans to move (``planned_traffic``), not the spec's f32 one. The independent
check: the bytes scale with the element size (half of f32's for bf16, twice for f64)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.testing import run_ranks

SPEC = """
mesh world = [dp=2]
tensor w : f32[8, 6] { param = R,R over world  grad = R,R | P(dp):avg over world  state = S(dp),R over world }
tensor b : f32[6] { param = R over world  grad = R | P(dp):avg over world  state = S(dp) over world }
"""
F32_BYTES = {torch.bfloat16: 2, torch.float64: 8}


def _parameters(dtype: torch.dtype) -> list[tuple[str, torch.nn.Parameter]]:
    generator = torch.Generator().manual_seed(0)
    shapes = {"w": (8, 6), "b": (6,)}
    return [(n, torch.nn.Parameter(torch.randn(s, generator=generator).to(dtype))) for n, s in shapes.items()]


def _planned(rank: int, world_size: int, dtype: torch.dtype) -> int:
    from runtime.optim import ShardedAdamW
    from shardlang import parse_spec

    optimizer = ShardedAdamW(_parameters(dtype), parse_spec(SPEC), lr=1e-3)
    return optimizer.planned_traffic().reshard_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_the_check_prices_what_the_optimizer_moves(dtype: torch.dtype) -> None:
    from planner.spec_plan import plan_spec
    from shardlang import parse_spec
    from shardlang.model_check import WARNING, check_model, with_model_dtypes

    spec, parameters = parse_spec(SPEC), _parameters(dtype)
    check = check_model(spec, parameters, world_size=2)
    assert [(f.severity, f.kind) for f in check.findings] == [(WARNING, "dtype")] * 2 and check.ok
    name = {torch.bfloat16: "bf16", torch.float64: "f64"}[dtype]
    assert f"declared f32 but the model's parameter is {name}" in check.findings[0].message
    declared = plan_spec(spec).total_bytes
    priced = plan_spec(with_model_dtypes(spec, parameters)).total_bytes
    assert priced * 4 == declared * F32_BYTES[dtype]  # the element size, not the declared f32
    moved: list[Any] = run_ranks(_planned, 2, (dtype,), timeout=120)
    assert moved == [priced, priced]


def test_with_model_dtypes_takes_each_parameters_dtype_by_name_or_without_a_prefix() -> None:
    from shardlang import parse_spec
    from shardlang.model_check import with_model_dtypes

    spec = parse_spec(SPEC + "tensor gone : f32[2] { param = R over world }\n")
    entries = [("module.w", (8, 6), "bf16"), ("b", (6,), "torch.float64"), ("module.b", (6,), "f16")]
    dtypes = {t.name: t.dtype for t in with_model_dtypes(spec, entries).tensors}
    assert dtypes == {"w": "bf16", "b": "f64", "gone": "f32"}  # the exact name before the bare one
