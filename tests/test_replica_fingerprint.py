"""The replica fingerprint (``runtime.comm.replicas.fingerprint``) against ``torch.equal``: equal
values give equal digests whatever the dtype, strides, storage offset or chunking; each change a
replica can suffer (one element off by one ulp, a sign flip, NaN for a number, two elements
swapped, a permutation, values of opposite sign swapped) gives another digest. The checks are
written against any digest function, and a plain sum of the bits (a weak hash) is shown to
fail them, so they can fail."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import runtime.comm.replicas as replicas
from runtime.comm.replicas import fingerprint

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64, torch.int8)


def _values(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=generator, dtype=torch.float64).to(dtype)
    return torch.randint(-100, 100, (n,), generator=generator, dtype=dtype)


def _next_ulp(x: torch.Tensor, i: int) -> torch.Tensor:
    """``x`` with element ``i`` one ulp (or one unit) up: its bit pattern plus one."""
    y = x.clone()
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    y.view(bits)[i] += 1
    return y


def _perturbations(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The changes a replica must not hide, each leaving a tensor that ``torch.equal`` (on the
    bits) tells from ``x``."""
    n = x.numel()
    out = {"one ulp": _next_ulp(x, n // 3)}
    swapped = x.clone()
    swapped[[1, n - 2]] = swapped[[n - 2, 1]]
    out["two swapped"] = swapped
    out["neighbours swapped"] = torch.cat([x[:4], x[5:6], x[4:5], x[6:]])
    out["permuted"] = x[torch.randperm(n, generator=torch.Generator().manual_seed(1))]
    out["rolled"] = x.roll(7)
    if x.dtype.is_floating_point or x.dtype in (torch.int32, torch.int64, torch.int8):
        flipped = x.clone()
        flipped[2] = -flipped[2]
        out["sign flipped"] = flipped
        opposite = x.clone()
        opposite[3], opposite[n - 5] = x[3].abs(), -x[3].abs()
        swapped_signs = opposite.clone()
        swapped_signs[[3, n - 5]] = swapped_signs[[n - 5, 3]]
        out["x and -x swapped"] = swapped_signs
        out["x and -x, before the swap"] = opposite  # compared with swapped_signs below
    if x.dtype.is_floating_point:
        nan = x.clone()
        nan[5] = float("nan")
        out["NaN for a number"] = nan
        zero = x.clone()
        zero[6] = 0.0
        negative_zero = x.clone()
        negative_zero[6] = -0.0
        out["0.0"], out["-0.0"] = zero, negative_zero
    return out


def _check(digest: Callable[[torch.Tensor], int], dtype: torch.dtype, n: int) -> list[str]:
    """The perturbations of a random ``x`` whose digest equals one of a tensor with other bits."""
    x = _values(dtype, n, seed=n)
    assert digest(x) == digest(x.clone()) == digest(torch.cat([x[:3], x[3:]]))
    variants = _perturbations(x)
    variants["original"] = x
    missed = []
    names = list(variants)
    for a_index, a_name in enumerate(names):
        for b_name in names[a_index + 1 :]:
            a, b = variants[a_name], variants[b_name]
            same_bits = a.view(torch.uint8).equal(b.view(torch.uint8))
            if (digest(a) == digest(b)) != same_bits:
                missed.append(f"{a_name} vs {b_name}")
    return missed


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [11, 64, 3 * replicas.BLOCK + 5], ids=["11", "64", "chunks"])
def test_the_fingerprint_tells_every_perturbation(dtype: torch.dtype, n: int) -> None:
    assert _check(fingerprint, dtype, n) == []


def test_a_plain_sum_of_the_bits_fails_these_checks() -> None:
    """The checks above catch a weak hash: a sum of the bits misses swaps and permutations."""

    def plain_sum(x: torch.Tensor) -> int:
        return int(x.view(torch.uint8).to(torch.int64).sum())

    missed = _check(plain_sum, torch.float32, 64)
    assert "two swapped" in " ".join(missed) and "permuted" in " ".join(missed)


def test_a_linear_hash_misses_values_of_opposite_sign_swapped() -> None:
    """A weighted sum modulo 2**32 with odd weights (what a cheaper fingerprint would do) hides
    x and -x swapped: the checks above see it."""

    def linear32(x: torch.Tensor) -> int:
        words = x.view(torch.int32)
        weights = (torch.arange(words.numel(), dtype=torch.int32) * 2 + 1) * 40503
        return int((words * weights).sum(dtype=torch.int32))

    assert "x and -x swapped vs x and -x, before the swap" in _check(linear32, torch.float32, 64)


def test_equal_values_give_equal_fingerprints_whatever_the_layout() -> None:
    base = torch.randn(40, 6, dtype=torch.float64).to(torch.bfloat16)
    digest = fingerprint(base)
    assert fingerprint(base.t().contiguous().t()) == digest  # other strides
    storage = torch.cat([torch.zeros(1, dtype=torch.bfloat16), base.reshape(-1)])
    assert fingerprint(storage[1:].view(40, 6)) == digest  # an odd storage offset
    assert fingerprint(base.reshape(-1)[:-1]) != fingerprint(torch.cat([base.reshape(-1)[:-1], base.new_zeros(1)]))


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64], ids=str)
def test_other_dtypes_are_fingerprinted_by_their_bytes(dtype: torch.dtype) -> None:
    x = torch.randn(13).gt(0) if dtype == torch.bool else torch.randn(13, dtype=dtype)
    y = x.clone()
    y[4] = ~y[4] if dtype == torch.bool else -y[4]
    assert fingerprint(x) == fingerprint(x.clone()) != fingerprint(y)


@pytest.mark.parametrize("span", [replicas.BLOCK, 4 * replicas.BLOCK, replicas.CHUNK], ids=["1", "4", "chunk"])
def test_the_digest_does_not_depend_on_how_the_pass_is_chunked(span: int) -> None:
    """The accelerators' path (chunks of many blocks, multiplied then summed) gives the CPU's
    digest (a block at a time, a fused dot), checked against a sum written out in Python."""
    words = torch.randint(-(2**31), 2**31, (9 * replicas.BLOCK + 7,), dtype=torch.int32)
    cpu = replicas._block_sums(words, replicas.BLOCK, fused=True)
    assert torch.equal(replicas._block_sums(words, span, fused=False), cpu)
    weights = replicas._weights(words.device).tolist()
    x = words.tolist()
    for block in (0, 9):
        expected = sum(v * weights[i] for i, v in enumerate(x[block * replicas.BLOCK : (block + 1) * replicas.BLOCK]))
        assert int(cpu[block]) == replicas._signed(expected % 2**64)
