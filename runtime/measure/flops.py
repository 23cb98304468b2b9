"""Measuring one rank's matrix-product rate, for the cost model's ``flops_per_second``
(``planner.cost``), which prices Muon's Newton-Schulz iterations (``planner.matrices``).

:func:`matmul_rate` times square bf16 matrix products (the dtype the iteration runs in, as
torch's ``torch.optim.Muon`` runs it) on the default device of this process, at the sizes of
:data:`SWEEP_SIZES` while a time budget lasts: per size the median of ``reps`` timed products
after one warm-up, ``2 n^3`` flops each. The rate is the median over the sizes measured, so
that one size the machine handles unusually well or badly does not decide it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

SWEEP_SIZES = (128, 256, 512, 1024)
DEFAULT_REPS = 5
DEFAULT_BUDGET = 5.0  # seconds for the whole sweep


def matmul_rate(
    sizes: Sequence[int] = SWEEP_SIZES,
    reps: int = DEFAULT_REPS,
    budget: float = DEFAULT_BUDGET,
    device: torch.device | None = None,
) -> float:
    """Flops per second of ``n x n`` bf16 products (module docstring); the smallest size is
    always measured, larger ones while the budget lasts."""
    device = torch.device("cpu") if device is None else device
    started = time.perf_counter()
    rates = []
    for n in sorted(sizes):
        if rates and time.perf_counter() - started > budget:
            break
        a = torch.randn(n, n, device=device).bfloat16()
        b = torch.randn(n, n, device=device).bfloat16()
        times = []
        for _ in range(reps + 1):
            _sync(device)
            begin = time.perf_counter()
            torch.mm(a, b)
            _sync(device)
            times.append(time.perf_counter() - begin)
        rates.append(2 * n**3 / max(statistics.median(times[1:]), 1e-9))
    return statistics.median(rates)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
