"""runtime.measure.flops: the matrix-product rate the cost model's flops_per_second carries, on a
clock that advances a fixed step per reading (so every timed product takes that step)."""

from __future__ import annotations

import itertools

import pytest

from runtime.measure import flops


@pytest.fixture
def ticking(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = itertools.count(step=1e-3)
    monkeypatch.setattr(flops.time, "perf_counter", lambda: next(clock))


def test_the_rate_is_the_median_over_sizes_of_2_n_cubed_per_product(ticking: None) -> None:
    # Each product is read as 1 ms: the sizes' rates are 2 n^3 / 1e-3; their median is 32's.
    assert flops.matmul_rate(sizes=(64, 16, 32), reps=3, budget=1e6) == pytest.approx(2 * 32**3 / 1e-3)


def test_a_spent_budget_stops_the_sweep_after_the_smallest_size(ticking: None) -> None:
    assert flops.matmul_rate(sizes=(16, 32, 64), reps=2, budget=0.0) == pytest.approx(2 * 16**3 / 1e-3)
