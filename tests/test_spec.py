"""Spec files: meshes with cost hints, tensors, brace ranges, rules, defaults, every spec
error with its exact line and column, and the bundled examples."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch

import shardlang.parser
from shardlang import (
    CostHints,
    Layout,
    LayoutError,
    Mesh,
    ParseError,
    ShardlangError,
    SpecError,
    load_spec,
    parse_layout,
    parse_spec,
)
from shardlang.dtypes import ITEMSIZE, itemsize
from shardlang.spec import expand_braces
from tests.conftest import EXAMPLES

# The spec of the README's language section, with its elided block filled in.
README_SPEC = """\
# gpt_dp2_tp2.shard
mesh world = [dp=2, tp=2]  bandwidth [25e9, 300e9]  latency 5us   # cost hints, optional

tensor wte : bf16[50304, 768] {
  param = S(tp),R over world
  grad  = S(tp),R | P(dp):avg over world      # data-parallel gradient: pending mean
  state = S(tp,dp),R over world               # default for every optimizer state
  state.exp_avg_sq = S(tp,dp),R over world    # per-state override
}
tensor h.{0..11}.attn.c_attn.weight : bf16[2304, 768] { param = S(tp),R over world }   # brace ranges
rule "h.*.ln_*.weight" { param = R over world  grad = R | P(dp) over world  state = S(dp) over world }
"""
WORLD = Mesh(shape=(2, 2), axis_names=("dp", "tp"), name="world")


def test_the_readme_spec() -> None:
    spec = parse_spec(README_SPEC, "gpt_dp2_tp2.shard")
    (decl,) = spec.meshes
    assert decl.mesh == WORLD
    assert decl.hints == CostHints(bandwidth=(25e9, 300e9), latency=(5e-6, 5e-6))
    assert spec.mesh("world") == WORLD
    assert spec.hints(WORLD) == decl.hints
    assert spec.hints(WORLD.anonymous()) == CostHints()  # an inline mesh has no hints

    wte = spec.tensor("wte")
    assert (wte.dtype, wte.shape) == ("bf16", (50304, 768))
    assert wte.param == Layout(dims=((1,), ()), mesh=WORLD)
    assert wte.grad == Layout(dims=((1,), ()), mesh=WORLD, partial=((0, "avg"),))
    assert wte.state() == Layout(dims=((1, 0), ()), mesh=WORLD)
    assert wte.state("exp_avg") == wte.state()
    assert wte.state("exp_avg_sq") == Layout(dims=((1, 0), ()), mesh=WORLD)

    names = [t.name for t in spec.tensors]
    assert names == ["wte"] + [f"h.{i}.attn.c_attn.weight" for i in range(12)]
    c_attn = spec.tensor("h.7.attn.c_attn.weight")
    # Defaults: the gradient and every state take the param layout.
    assert c_attn.grad == c_attn.param == c_attn.state() == c_attn.state("exp_avg")
    assert c_attn.position is not None and c_attn.position.line == 10

    (rule,) = spec.rules
    assert rule.pattern == "h.*.ln_*.weight"
    ln = spec.resolve("h.3.ln_2.weight", (768,), "f32")
    assert (ln.name, ln.shape, ln.dtype) == ("h.3.ln_2.weight", (768,), "f32")
    assert ln.param == Layout(dims=((),), mesh=WORLD)
    assert ln.grad == Layout(dims=((),), mesh=WORLD, partial=((0, "sum"),))
    assert ln.state() == Layout(dims=((0,),), mesh=WORLD)


@pytest.mark.parametrize(
    ("hints", "bandwidth", "latency"),
    [
        ("", None, None),
        ("bandwidth 1e9", (1e9, 1e9), None),
        ("bandwidth [1e9, 2.5e11]", (1e9, 2.5e11), None),
        ("latency 5us", None, (5e-6, 5e-6)),
        ("latency [2s, 3]", None, (2.0, 3.0)),
        ("latency [1.5ms, .5ns]", None, (1.5e-3, 0.5e-9)),
        ("latency [0.25us, 7e-3ms]", None, (0.25e-6, 7e-6)),
        ("latency 10ns bandwidth 100", (100.0, 100.0), (1e-8, 1e-8)),
    ],
)
def test_cost_hints_with_units(hints: str, bandwidth: object, latency: object) -> None:
    spec = parse_spec(f"mesh m = [4, 2] ranks 8..15 {hints}")
    assert spec.meshes[0].hints == CostHints(bandwidth=bandwidth, latency=latency)
    assert spec.mesh("m").ranks == tuple(range(8, 16))


def test_brace_expansion() -> None:
    assert expand_braces("h.{0..2}.{q,k}") == ["h.0.q", "h.0.k", "h.1.q", "h.1.k", "h.2.q", "h.2.k"]
    assert expand_braces("plain.name") == ["plain.name"]
    assert expand_braces("{a,b}") == ["a", "b"]
    assert expand_braces("x{-1..1}") == ["x-1", "x0", "x1"]
    assert expand_braces("l{7..7}") == ["l7"]
    assert expand_braces("{0..1}{0..1}") == ["00", "01", "10", "11"]
    with pytest.raises(ParseError, match="expands to 1000000 names, more than 10"):
        expand_braces("{0..999}.{0..999}", limit=10)


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("a.{3..1}", "brace range {3..1} in 'a.{3..1}' is empty: 1 < 3"),
        ("a.{}", "is neither a range like {0..11} nor alternatives"),
        ("a.{x,}", "brace {x,} in 'a.{x,}' is neither"),
        ("a.{1..2", "unbalanced brace"),
        ("a.1..2}", "unbalanced brace"),
        ("a.{{1..2}}", "unbalanced brace"),
        ("a.{1..99999999999999999999}", "longer than 18 digits"),
    ],
)
def test_bad_braces(name: str, words: str) -> None:
    with pytest.raises(ParseError) as caught:
        expand_braces(name)
    assert words in caught.value.message


def test_tensor_names_with_braces_anywhere() -> None:
    spec = parse_spec("tensor {wte,wpe}.weight : f32[8] { param = S0 over mesh[2] }")
    assert [t.name for t in spec.tensors] == ["wte.weight", "wpe.weight"]


def test_rules_match_in_file_order_after_declared_tensors() -> None:
    spec = parse_spec(
        textwrap.dedent(
            """\
            tensor h.0.bias : f32[6] { param = S0 over mesh[2] }
            rule "h.?.bias" { param = S0 over mesh[2] }
            rule "h.*.bias" { param = R | P0 over mesh[2] }
            rule "{x,y}.[ab]*" { param = R over mesh[2]  state.exp_avg = S0 over mesh[2] }
            rule "*" { param = R,R over mesh[2] }
            """
        ),
        "rules.shard",
    )
    assert spec.resolve("h.0.bias", (6,), "f32") == spec.tensor("h.0.bias")
    assert spec.resolve("h.1.bias", (5,), "f32").param == parse_layout("S0 over mesh[2]")
    assert spec.resolve("h.12.bias", (5,), "f32").param == parse_layout("R | P0 over mesh[2]")
    resolved = spec.resolve("y.beta", (3,), "bf16")
    assert resolved.param == parse_layout("R over mesh[2]")
    assert resolved.state("exp_avg") == parse_layout("S0 over mesh[2]")
    assert resolved.state("exp_avg_sq") == resolved.param
    assert resolved.position is not None and resolved.position.line == 4
    assert spec.resolve("z.c", (3, 3), "f32").param == parse_layout("R,R over mesh[2]")
    assert not spec.rules[2].matches("x.c")
    assert spec.rules[2].matches("x.alpha")


def test_resolve_errors() -> None:
    spec = parse_spec(
        'tensor w : f32[4, 4] { param = S0,R over mesh[2] }\nrule "b.*" { param = S0 over mesh[2] }',
        "r.shard",
    )
    with pytest.raises(SpecError, match=r"tensor 'w' is declared with shape \[4, 4\] but has shape \[4, 5\]"):
        spec.resolve("w", (4, 5), "f32")
    with pytest.raises(SpecError, match=r"rule \"b\.\*\" gives tensor 'b.x' of shape \[\] a 1-d param layout"):
        spec.resolve("b.x", (), "f32")
    with pytest.raises(SpecError, match=r"tensor 'c' is not declared and no rule matches it in r\.shard"):
        spec.resolve("c", (2,), "f32")
    with pytest.raises(SpecError, match=r"no tensor named 'c' in r\.shard"):
        spec.tensor("c")
    with pytest.raises(SpecError, match=r"no mesh named 'world' in r\.shard"):
        spec.mesh("world")


def test_scalars_and_empty_dims() -> None:
    spec = parse_spec(
        "tensor step : i64[] { param = () over mesh[2] }\ntensor e : f32[0, 3] { param = S0,R over mesh[2] }"
    )
    assert spec.tensor("step").shape == ()
    assert spec.tensor("e").param.local_shape((0, 3)) == (0, 3)


def test_dtypes() -> None:
    # Sizes against torch's own element sizes.
    torch_dtypes = {
        "f64": torch.float64,
        "f32": torch.float32,
        "bf16": torch.bfloat16,
        "f16": torch.float16,
        "c128": torch.complex128,
        "c64": torch.complex64,
        "i64": torch.int64,
        "i32": torch.int32,
        "i16": torch.int16,
        "i8": torch.int8,
        "u8": torch.uint8,
        "bool": torch.bool,
    }
    assert set(ITEMSIZE) == set(torch_dtypes)
    for dtype, torch_dtype in torch_dtypes.items():
        spec = parse_spec(f"tensor t : {dtype}[2] {{ param = R over mesh[1] }}")
        assert itemsize(spec.tensor("t").dtype) == torch.empty((), dtype=torch_dtype).element_size()
    with pytest.raises(LayoutError, match="unknown dtype 'f8'"):
        itemsize("f8")


# --- errors, each with its line and column ----------------------------------------------------
# fmt: off
SPEC_ERRORS = [
    # (text, error type, line, column, words the message must contain)
    (
        "tensor a : f32[4] { param = S0 over mesh[2] }\ntensor a : f32[4] { param = S0 over mesh[2] }",
        SpecError, 2, 1, "tensor 'a' is declared twice (first declared at line 1)",
    ),
    (
        "tensor a.{0..3} : f32[4] { param = S0 over mesh[2] }\n\ntensor a.2 : f32[4] { param = R over mesh[2] }",
        SpecError, 3, 1, "tensor 'a.2' is declared twice (first declared at line 1)",
    ),
    ("mesh w = [2]\nmesh w = [4]", SpecError, 2, 1, "mesh 'w' is declared twice (first declared at line 1)"),
    (
        "tensor a : f32[4] {\n  param = S0 over mesh[2]\n  moment = R over mesh[2]\n}",
        SpecError, 3, 3, "unknown entry 'moment' in tensor 'a'; expected param, grad, state or state.<name>",
    ),
    ("tensor a : f32[4] { param = R over mesh[2] state.x.y = R over mesh[2] }", SpecError, 1, 44, "unknown entry"),
    ("tensor a : f32[4] { param = R over mesh[2] param = R over mesh[2] }", SpecError, 1, 44, "gives 'param' twice"),
    ("tensor a : f33[4] { param = S0 over mesh[2] }", SpecError, 1, 12, "unknown dtype 'f33' (expected one of f64"),
    ("tensor a.{3..1} : f32[4] { param = S0 over mesh[2] }", ParseError, 1, 8, "brace range {3..1}"),
    ("tensor a.{x,} : f32[4] { param = S0 over mesh[2] }", ParseError, 1, 8, "neither a range"),
    ("tensor a.{0..999}.{0..999} : f32[4] { param = R over mesh[2] }", ParseError, 1, 8, "more than 100000"),
    ("\ntensor a : f32[4] {\n  grad = S0 over mesh[2]\n}", SpecError, 2, 1, "tensor 'a' has no param layout"),
    ('rule "x" { grad = R over mesh[2] }', SpecError, 1, 1, 'rule "x" has no param layout'),
    ('rule "" { param = R over mesh[2] }', SpecError, 1, 6, "a rule needs a non-empty pattern"),
    ('rule "a.{x" { param = R over mesh[2] }', ParseError, 1, 6, "unbalanced brace in 'a.{x'"),
    (
        "tensor a : f32[4, 4] {\n  param = S0 over mesh[2]\n}",
        SpecError, 2, 11, "tensor 'a' has shape [4, 4] (2 dims) but its param layout has 1 dims",
    ),
    (
        'rule "x" { param = R over mesh[2]\n           grad = R,R | P0 over mesh[2] }',
        SpecError, 2, 19, 'rule "x": its grad layout has 2 dims but its param layout has 1',
    ),
    (
        "tensor a : f32[4] { param = S0 over mesh[2]\n  state = S0 over mesh[2] ranks 2..3 }",
        SpecError, 2, 11, "its state layout is over mesh[2] ranks 2..3 but its param layout is over mesh[2]",
    ),
    ("tensor a : f32[4] { param = S0 over world }", LayoutError, 1, 37, "unknown mesh 'world' (meshes: none declared)"),
    (
        "mesh w = [dp=2, tp=2]\ntensor a : f32[4] { param = S(xp) over w }",
        LayoutError, 2, 31, "unknown mesh axis 'xp' for mesh[dp=2,tp=2] (names: dp, tp)",
    ),
    ("mesh w = [2]\ntensor a : f32[4] { param = S3 over w }", LayoutError, 2, 30, "mesh axis 3 is out of range"),
    (
        "mesh w = [2,2]\ntensor a : f32[4,4] { param = S0,S0 over w }",
        LayoutError, 2, 35, "mesh axis 0 is used twice (by dim 0 and by dim 1)",
    ),
    ("mesh w = [2, 2] ranks 0..2", LayoutError, 1, 17, "mesh[2,2] holds 4 ranks but 3 are given"),
    ("mesh w = [2] ranks [5,5]", LayoutError, 1, 14, "rank 5 appears twice in the mesh"),
    ("mesh w = [dp=2, 2]", LayoutError, 1, 11, "name every mesh axis or none of them"),
    ("mesh w = [dp=2, dp=2]", LayoutError, 1, 17, "mesh axis name 'dp' is used twice"),
    ("mesh over = [2]", LayoutError, 1, 6, "mesh name 'over' is a reserved word"),
    ("mesh w = [2, 2] bandwidth [1e9, 2e9, 3e9]", SpecError, 1, 17, "bandwidth gives 3 values for a 2-axis mesh"),
    ("mesh w = [2] bandwidth 1 bandwidth 2", SpecError, 1, 26, "bandwidth is given twice"),
    ("mesh w = [2] latency 1 latency 2", SpecError, 1, 24, "latency is given twice"),
    ("mesh w = [2, 2] bandwidth [1e9, 0]", SpecError, 1, 33, "bandwidth 0 must be a positive finite number"),
    ("mesh w = [2] bandwidth 1e999", SpecError, 1, 24, "bandwidth 1e999 must be a positive finite number"),
    ("mesh w = [2] latency 1e999ms", SpecError, 1, 22, "latency 1e999ms is out of range"),
    ("mesh w = [2] latency 5xs", ParseError, 1, 23, "unexpected 'xs'"),
    ("tensor a : f32[99999999999999999999] { param = R over mesh[2] }", ParseError, 1, 16, "is too large"),
    ("tensor a : f32[4] { param = S0 over mesh[2] }\n}", ParseError, 2, 1, "unexpected '}'"),
    (
        "tensor a : f32[4] {\n  param = S0 over mesh[2]\n",
        ParseError, 2, 26, "the text ends inside the block of tensor 'a' (its '{' at line 1, column 19)",
    ),
    ("tensor a f32[4] { param = R over mesh[2] }", ParseError, 1, 10, "unexpected 'f32'; expected ':'"),
    ("tensor a : f32[4] { param S0 over mesh[2] }", ParseError, 1, 27, "did you mean 'param = S0 over mesh[2]'?"),
    ("mesh w = [2] # ok\nbogus", ParseError, 2, 1, "unexpected 'bogus'; expected 'bandwidth', 'latency', 'mesh'"),
    ("mesh w = [2]\n  @", ParseError, 2, 3, "unexpected character '@'"),
]
# fmt: on


@pytest.mark.parametrize(("text", "kind", "line", "column", "words"), SPEC_ERRORS)
def test_spec_errors_name_the_item_and_its_place(text: str, kind: type, line: int, column: int, words: str) -> None:
    with pytest.raises(kind) as caught:
        parse_spec(text, "model.shard")
    error = caught.value
    assert words in error.message
    assert error.position is not None
    assert (error.position.filename, error.position.line, error.position.column) == ("model.shard", line, column)
    shown, caret = str(error).splitlines()[1:]
    assert shown == "    " + text.split("\n")[line - 1]
    assert caret.index("^") == 4 + column - 1
    assert str(error).startswith(f"model.shard:{line}:{column}: {error.message}")


def test_a_file_declares_a_bounded_number_of_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    # The real bound is a million; a small one shows the check without building a million.
    monkeypatch.setattr(shardlang.parser, "MAX_TENSORS", 5)
    text = "tensor a.{0..2} : f32[4] { param = R over mesh[2] }\ntensor b.{0..2} : f32[4] { param = R over mesh[2] }"
    with pytest.raises(SpecError) as caught:
        parse_spec(text)
    assert caught.value.message == "the file declares more than 5 tensors"
    assert caught.value.position is not None and caught.value.position.line == 2


LINE_BREAKS = ["\n", "\r\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


@pytest.mark.parametrize("brk", LINE_BREAKS, ids=[repr(b) for b in LINE_BREAKS])
def test_every_line_break_counts_as_one_in_line_and_column(brk: str) -> None:
    # Each break str.splitlines knows ends a line (and a comment): the error is on line 4, column
    # 30, wherever the breaks stand, and the line shown holds none of them.
    text = f"mesh w = [2]{brk}# a comment{brk}  {brk}tensor a : f32[4] {{ param = S5 over w }}{brk}"
    with pytest.raises(LayoutError) as caught:
        parse_spec(text)
    position = caught.value.position
    assert position is not None
    assert (position.line, position.column) == (4, 30)
    assert position.line_text == "tensor a : f32[4] { param = S5 over w }"
    assert position.line_text == text.splitlines()[position.line - 1]


@pytest.mark.parametrize("brk", LINE_BREAKS[2:], ids=[repr(b) for b in LINE_BREAKS[2:]])
def test_a_line_break_inside_a_comment_ends_it(brk: str) -> None:
    # An editor shows the tensor on a line of its own: it is read, not commented out.
    spec = parse_spec(f"mesh w = [2]  # note{brk}tensor a : f32[4] {{ param = S0 over w }}\n")
    assert [t.name for t in spec.tensors] == ["a"]


def test_an_error_on_the_same_line_after_a_pattern_counts_columns_in_characters() -> None:
    text = 'mesh w = [2]\n\nrule "h.\u00e9*" { param = S0,S0 over w }\n'
    with pytest.raises(LayoutError) as caught:
        parse_spec(text)
    assert caught.value.position is not None
    assert (caught.value.position.line, caught.value.position.column) == (3, 27)  # the "0" of the second S0


def test_load_spec_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.shard"
    path.write_text("tensor a : f32[4] { param = S0,S0 over mesh[2] }\n")
    with pytest.raises(LayoutError) as caught:
        load_spec(path)
    assert str(caught.value).startswith(f"{path}:1:33: mesh axis 0 is used twice")
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "missing.shard")
    binary = tmp_path / "binary.shard"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ParseError) as caught:
        load_spec(binary)
    assert str(caught.value).startswith(f"{binary}:1:1: the file is not valid UTF-8 here (byte 0xff)")


# --- the bundled examples -------------------------------------------------------------------
def test_every_example_loads() -> None:
    paths = sorted(EXAMPLES.glob("*.shard"))
    assert {p.name for p in paths} >= {
        "gpt2_small_dp2_tp2.shard",
        "llama7b_dp4_tp8.shard",
        "paddle_embedding_2x2.shard",
    }
    for path in paths:
        spec = load_spec(path)
        assert spec.tensors, path
        for tensor in spec.tensors:
            for layout in (tensor.param, tensor.grad, tensor.state()):
                layout.check_shape(tensor.shape)
        for rule in spec.rules:
            assert rule.layouts.param.ndim == rule.layouts.grad.ndim == rule.layouts.state().ndim


def resolve_all(path: Path, parameters: dict[str, tuple[int, ...]]) -> int:
    """Resolve every parameter of a model by name; the number of elements covered."""
    spec = load_spec(path)
    for name, shape in parameters.items():
        tensor = spec.resolve(name, shape, "bf16")
        assert tensor.param.ndim == len(shape)
    declared = {t.name for t in spec.tensors}
    assert declared <= set(parameters), declared - set(parameters)
    return sum(math.prod(shape) for shape in parameters.values())


def test_gpt2_example_covers_every_parameter_of_gpt2_small() -> None:
    # nanoGPT's GPT-2 small with the padded vocabulary: 124,475,904 parameters.
    d, vocab, ctx = 768, 50304, 1024
    parameters: dict[str, tuple[int, ...]] = {
        "wte": (vocab, d),
        "wpe": (ctx, d),
        "ln_f.weight": (d,),
        "ln_f.bias": (d,),
    }
    for i in range(12):
        for ln in ("ln_1", "ln_2"):
            parameters[f"h.{i}.{ln}.weight"] = parameters[f"h.{i}.{ln}.bias"] = (d,)
        for name, out_features, in_features in [
            ("attn.c_attn", 3 * d, d),
            ("attn.c_proj", d, d),
            ("mlp.c_fc", 4 * d, d),
            ("mlp.c_proj", d, 4 * d),
        ]:
            parameters[f"h.{i}.{name}.weight"] = (out_features, in_features)
            parameters[f"h.{i}.{name}.bias"] = (out_features,)
    assert resolve_all(EXAMPLES / "gpt2_small_dp2_tp2.shard", parameters) == 124_475_904
    spec = load_spec(EXAMPLES / "gpt2_small_dp2_tp2.shard")
    assert spec.mesh("world").shape == (2, 2)
    assert spec.meshes[0].hints.bandwidth == (25e9, 300e9)
    # Column-parallel biases follow their weight's output split; row-parallel ones do not.
    assert str(spec.resolve("h.0.mlp.c_fc.bias", (3072,), "bf16").param) == "S(tp) over world"
    assert str(spec.resolve("h.0.mlp.c_proj.bias", (768,), "bf16").param) == "R over world"


def test_llama_example_covers_every_parameter_of_llama_7b() -> None:
    # LLaMA-7B has 6,738,415,616 parameters.
    d, ffn, vocab = 4096, 11008, 32000
    parameters: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, d),
        "model.norm.weight": (d,),
        "lm_head.weight": (vocab, d),
    }
    for i in range(32):
        layer = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            parameters[f"{layer}.self_attn.{proj}.weight"] = (d, d)
        parameters[f"{layer}.mlp.gate_proj.weight"] = parameters[f"{layer}.mlp.up_proj.weight"] = (ffn, d)
        parameters[f"{layer}.mlp.down_proj.weight"] = (d, ffn)
        parameters[f"{layer}.input_layernorm.weight"] = parameters[f"{layer}.post_attention_layernorm.weight"] = (d,)
    assert resolve_all(EXAMPLES / "llama7b_dp4_tp8.shard", parameters) == 6_738_415_616
    spec = load_spec(EXAMPLES / "llama7b_dp4_tp8.shard")
    assert spec.mesh("world") == Mesh(shape=(4, 8), axis_names=("dp", "tp"), name="world")
    assert spec.meshes[0].hints.bandwidth == (25e9, 300e9)
    # 32 heads of 128 over 8 tp ranks: every rank holds whole heads.
    q = spec.tensor("model.layers.0.self_attn.q_proj.weight")
    assert q.param.local_shape(q.shape) == (4 * 128, d)


def test_paddle_example_matches_the_seed() -> None:
    (tensor,) = load_spec(EXAMPLES / "paddle_embedding_2x2.shard").tensors
    assert (tensor.name, tensor.dtype, tensor.shape) == ("embedding_0.w_0", "f32", (32000, 1024))
    assert tensor.param == parse_layout("R,S1 over mesh[2,2]")
    assert tensor.grad == parse_layout("R,S1 | P0 over mesh[2,2]")
    assert tensor.state("moment1") == tensor.state("moment2") == parse_layout("S0,S1 over mesh[2,2]")


def test_every_error_is_a_shardlang_error() -> None:
    for kind in (ParseError, LayoutError, SpecError):
        assert issubclass(kind, ShardlangError)
