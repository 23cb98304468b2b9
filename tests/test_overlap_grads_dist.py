"""ZeRO-2 proper under ``overlap=True`` on 2 gloo ranks: by default every gradient is freed once
its bucket has reduced it, during backward, and ``.grad`` holds a placeholder without memory
that refuses to be read or written (``runtime.optim.freed_grads``), so nothing that reads the
gradients after backward runs on nothing without a word.

The gradients are the dyadic pieces of ``tests.optim_support`` (their average is exact), so
the parameters must equal ``torch.optim.AdamW`` on the full gradients bit for bit, with or
without micro-batches accumulated inside ``no_sync()``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.testing import attempt, run_ranks
from tests.optim_support import (
    ADAMW,
    CONFIGS,
    SHAPES,
    _optimizer,
    _reference_run,
    _spec,
    initial_params,
    local_grad,
    step_grads,
)
from tests.test_overlap_dist import BUCKET_BYTES, Pieces

STEPS = 4
SEED = 41


def _setup(rank: int, seed: int = SEED, **options: Any) -> tuple[Pieces, Any, dict[str, Any]]:
    spec = _spec("mesh[dp=2]", CONFIGS["zero_rows"][1])
    model = Pieces(initial_params(torch.float32, seed))
    named = [(n, model.parts[n].weight) for n in SHAPES]
    optimizer = _optimizer("adamw", named, spec, overlap=True, bucket_bytes=BUCKET_BYTES, timeout=20.0, **options)
    return model, optimizer, spec


def _pieces(spec: dict[str, Any], rank: int, step: int, seed: int = SEED) -> dict[str, torch.Tensor]:
    return {n: local_grad(g, a, spec[n].grad, (rank,)) for n, (g, a) in step_grads(torch.float32, seed, step).items()}


def _params(model: Pieces) -> dict[str, torch.Tensor]:
    return {n: model.parts[n].weight.detach().clone() for n in SHAPES}


def _trained(rank: int, micro: int) -> dict[str, Any]:
    """STEPS steps with the default options, each over ``micro`` micro-batches."""
    from runtime.optim.freed_grads import is_freed

    model, optimizer, spec = _setup(rank)
    freed = []
    for step in range(STEPS):
        pieces = _pieces(spec, rank, step)
        optimizer.zero_grad()
        for k in range(micro):
            scaled = {n: g / micro for n, g in pieces.items()}  # exact: micro is 1 or 4
            if k < micro - 1:
                with optimizer.no_sync():
                    model(scaled).backward()
            else:
                model(scaled).backward()
        freed.append(sorted(n for n in SHAPES if is_freed(model.parts[n].weight.grad)))
        optimizer.step()
        assert all(model.parts[n].weight.grad is None for n in SHAPES), "step() left a gradient"
    return {"params": _params(model), "freed": freed, "free_grads": optimizer.free_grads}


def _read_after_backward(rank: int, read: str) -> dict[str, Any]:
    """After an overlapped backward, ``read`` the gradients as torch's tools do: each must raise
    our error; then ``zero_grad()``, a backward and a step run as if nothing had happened."""
    model, optimizer, spec = _setup(rank)
    before = _params(model)
    model(_pieces(spec, rank, 0)).backward()
    if read == "clip_grad_norm_":
        outcome = attempt(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    elif read == "unscale_":
        scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
        scaler.scale(torch.ones(()))  # the scale unscale_ divides by
        outcome = attempt(lambda: scaler.unscale_(optimizer))
    else:  # a second micro-batch outside no_sync(): its backward accumulates into freed gradients
        outcome = attempt(lambda: model(_pieces(spec, rank, 0)).backward())
    refused = attempt(optimizer.step) if read == "second_backward" else ("not run", "", 0.0)
    unchanged = all(torch.equal(before[n], p) for n, p in _params(model).items())
    optimizer.zero_grad(set_to_none=read != "unscale_")  # zeroing a placeholder clears it too
    model(_pieces(spec, rank, 0)).backward()
    optimizer.step()
    return {"outcome": outcome, "refused": refused, "unchanged": unchanged, "params": _params(model)}


def _edited_on_one_rank(rank: int, free_grads: bool) -> dict[str, Any]:
    """Rank 1 halves its gradients in place after an overlapped backward, the other rank does
    not. Kept gradients (``free_grads=False``): every rank waits its buckets out and reduces the
    gradients as they are, warning, and the step commits (a rank reducing anew alone waited
    for collectives its peer never started, until the timeout, and broke the group). Freed
    gradients (the default): the edit raises on rank 1, the step fails on every rank within
    seconds, nothing changes, and after ``zero_grad()`` the next step runs."""
    import warnings

    model, optimizer, spec = _setup(rank, free_grads=free_grads)
    before = _params(model)
    model(_pieces(spec, rank, 0)).backward()
    edited = ("ok", "", 0.0)
    if rank == 1:
        edited = attempt(lambda: [model.parts[n].weight.grad.mul_(0.5) for n in SHAPES])
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        stepped = attempt(optimizer.step)
    out = {"edited": edited, "stepped": stepped, "said": [str(w.message) for w in warned], "params": _params(model)}
    out["unchanged"] = all(torch.equal(before[n], p) for n, p in out["params"].items())
    optimizer.zero_grad()
    out["then"] = attempt(lambda: (model(_pieces(spec, rank, 1)).backward(), optimizer.step()))
    return out


def all_cases(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {f"micro{m}": _trained(rank, m) for m in (1, 4)}
    for read in ("clip_grad_norm_", "unscale_", "second_backward"):
        out[read] = _read_after_backward(rank, read)
    for free_grads in (False, True):
        out[f"edited, free_grads={free_grads}"] = _edited_on_one_rank(rank, free_grads)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(all_cases, 2, timeout=240)


@pytest.mark.parametrize("micro", [1, 4])
def test_overlap_frees_every_gradient_by_default_and_equals_torch_adamw(
    ranks: list[dict[str, Any]], micro: int
) -> None:
    want = _reference_run("adamw", torch.float32, SEED, STEPS, ADAMW)
    for rank, out in enumerate(ranks):
        got = out[f"micro{micro}"]
        assert got["free_grads"] is True, "free_grads is not the default under overlap"
        # Every leg of the ZeRO-2 spec reduce-scatters: every gradient freed during backward.
        assert all(freed == sorted(SHAPES) for freed in got["freed"]), (rank, got["freed"])
        for name in SHAPES:
            assert torch.equal(got["params"][name], want[name]), f"rank {rank} '{name}' differs from torch AdamW"


@pytest.mark.parametrize("read", ["clip_grad_norm_", "unscale_", "second_backward"])
def test_reading_a_freed_gradient_raises_our_error_and_the_next_step_runs(
    ranks: list[dict[str, Any]], read: str
) -> None:
    want = _reference_run("adamw", torch.float32, SEED, 1, ADAMW)
    for rank, out in enumerate(ranks):
        got = out[read]
        kind, message, _ = got["outcome"]
        assert kind == "FreedGradError", (rank, read, kind, message)
        assert "was freed during backward" in message and "free_grads=False" in message, message
        assert "optimizer.clip_grad_norm_" in message and "optimizer.no_sync()" in message, message
        if read == "second_backward":  # the step refuses the half-accumulated gradients
            kind, message, _ = got["refused"]
            assert kind == "OptimizerError", (rank, kind, message)
            assert "after its bucket had taken and freed it" in message, message
        assert got["unchanged"], (rank, read, "parameters changed before the step")
        for name in SHAPES:
            assert torch.equal(got["params"][name], want[name]), f"{read}: rank {rank} '{name}' after zero_grad"


def test_a_gradient_edited_in_place_on_one_rank_kept_is_reduced_again_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    from tests.optim_support import reference

    spec = _spec("mesh[dp=2]", CONFIGS["zero_rows"][1])
    mine = [_pieces(spec, rank, 0) for rank in range(2)]
    ref, optimizer = reference("adamw", initial_params(torch.float32, SEED), ADAMW)
    for name in SHAPES:  # the gradients as they are: rank 1's halved (exact: dyadic)
        ref[name].grad = (mine[0][name] + mine[1][name] * 0.5) / 2
    optimizer.step()
    for rank, out in enumerate(ranks):
        got = out["edited, free_grads=False"]
        assert got["edited"][0] == "ok" and got["stepped"][0] == "ok", (rank, got["edited"], got["stepped"])
        assert got["stepped"][2] < 10, (rank, got["stepped"])
        said = "changed after backward had started" if rank == 1 else "changed on another rank"
        assert any(said in text for text in got["said"]), (rank, got["said"])
        for name in SHAPES:
            assert torch.equal(got["params"][name], ref[name].detach()), f"rank {rank} '{name}'"
        assert got["then"][0] == "ok", (rank, got["then"])


def test_a_freed_gradient_edited_in_place_on_one_rank_fails_the_step_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, out in enumerate(ranks):
        got = out["edited, free_grads=True"]
        if rank == 1:
            assert got["edited"][0] == "FreedGradError", got["edited"]
            assert "'w'" in got["edited"][1] and "aten::mul_" in got["edited"][1], got["edited"]
            assert got["stepped"][0] == "OptimizerError", got["stepped"]
            assert "after its bucket had taken and freed it" in got["stepped"][1], got["stepped"]
        else:
            assert got["stepped"][0] == "OptimizerStepError", got["stepped"]
            assert "unchanged on every rank" in got["stepped"][1], got["stepped"]
        assert got["stepped"][2] < 10, (rank, got["stepped"])
        assert got["unchanged"], rank
        assert got["then"][0] == "ok", (rank, got["then"])
