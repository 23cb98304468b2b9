"""Rank-free layouts in rules: a layout naming fewer dims than the tensor has leaves the
trailing dims replicated, or those where its ``...`` stands; declared tensors keep the
exact-rank check (a ``...`` in them is filled to their shape); printing round-trips."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.spec_plan import plan_spec
from shardlang import Layout, SpecError, format_spec, parse_layout, parse_spec
from shardlang.errors import ParseError
from tests.test_language import layouts, meshes

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


# --- the ellipsis form --------------------------------------------------------------------
def _dim_text(layout: Layout, axes: tuple[int, ...]) -> str:
    return "S(" + ",".join(layout.mesh.axis_label(a) for a in axes) + ")" if axes else "R"


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_ellipsis_layouts_parse_print_round_trip_and_fill(data: st.DataObject) -> None:
    layout = data.draw(layouts(meshes(max_axes=3).map(lambda m: attrs.evolve(m, name=None)), max_dims=3))
    at = data.draw(st.integers(0, layout.ndim))
    named = [_dim_text(layout, axes) for axes in layout.dims]
    rest = str(layout).split(" ", 1)[1]  # the partial and the mesh, after the dims
    written = ",".join([*named[:at], "...", *named[at:]]) + " " + rest
    spec = parse_spec(f'rule "*" {{ param = {written} }}')
    # Printed canonically, the '...' where it was written, but a final one (what a layout
    # without one means) is not written.
    dims = [str(Layout(dims=(axes,), mesh=layout.mesh)).split(" ")[0] for axes in layout.dims]
    canonical = ",".join([*dims[:at], "...", *dims[at:]]) + " " + rest if at < layout.ndim else str(layout)
    assert format_spec(spec).splitlines()[2] == f"  param = {canonical}"
    assert parse_spec(format_spec(spec)) == spec and spec.rules[0].layouts.param == layout
    # A tensor of any rank >= the named dims: its unnamed dims replicated where the '...' is.
    extra = data.draw(st.integers(0, 2))
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=layout.ndim + extra, max_size=layout.ndim + extra)))
    full = ",".join(named[:at] + ["R"] * extra + named[at:]) or "()"
    expected = parse_layout(f"{full} {rest}")
    assert spec.resolve("t", shape, "f32").param == expected
    declared = parse_spec(f"tensor t : f32[{', '.join(map(str, shape))}] {{ param = {written} }}").tensor("t")
    assert declared.param == expected and declared.grad == declared.state() == expected


def test_ellipsis_in_rules_with_other_forms() -> None:
    spec = parse_spec(
        MESH + 'rule "*" { param = ...,S(tp) over world  grad = ...,S(tp) | P(dp):avg over world  '
        "state = S(dp),...,S(tp) over world }\n"
    )
    t = spec.resolve("w", (6, 4, 8), "bf16")
    assert (str(t.param), str(t.grad), str(t.state())) == (
        "R,R,S(tp) over world",
        "R,R,S(tp) | P(dp):avg over world",
        "S(dp),R,S(tp) over world",
    )
    assert str(spec.resolve("v", (4, 8), "f32").param) == "R,S(tp) over world"
    assert str(spec.resolve("v", (4, 8), "f32").state()) == "S(dp),S(tp) over world"  # '...': no dim
    with pytest.raises(SpecError, match=r"a 2-d state layout 'S\(dp\),\.\.\.,S\(tp\) over world'"):
        spec.resolve("v", (8,), "f32")  # the state names two dims
    # A default entry takes the param layout with its '...'.
    spec = parse_spec(MESH + 'rule "*" { param = ...,S(tp) over world }')
    assert str(spec.resolve("w", (2, 4), "f32").state()) == "R,S(tp) over world"
    assert format_spec(spec).endswith('rule "*" {\n  param = ...,S(tp) over world\n}\n')


@pytest.mark.parametrize(
    ("text", "kind", "line", "column", "message"),
    [
        (
            'rule "a" { param = ...,S(tp),... over world }',
            ParseError,
            2,
            30,
            "a layout has at most one '...' (its first is at column 20)",
        ),
        (
            "tensor x : f32[4] { param = S(dp),...,S(tp) over world }",
            SpecError,
            2,
            35,
            "tensor 'x' has shape [4] (1 dims) but its param layout names 2 dims besides its '...'",
        ),
        (
            'rule "a" { param = ...,S(tp) over world  grad = R over world  state = R,R over world }',
            SpecError,
            2,
            71,
            "its state layout has 2 dims but its grad layout has 1; write '...'",
        ),
    ],
)
def test_ellipsis_errors_name_line_and_column(text: str, kind: type, line: int, column: int, message: str) -> None:
    with pytest.raises(kind) as caught:
        parse_spec(MESH + text, filename="m.shard")
    error = caught.value
    assert (error.position.filename, error.position.line, error.position.column) == ("m.shard", line, column)
    assert message in error.message
    with pytest.raises(ParseError, match=r"'\.\.\.' stands for the dims .* not a layout on its own") as caught:
        parse_layout("S0,... over mesh[2]")
    assert caught.value.position.column == 4
