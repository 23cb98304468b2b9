"""Rank-free layouts in rules: a layout naming fewer dims than the tensor has leaves the
trailing dims replicated; declared tensors keep the exact-rank check; printing round-trips."""

from __future__ import annotations

import pytest

from planner.model import plan_spec
from shardlang import SpecError, format_spec, parse_layout, parse_spec

MESH = "mesh world = [dp=4, tp=2]\n"
RULES = (
    MESH
    + 'rule "h.*.weight" { param = R,S(tp) over world  grad = R,S(tp) | P(dp):avg over world }\n'
    + 'rule "scalar.*" { param = () over world }\n'
    + 'rule "*" { param = R over world  grad = R | P(dp):avg over world  state = S(dp) over world }\n'
)


def _full(text: str) -> object:
    return parse_layout(text, {"world": parse_spec(MESH).mesh("world")})


def test_one_rule_covers_tensors_of_any_rank() -> None:
    spec = parse_spec(RULES)
    for shape, dims in (((8,), "R"), ((8, 6), "R,R"), ((8, 6, 2), "R,R,R")):
        t = spec.resolve("emb", shape, "f32")
        state = "S(dp)" + dims[1:]
        assert (t.param, t.grad, t.state()) == (
            _full(f"{dims} over world"),
            _full(f"{dims} | P(dp):avg over world"),
            _full(f"{state} over world"),
        )
    assert spec.resolve("scalar.x", (3, 3), "f32").state() == _full("R,R over world")  # () names no dim
    # The first matching rule wins, and fills its own layouts.
    t = spec.resolve("h.0.weight", (4, 6, 3), "bf16")
    assert t.param == _full("R,S(tp),R over world") and t.grad == _full("R,S(tp),R | P(dp):avg over world")
    # A 1-d tensor against a 2-d rule is an error, not a fall-through to the next rule.
    with pytest.raises(SpecError, match=r"a 2-d param layout 'R,S\(tp\) over world': .* never more"):
        spec.resolve("h.0.weight", (4,), "f32")


def test_rank_free_rules_plan_and_round_trip() -> None:
    spec = parse_spec(RULES)
    assert str(spec.rules[2].layouts.state()) == "S(dp) over world"
    text = format_spec(spec)
    rule = ["rule", '"*"', "{", "param = R over world", "grad  = R | P(dp):avg over world", "state = S(dp) over world"]
    assert "\n".join(["", " ".join(rule[:3]), *(f"  {line}" for line in rule[3:]), "}"]) in text
    assert parse_spec(text) == spec
    resolved = [spec.resolve("a", (16, 4), "f32"), spec.resolve("b", (12,), "f32")]
    step = plan_spec(spec, tensors=resolved).step
    assert [b.op for b in step.buckets] == ["reduce_scatter", "all_gather"]  # ZeRO over dp, both tensors


def test_declared_tensors_keep_the_exact_rank() -> None:
    with pytest.raises(SpecError, match=r"has shape \[4, 4\] \(2 dims\) but its param layout has 1 dims"):
        parse_spec(MESH + "tensor a : f32[4, 4] { param = R over world }")
