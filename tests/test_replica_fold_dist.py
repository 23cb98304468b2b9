"""The gradients' replica check rides on the step's commit flag (docs/design/failures.md,
"Replicas"), on 4 gloo ranks: every ``torch.distributed`` collective a rank calls is counted (the
functions wrapped in each rank), and a step checked (``verify_replicas=1``) calls the same
collectives as one not checked (``verify_replicas=False``), the flag's all-reduce 16 bytes per
class of replicas larger, counted by hand from the mesh. A gradient perturbed on one rank (a
ZeRO-1 spec whose gradients are declared ``R``, no DDP) still raises ``ReplicaMismatchError``
on every rank, naming the tensor, axis and ranks, nothing committed; without a commit flag
(``all_ranks_commit=False``) the check runs its own collectives and raises the same."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.testing import attempt, run_ranks
from tests.failed_step import snapshot, unchanged_since

SHAPES = {"w": (8, 6), "b": (6,)}
# name: (mesh, per tensor (param and grad, state), how many classes of replicas the gradients
# make: mesh[dp=4] with gradients R: one class of 4 ranks; mesh[dp=2,tp=2] with w's gradient
# split over tp (a class per tp coordinate: 2) and b's R over both axes (1).
CASES = {
    "zero1": ("mesh[dp=4]", {"w": ("R,R", "S(dp),R"), "b": ("R", "S(dp)")}, 1),
    "dp2_tp2": ("mesh[dp=2,tp=2]", {"w": ("R,S(tp)", "S(dp),S(tp)"), "b": ("R", "S(dp)")}, 3),
}
# The collectives counted, with the position of the tensor whose bytes a rank sends.
COUNTED = {
    "all_reduce": 0, "all_gather_into_tensor": 1, "all_gather": 1, "all_gather_object": 1, "reduce_scatter_tensor": 1,
    "all_to_all_single": 1, "broadcast": 0, "broadcast_object_list": 0, "batch_isend_irecv": None, "barrier": None,
    "send": 0, "recv": 0, "isend": 0, "irecv": 0, "reduce": 0, "gather": 0, "scatter": 0,
}  # fmt: skip


def _counting() -> list[tuple[str, int]]:
    """Wrap every collective of ``torch.distributed`` (and the aliases the runtime bound at
    import) to log ``(name, bytes sent)``; returns the log."""
    import torch.distributed as dist

    import runtime.comm.collectives as collectives

    calls: list[tuple[str, int]] = []

    def wrap(name: str, fn: Any, at: int | None) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            held = args[at] if at is not None and len(args) > at else None
            calls.append((name, held.numel() * held.element_size() if isinstance(held, torch.Tensor) else 0))
            return fn(*args, **kwargs)

        return counted

    for name, at in COUNTED.items():
        setattr(dist, name, wrap(name, getattr(dist, name), at))
    collectives.all_gather_single = dist.all_gather_into_tensor
    collectives.reduce_scatter_single = dist.reduce_scatter_tensor
    return calls


def _spec(mesh: str, layouts: dict[str, tuple[str, str]]) -> dict:
    from shardlang import parse_layout
    from shardlang.spec import Layouts, TensorSpec

    def of(name: str) -> Layouts:
        param, state = layouts[name]
        return Layouts(
            param=parse_layout(f"{param} over {mesh}"),
            grad=parse_layout(f"{param} over {mesh}"),
            states=(("", parse_layout(f"{state} over {mesh}")),),
        )

    return {n: TensorSpec(name=n, dtype="f32", shape=s, layouts=of(n)) for n, s in SHAPES.items()}


def _piece(full: torch.Tensor, layout: str, rank: int, mesh: str) -> torch.Tensor:
    """This rank's piece, cut by hand: on mesh[dp=2,tp=2] rank = 2 dp + tp, 'S(tp)' on w's
    last dim halves it."""
    if "S(tp)" not in layout:
        return full.clone()
    tp = rank % 2
    return full[:, 3 * tp : 3 * tp + 3].clone()


def _params(case: str, rank: int) -> dict[str, torch.nn.Parameter]:
    mesh, layouts, _ = CASES[case]
    generator = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=generator) for n, s in SHAPES.items()}
    return {n: torch.nn.Parameter(_piece(full[n], layouts[n][0], rank, mesh)) for n in SHAPES}


def _grads(case: str, params: dict[str, torch.nn.Parameter], rank: int, step: int, off_on: int | None = None) -> None:
    """The same full gradients on every rank (as DDP leaves them), cut to each rank's piece;
    ``off_on``: the rank whose w gradient is perturbed in one element."""
    mesh, layouts, _ = CASES[case]
    generator = torch.Generator().manual_seed(100 + step)
    for n, s in SHAPES.items():
        params[n].grad = _piece(torch.randn(s, generator=generator), layouts[n][0], rank, mesh)
    if rank == off_on:
        params["w"].grad[1, 2] += 1e-3


def _run(rank: int, world_size: int, case: str) -> dict[str, Any]:
    from runtime.optim import ShardedAdamW

    calls = _counting()
    mesh, layouts, _ = CASES[case]
    spec = _spec(mesh, layouts)
    out: dict[str, Any] = {}
    built = {}
    for name, kwargs in (("off", {"verify_replicas": False}), ("every", {"verify_replicas": 1})):
        params = _params(case, rank)
        built[name] = params, ShardedAdamW(list(params.items()), spec, lr=0.1, timeout=30, **kwargs)
    # Two steps each first (their groups created, their plans compiled), then one counted.
    for step in range(3):
        for name, (params, optimizer) in built.items():
            _grads(case, params, rank, step)
            del calls[:]
            optimizer.step()
            out[name] = list(calls)

    def perturbed(key: str, params: dict, optimizer: Any, step: int) -> None:
        """A step whose gradient differs on the last rank: what it raised (``key``), the
        collectives it called, and whether it changed nothing."""
        _grads(case, params, rank, step, off_on=world_size - 1)
        before = snapshot(optimizer, params)
        del calls[:]
        out[key] = attempt(optimizer.step)
        out[f"{key} calls"] = list(calls)
        out[f"{key}, unchanged"] = unchanged_since(before, optimizer, params)

    # One rank's gradient perturbed: refused on every rank, nothing committed, then retried.
    params, optimizer = built["every"]
    perturbed("mismatch", params, optimizer, 3)
    _grads(case, params, rank, 3)
    out["then equal"] = attempt(optimizer.step)

    # No commit flag: the check's own collectives, the same error.
    params = _params(case, rank)
    without_flag = ShardedAdamW(list(params.items()), spec, lr=0.1, timeout=30, all_ranks_commit=False)
    perturbed("no flag", params, without_flag, 0)
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def ranks(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, run_ranks(_run, 4, (request.param,), timeout=240, collective_timeout=60)


def _names(calls: list[tuple[str, int]]) -> list[str]:
    return [name for name, _ in calls]


@pytest.mark.slow
def test_a_checked_step_calls_the_same_collectives_a_few_bytes_larger(ranks: tuple[str, list[dict]]) -> None:
    case, outs = ranks
    classes = CASES[case][2]
    for out in outs:
        assert out["off"] and _names(out["every"]) == _names(out["off"]), (out["every"], out["off"])
        added = [b - a for (_, b), (_, a) in zip(out["every"], out["off"], strict=True) if b != a]
        # Only the first commit flag grows: v and ~v (int64) per class of replicas.
        assert added == [16 * classes], (added, out["every"], out["off"])
        assert "all_gather_object" not in _names(out["every"])


@pytest.mark.slow
def test_a_gradient_that_differs_on_one_rank_is_refused_on_every_rank(ranks: tuple[str, list[dict]]) -> None:
    case, outs = ranks
    # Rank 3's w differs: on mesh[dp=2,tp=2] from rank 1's only (its class along dp); ranks 0
    # and 2, whose class agrees, are told that other ranks differ.
    differ = "ranks [0, 1, 2] vs ranks [3]" if case == "zero1" else "ranks [1] vs ranks [3]"
    for rank, out in enumerate(outs):
        for key in ("mismatch", "no flag"):
            kind, text, _ = out[key]
            assert kind == "ReplicaMismatchError", out[key]
            assert text.startswith("gradients of step ") and "wrap the model in DDP" in text, text
            if case == "zero1" or rank in (1, 3):
                assert "declared replicated differ across ranks" in text, text
                assert f"'w' along dp ({differ} hold different values)" in text and "'b'" not in text, text
            else:
                assert "declared replicated differ across other ranks (1 tensor; their errors name them)" in text, text
            assert out[f"{key}, unchanged"], key
        assert out["then equal"][0] == "ok", out["then equal"]
        # The slow path runs only on a mismatch: an all-gather of the groups' headers there.
        assert "all_gather_into_tensor" in _names(out["mismatch calls"])
