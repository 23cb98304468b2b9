"""Declared replication verified (``runtime.comm.replicas``): fingerprints against ``torch.equal``,
and on 4 gloo ranks of a [dp=2, tp=2] mesh, a replica that differs in one element, or holds
the same elements swapped, raises on every rank, naming the tensor, the axis and the ranks."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch

from runtime.comm.replicas import GRADIENTS_CAUSE, PARAMETERS_CAUSE, fingerprint, verify_replicas
from runtime.testing import attempt, run_ranks
from shardlang import parse_layout

MESH = "mesh[dp=2,tp=2]"
DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool, torch.complex64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fingerprints_agree_exactly_when_the_values_do(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    for trial in range(20):
        shape = (int(torch.randint(1, 40, (1,), generator=generator)), 3)
        a = (torch.randn(shape, generator=generator) * 100).to(dtype)
        b = a.clone()
        i = trial % a.numel()
        flat = b.view(-1)
        flat[i] = flat[i] + 1 if dtype != torch.bool else ~flat[i]
        swapped = a.clone().view(-1)
        j = (i + 1 + trial) % a.numel()
        swapped[[i, j]] = swapped[[j, i]]
        assert fingerprint(a) == fingerprint(a.clone()) == fingerprint(a.t().contiguous().t())
        assert (fingerprint(a) == fingerprint(b)) == torch.equal(a, b)
        assert (fingerprint(a) == fingerprint(swapped.view(shape))) == torch.equal(a, swapped.view(shape))


def test_a_large_piece_is_fingerprinted_in_chunks_with_the_same_result() -> None:
    import runtime.comm.replicas as replicas

    a = torch.randn(3 * replicas.BLOCK + 5)
    whole = fingerprint(a)
    b = a.clone()
    b[2 * replicas.BLOCK + 1] += 1
    assert fingerprint(b) != whole
    assert fingerprint(torch.cat([a[:7], a[7:]])) == whole


def _pieces(rank: int, change: str, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor, Any]]:
    """``w`` split over tp, replicated over dp; ``v`` replicated over both; ``s`` split over
    both (nothing to check). Every rank builds the full tensors alike and takes its piece."""
    generator = torch.Generator().manual_seed(0)
    w, v, s = (torch.randn(shape, generator=generator).to(dtype) for shape in ((4, 6), (5,), (4, 6)))
    tp, dp = rank % 2, rank // 2
    w_piece, v_piece, s_piece = (
        w[:, 3 * tp : 3 * tp + 3].clone(),
        v.clone(),
        s[2 * dp : 2 * dp + 2, 3 * tp : 3 * tp + 3],
    )
    if change == "one element" and rank == 3:
        w_piece[1, 2] += 1e-3
    if change == "swapped" and rank == 1:
        v_piece[[0, 4]] = v_piece[[4, 0]]
    if change == "split only" and rank == 2:
        s_piece = s_piece + 1  # a split piece is the rank's own: nothing to compare
    return [
        ("w", w_piece, parse_layout(f"R,S(tp) over {MESH}")),
        ("v", v_piece, parse_layout(f"R over {MESH}")),
        ("s", s_piece, parse_layout(f"S(dp),S(tp) over {MESH}")),
    ]


def _run(rank: int, world_size: int) -> dict[str, Any]:
    timeout = datetime.timedelta(seconds=30)
    out = {}
    for change in ("none", "one element", "swapped", "split only"):
        for what, cause in (("parameters", PARAMETERS_CAUSE), ("gradients", GRADIENTS_CAUSE)):
            pieces = _pieces(rank, change)
            out[(change, what)] = attempt(
                lambda pieces=pieces, what=what, cause=cause: verify_replicas(
                    pieces, rank, what=what, cause=cause, timeout=timeout
                )
            )
    out["bf16"] = attempt(
        lambda: verify_replicas(
            _pieces(rank, "one element", torch.bfloat16),
            rank,
            what="parameters",
            cause=PARAMETERS_CAUSE,
            timeout=timeout,
        )
    )
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_run, 4, timeout=120)


def _mismatch(rank: int, got: dict[Any, Any], case: tuple[str, str]) -> str:
    """What ``case`` raised on ``rank``, which must be a ReplicaMismatchError: its message."""
    kind, message, _ = got[case]
    assert kind == "ReplicaMismatchError", (rank, kind, message)
    return message


@pytest.mark.slow
@pytest.mark.parametrize("what", ["parameters", "gradients"])
def test_equal_replicas_pass_and_split_pieces_are_left_alone(ranks: list, what: str) -> None:
    for rank, got in enumerate(ranks):
        assert got[("none", what)][0] == "ok", (rank, got[("none", what)])
        assert got[("split only", what)][0] == "ok", (rank, got[("split only", what)])


@pytest.mark.slow
def test_one_element_off_raises_on_every_rank_naming_tensor_axis_and_ranks(ranks: list) -> None:
    # rank 3 is (dp=1, tp=1): its dp replica is rank 1; ranks 0 and 2 hold the other tp half.
    for rank, got in enumerate(ranks):
        message = _mismatch(rank, got, ("one element", "parameters"))
        assert "seed every rank alike" in message, message
        if rank in (1, 3):
            assert "'w' along dp (ranks [1] vs ranks [3] hold different values)" in message, message
        else:
            assert "parameters declared replicated differ across other ranks (1 tensor;" in message, message
    _, message, _ = ranks[3][("one element", "gradients")]
    assert "wrap the model in DDP" in message and "P(dp):avg" in message, message
    assert ranks[1]["bf16"][0] == "ReplicaMismatchError", ranks[1]["bf16"]


@pytest.mark.slow
def test_the_same_elements_in_another_order_differ(ranks: list) -> None:
    # rank 1 swapped two elements of v, which all four ranks replicate (dp and tp).
    for rank, got in enumerate(ranks):
        message = _mismatch(rank, got, ("swapped", "parameters"))
        assert "'v' along dp,tp (ranks [0, 2, 3] vs ranks [1] hold different values)" in message, message
