"""Fuzzing the parser: random text, token soup and mutations of valid spec files.

Whatever the input, parse_layout and parse_spec either return a value or raise a
ShardlangError that points inside the text and renders; nothing else escapes (no lark
error, no ValueError from int(), no decimal trap, no memory blow-up from a brace range).
"""

from __future__ import annotations

import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardlang import Layout, ShardlangError, Spec, parse_layout, parse_spec
from tests.conftest import EXAMPLES

EXAMPLE_TEXTS = [p.read_text() for p in sorted(EXAMPLES.glob("*.shard"))]
SMALL_SPEC = """\
# a small spec
mesh world = [dp=2, tp=4] ranks 8..15  bandwidth [25e9, 3e11]  latency 5us
mesh flat = [8]

tensor h.{0..3}.attn.{q,k,v}.weight : bf16[96, 64] {
  param = S(tp),R over world
  grad  = S(tp),R | P(dp):avg over world
  state = S(tp,dp),R over world
  state.exp_avg_sq = S(dp),S(tp) over world
}
tensor emb : f32[37, 5] { param = S0,R over flat  grad = S0,R over flat }
tensor scale : f32[] { param = () over mesh[2,2] ranks [3,1,0,2] }
rule "h.*.ln_{1,2}.{weight,bias}" { param = R over world  grad = R | P(dp) over world  state = S(dp) over world }
"""
VALID_TEXTS = [SMALL_SPEC, *EXAMPLE_TEXTS]
VALID_LAYOUTS = [
    "S0,R over mesh[2,2]",
    "S10,R | P2:max over mesh[2,2,3] ranks 4..15",
    "R,R | P0:avg,P1:max over mesh[2,4]",
    "() over mesh[2,2]",
    "S(dp,tp),R over mesh[dp=2,tp=2]",
    "S(tp), R | P(dp):avg over world",
]
WORLD = parse_spec(SMALL_SPEC).mesh("world")
# Valid text whose values would exhaust memory or time if taken literally.
HUGE_INPUTS = [
    "tensor a.{0..99999999}.{0..99999} : f32[4] { param = S0 over mesh[2] }",
    'rule "x.{0..9999999999}" { param = R over mesh[2] }',
    "tensor a : f32[4] { param = S0 over mesh[100000,100000] }",
    "tensor a : f32[4] { param = S0 over mesh[2] ranks 0..99999999999 }",
    "tensor a : f32[" + "9" * 5000 + "] { param = S0 over mesh[2] }",
    "mesh w = [2] latency 9e99999999999999999999999ms",
]

# Pieces of the language, so that random sequences get past the first token.
TOKENS = [
    "mesh", "tensor", "rule", "over", "ranks", "bandwidth", "latency", "param", "grad", "state",
    "state.exp_avg", "R", "S", "P", "S0", "S01", "S10", "P0", "P01", ":sum", ":avg", ":max", ":prod",
    "(", ")", "[", "]", "{", "}", ",", "|", "=", ":", "..", ".", "#", "\n", '"', '"h.*"', "world",
    "dp", "tp", "dp=2", "0", "1", "2", "-1", "99999999999999999999999", "9" * 5000, "1e999", "1e-999",
    "5us", "3ms", "bf16", "f32", "f99", "[2,2]", "{0..3}", "{0..99999999999}", "{q,k}", "{}", "{3..1}",
    "h.0.w", "\t", "\r\n", "\u2028", "\x0c", "é", "\x00",
]  # fmt: skip
# Built once: a strategy made inside a draw is built and validated again at every draw.
TOKEN = st.sampled_from(TOKENS)
INSERTED = TOKEN | st.characters()
EDIT = st.sampled_from(("delete", "insert", "replace", "duplicate", "swap"))


def check_error(error: ShardlangError, text: str) -> None:
    position = error.position
    assert position is not None, f"an error without a position: {error!r}"
    # Lines are str.splitlines' (every Unicode line break, "\r\n" as one), the last one kept
    # even when it is empty: an error at the very end stands on it.
    lines = (text + "x").splitlines()
    lines[-1] = lines[-1][:-1]
    assert 1 <= position.line <= len(lines), (position, text)
    assert position.line_text == lines[position.line - 1]
    assert 1 <= position.column <= len(position.line_text) + 1, (position, text)
    rendered = str(error)
    assert rendered.startswith(f"{position.prefix()}: {error.message}")
    assert rendered.endswith("^")
    assert error.to_json()["line"] == position.line


def parse_both(text: str) -> None:
    for parse in (lambda t: parse_layout(t, {"world": WORLD}, filename="x.txt"), lambda t: parse_spec(t, "x.shard")):
        try:
            value = parse(text)
        except ShardlangError as e:
            check_error(e, text)
        else:
            assert isinstance(value, (Layout, Spec))
            if isinstance(value, Layout):
                assert parse_layout(str(value), {"world": WORLD}) == value


# Each parse takes about a millisecond, so these settings give thousands of inputs in a few
# seconds. No deadline: a loaded machine makes any input slow; a runaway expansion is caught by
# test_huge_inputs_fail_fast's memory bound instead.
FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.text(max_size=80))
def test_random_text(text: str) -> None:
    parse_both(text)


@FUZZ
@given(st.text(alphabet='SRPmeshovrank[](){}|,:=.0123456789 \n#"*tdpgaw_-', max_size=80))
def test_random_text_from_the_language_alphabet(text: str) -> None:
    parse_both(text)


@FUZZ
@given(st.lists(TOKEN, max_size=30), st.sampled_from([" ", "", "\n"]))
def test_token_soup(tokens: list[str], joiner: str) -> None:
    parse_both(joiner.join(tokens))


@st.composite
def mutations(draw: st.DrawFn, sources: st.SearchStrategy[str]) -> str:
    """A valid text (one of ``sources``) with a few random edits: deletions, insertions of
    tokens or characters, replacements, duplicated or swapped spans."""
    text = draw(sources)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 12)))
        edit = draw(EDIT)
        if edit == "delete":
            text = text[:i] + text[j:]
        elif edit == "insert":
            text = text[:i] + draw(INSERTED) + text[i:]
        elif edit == "replace":
            text = text[:i] + draw(TOKEN) + text[j:]
        elif edit == "duplicate":
            text = text[:j] + text[i:j] + text[j:]
        else:
            k = draw(st.integers(j, min(len(text), j + 12)))
            text = text[:i] + text[j:k] + text[i:j] + text[k:]
    return text


@FUZZ
@given(mutations(st.sampled_from(VALID_TEXTS)))
def test_mutated_spec_files(text: str) -> None:
    parse_both(text)


@FUZZ
@given(mutations(st.sampled_from(VALID_LAYOUTS)))
def test_mutated_layouts(text: str) -> None:
    parse_both(text)


def test_huge_inputs_fail_fast() -> None:
    # Each of HUGE_INPUTS is refused holding under a megabyte at its peak (a list of the first
    # million names alone would hold tens of megabytes); bench/bench_planner_budget.py times them.
    parse_spec(SMALL_SPEC)  # the parser built before memory is counted
    for text in HUGE_INPUTS:
        tracemalloc.start()
        try:
            parse_spec(text)
        except ShardlangError as e:
            peak = tracemalloc.get_traced_memory()[1]
            check_error(e, text)
        else:
            raise AssertionError(f"accepted {text[:60]!r}")
        finally:
            tracemalloc.stop()
        assert peak < 2**20, (text[:60], peak)
