"""The brute force of tests/test_planner_optimal.py with a step overhead, and the check that a plan
is its optimum: shared by the tests of priced plans (test_calibration_plans.py, test_copy_cost.py)."""

from __future__ import annotations

import math
from fractions import Fraction

from tests.test_planner_optimal import Reference


class ReferenceWithOverhead(Reference):
    """The independent brute force of tests/test_planner_optimal.py, every step of any kind
    paying ``overhead`` on the same exact scale."""

    def __init__(self, base: Reference, overhead: float) -> None:
        self.__dict__.update(base.__dict__)
        extra = Fraction(overhead)
        scale = math.lcm(base.scale, extra.denominator)
        self.op_units = {
            op: tuple([u * (scale // base.scale) for u in v] for v in f) for op, f in base.op_units.items()
        }
        self.scale, self.overhead_units = scale, int(extra * scale)
        self.copy_units = base.copy_units * (scale // base.scale)

    def units(self, axis, nbytes, rounds, op="all_gather", copied=0):
        return super().units(axis, nbytes, rounds, op, copied) + self.overhead_units


def assert_brute_force_optimal(ref, got, cost) -> None:
    """``got`` (the planner's plan under ``cost``) costs what the brute force ``ref``'s optimum
    does, in as few steps."""
    want = ref.solve(ref.state_of(got.src), ref.state_of(got.dst), len(got.steps) + 3)
    assert (ref.replay(got), len(got.steps)) == want, f"{got.src} -> {got.dst}, {got.shape}, {got.dtype}, {cost}"
