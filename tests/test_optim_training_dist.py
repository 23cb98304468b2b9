"""Data-parallel training of an MLP with the sharded optimizers on 4 gloo ranks, each on its
quarter of the batch, against single-process training with torch.optim.AdamW and
came_pytorch.CAME on the whole batch; clipping (``max_grad_norm`` and ``clip_grad_norm_``)
against torch.nn.utils.clip_grad_norm_, also with overlap, ``prefetch_params`` and
``free_grads``. The MLP and its batches are tests/optim_support.py's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import came_pytorch
import pytest
import torch

from runtime.testing import run_ranks
from tests.optim_support import ADAMW, CAME, MLP_SPEC, _optimizer, mlp, mlp_batches

CLIP = 0.73  # the MLP's gradient norms run from 0.52 to 0.86 over its 10 steps, none within 1e-3 of it


def _run_training(
    rank: int,
    kind: str,
    flat_axis: str | None,
    seed: int,
    max_grad_norm: float | None = None,
    clip_method: bool = False,
    overlap: bool = False,
    free_grads: bool = False,
) -> dict[str, Any]:
    """10 steps of an MLP; every rank trains on its 3 of the 12 samples; the global gradient
    norm of every step when clipping (``max_grad_norm``, or ``optimizer.clip_grad_norm_`` before
    each step with ``clip_method``). ``overlap``: buckets of 256 bytes started during backward,
    ``prefetch_params`` of both layers, and every bucket's result landing late
    (``tests.late_results``). ``free_grads``: gradients freed once their buckets took them (the
    run records whether any was left after backward and after the step)."""
    from shardlang import parse_spec
    from tests.late_results import LateResults

    model = mlp(seed)
    options: dict[str, Any] = {"flat_axis": flat_axis, "max_grad_norm": None if clip_method else max_grad_norm}
    options["free_grads"] = free_grads
    if overlap:
        options |= {"overlap": True, "bucket_bytes": 256}
    optimizer = _optimizer(kind, list(model.named_parameters()), parse_spec(MLP_SPEC), **options)
    if overlap:
        optimizer.prefetch_params(model[0], model[2])
    norms, started, left = [], [], []
    results = LateResults()
    with results.installed(), results.delayed() if overlap else contextlib.nullcontext():
        for step in range(10):
            x, y = mlp_batches(seed, step)
            mine = slice(3 * rank, 3 * rank + 3)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            started.append(optimizer.buckets_started)
            returned = optimizer.clip_grad_norm_(max_grad_norm) if clip_method else None
            optimizer.step()
            left.append(sum(p.grad is not None for p in model.parameters()))
            norms.append(None if optimizer.last_grad_norm is None else float(optimizer.last_grad_norm))
            if returned is not None:
                assert float(returned) == norms[-1], (float(returned), norms[-1])
        optimizer.wait_params()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "norms": norms, "started": started, "left": left}


def all_cases(rank: int, world_size: int) -> dict[str, Any]:
    """Every case of this module on this rank."""
    out: dict[str, Any] = {}
    for kind, flat_axis in (("adamw", None), ("came", None), ("came", "dp")):
        out[("training", kind, flat_axis)] = _run_training(rank, kind, flat_axis, seed=12)
    for kind, flat_axis in (("adamw", None), ("adamw", "dp"), ("came", None)):
        out[("clipped", kind, flat_axis)] = _run_training(rank, kind, flat_axis, seed=14, max_grad_norm=CLIP)
        out[("clip_method", kind, flat_axis)] = _run_training(
            rank, kind, flat_axis, seed=14, max_grad_norm=CLIP, clip_method=True
        )
        out[("clip_method_overlap", kind, flat_axis)] = _run_training(
            rank, kind, flat_axis, seed=14, max_grad_norm=CLIP, clip_method=True, overlap=True
        )
        out[("clip_method_free", kind, flat_axis)] = _run_training(
            rank, kind, flat_axis, seed=14, max_grad_norm=CLIP, clip_method=True, free_grads=True
        )
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(all_cases, 4, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "flat_axis"), [("adamw", None), ("came", None), ("came", "dp")])
def test_data_parallel_training_equals_single_process_training(
    ranks: list[dict[str, Any]], kind: str, flat_axis: str | None
) -> None:
    model = mlp(12)
    named = list(model.named_parameters())
    if kind == "adamw":
        optimizer = torch.optim.AdamW([p for _, p in named], foreach=False, **ADAMW)
    else:
        optimizer = came_pytorch.CAME([p for _, p in named], **CAME)
    for step in range(10):
        x, y = mlp_batches(12, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    for rank, result in enumerate(ranks):
        got = result[("training", kind, flat_axis)]["params"]
        for name, p in named:
            torch.testing.assert_close(got[name], p.detach(), rtol=2e-5, atol=2e-6, msg=f"rank {rank} '{name}'")


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "flat_axis"), [("adamw", None), ("adamw", "dp"), ("came", None)])
def test_clipping_equals_torch_clip_grad_norm_in_single_process_training(
    ranks: list[dict[str, Any]], kind: str, flat_axis: str | None
) -> None:
    """``max_grad_norm`` (and ``optimizer.clip_grad_norm_`` before each step, which returns the
    norm) on the reduced gradients against ``torch.nn.utils.clip_grad_norm_`` on the whole batch:
    the same norm every step, clipping at the same steps (some, not all), the same parameters;
    also with overlap and ``prefetch_params``, and with ``free_grads``."""
    model = mlp(14)
    params = [p for _, p in model.named_parameters()]
    hyper = ADAMW if kind == "adamw" else CAME
    optimizer = (
        torch.optim.AdamW(params, foreach=False, **hyper) if kind == "adamw" else came_pytorch.CAME(params, **hyper)
    )
    norms = []
    for step in range(10):
        x, y = mlp_batches(14, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        optimizer.step()
    clipped = [n > CLIP for n in norms]
    assert any(clipped) and not all(clipped), norms
    for rank, result in enumerate(ranks):
        for how in ("clipped", "clip_method", "clip_method_overlap", "clip_method_free"):
            got = result[(how, kind, flat_axis)]
            # free_grads (without overlap: in clip_grad_norm_): no gradient left after the step.
            assert all(n == (0 if how.endswith("free") else len(params)) for n in got["left"]), (how, got["left"])
            assert [n > CLIP for n in got["norms"]] == clipped, (rank, how, got["norms"], norms)
            if how == "clip_method_overlap":  # every step's buckets started during backward
                assert all(n > 1 for n in got["started"]), (rank, got["started"])
            for mine, want in zip(got["norms"], norms, strict=True):
                assert mine == pytest.approx(want, rel=1e-5)
            for name, p in model.named_parameters():
                torch.testing.assert_close(
                    got["params"][name], p.detach(), rtol=2e-5, atol=2e-6, msg=f"rank {rank} '{name}'"
                )
