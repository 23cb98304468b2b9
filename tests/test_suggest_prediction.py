"""``Problem.prediction``, which derives each group's candidates once
(``planner.memory.ChoiceMemory``), equals ``predict_memory`` of the whole chosen spec
(tests/test_suggest_memory_dist.py checks that against ``memory_report()``) for choices that
mix candidates within a group (and ``Problem.evaluate``'s memory, which shares its pricing's
merge of the step), under a fixed cap, the smallest one and the cost model's, with
and without flat sharding."""

from __future__ import annotations

import random

import pytest

from planner.bucket_cap import AUTO
from planner.memory import predict_memory
from planner.suggest import Choice, build_problems
from shardlang import parse_spec

# Groups of several tensors (equal shapes, dtypes and layouts), so that a choice may give the
# tensors of one group different candidates.
SPEC = """
mesh world = [dp=2, tp=2]  bandwidth [25e9, 5e10]  latency [20us, 8us]
tensor w0 : f32[64, 32] { param = R,S(tp) over world  grad = R,S(tp) | P(dp):avg over world }
tensor w1 : f32[64, 32] { param = R,S(tp) over world  grad = R,S(tp) | P(dp):avg over world }
tensor w2 : f32[64, 32] { param = R,S(tp) over world  grad = R,S(tp) | P(dp):avg over world }
tensor b0 : bf16[48] { param = R over world  grad = R | P(dp):avg over world }
tensor b1 : bf16[48] { param = R over world  grad = R | P(dp):avg over world }
tensor e : bf16[40, 24] { param = R,R over world  grad = R,R | P(dp):avg over world }
"""


@pytest.mark.parametrize("optimizer", ["adamw", "came"])
@pytest.mark.parametrize("cap", [None, 1, AUTO])
def test_prediction_is_predict_memory_of_the_chosen_spec(optimizer: str, cap: int | str | None) -> None:
    rng = random.Random(7)
    spec = parse_spec(SPEC)
    problems = build_problems(spec, optimizer, bucket_bytes=cap)
    assert len(problems) > 1  # the flat problems too
    assert any(len(g.tensors) > 1 and len(g.candidates) > 1 for g in problems[0].groups)
    for problem in problems:
        for _ in range(12):
            picks = tuple(tuple(rng.randrange(len(g.candidates)) for _ in g.tensors) for g in problem.groups)
            spec_of = problem.spec_of(Choice(picks=picks, memory=0, seconds=0.0))
            expected = predict_memory(
                spec_of, optimizer, flat_axis=problem.flat_axis, bucket_bytes=problem.bucket_bytes
            )
            assert problem.prediction(picks) == expected, (problem.flat_axis, picks)
            # evaluate buckets the step from the stages its pricing merged (planner.legs.Merged)
            assert problem.evaluate(picks).memory == expected.total_bytes, (problem.flat_axis, picks)
