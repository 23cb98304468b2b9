"""Parse errors a person can act on: a block left open names itself and its '{', another
framework's notation gets the shardlang layout it means, every line break counts alike in
parse_spec, load_spec and the command, and nothing from lark escapes."""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cli.main import main
from shardlang import ParseError, ShardlangError, load_spec, parse_layout, parse_spec
from shardlang.interop import to_colossalai, to_dtensor_placements, to_paddle

GOLDEN = Path(__file__).parent / "golden" / "parse_errors.txt"


def _golden_cases() -> list[tuple[str, str, str, str]]:
    """(name, 'spec' or 'layout', the input, the error as printed) of every case."""
    cases = []
    for block in GOLDEN.read_text().split("\n== ")[1:]:
        name, given_line, *expected = block.rstrip("\n").split("\n")
        kind, _, text = given_line.partition(": ")
        cases.append((name, kind, json.loads(text), "\n".join(expected)))
    return cases


def _error(kind: str, text: str) -> ShardlangError:
    with pytest.raises(ShardlangError) as caught:
        if kind == "spec":
            parse_spec(text, "model.shard")
        else:
            parse_layout(text, filename="layout")
    return caught.value


def test_there_are_golden_cases() -> None:
    assert len(_golden_cases()) >= 12


@pytest.mark.parametrize(("name", "kind", "text", "expected"), _golden_cases(), ids=lambda v: None)
def test_an_error_is_its_golden_text(name: str, kind: str, text: str, expected: str) -> None:
    assert str(_error(kind, text)) == expected, name


# --- a block left open --------------------------------------------------------------------------
@pytest.mark.parametrize("after", ["tensor b : f32[4] { param = R over w }", 'rule "b*" { param = R over w }'])
def test_a_missing_brace_names_the_open_block_not_the_next_item(after: str) -> None:
    text = f"mesh w = [2]\ntensor a.{{0..3}} : f32[4] {{\n  param = R over w\n  grad = R over w\n\n{after}\n"
    error = _error("spec", text)
    assert isinstance(error, ParseError)
    assert "tensor 'a.{0..3}'" in error.message and "line 2, column 26" in error.message
    assert "'b" not in error.message and '"b' not in error.message
    assert error.position is not None and (error.position.line, error.position.column) == (6, 1)


# --- another framework's notation -----------------------------------------------------------------
def _suggestion(error: ShardlangError) -> str:
    found = re.search(r"did you mean '([^']*)'\?", error.message)
    assert found is not None, error.message
    return found.group(1)


PLACEMENTS = [
    ("Shard(0), Replicate()", 2),
    ("Replicate(), Shard(1)", 2),
    ("[Shard(1), Shard(1)]", 3),
    ("(Shard(-1), Shard(0))", 2),
    ("Partial(), Shard(0)", 1),
    ('Shard(1), Partial("avg")', 2),
    ("Partial('max'), Partial('max')", 1),
    ("Replicate(), Replicate()", 2),
]


@pytest.mark.parametrize(("placements", "ndim"), PLACEMENTS)
def test_a_dtensor_placement_list_suggests_the_layout_with_those_placements(placements: str, ndim: int) -> None:
    from torch.distributed.tensor import Partial, Replicate, Shard

    shape = ", ".join(["4"] * ndim)
    error = _error("spec", f"tensor a : f32[{shape}] {{ param = {placements} over mesh[2,2] }}")
    suggested = parse_layout(_suggestion(error))
    # The independent check: the placements as torch reads them (negative dims from the end)
    # are what shardlang.interop makes of the suggestion.
    written = eval(placements, {"Shard": Shard, "Replicate": Replicate, "Partial": Partial})
    expected = tuple(Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in written)
    assert to_dtensor_placements(suggested) == expected
    assert suggested.ndim == ndim


@pytest.mark.parametrize("mapping", [[0, -1], [-1, 1], [1, 0], [-1, -1, 0]])
def test_a_paddle_dims_mapping_suggests_the_layout_with_that_mapping(mapping: list[int]) -> None:
    shape = ", ".join(["4"] * len(mapping))
    error = _error("spec", f"tensor a : f32[{shape}] {{ param = {mapping} over mesh[2,2] }}")
    assert to_paddle(parse_layout(_suggestion(error))) == (mapping, {})


@pytest.mark.parametrize("sequence", [["S0", "R"], ["R", "S10"], ["S1", "S0"]])
def test_a_colossalai_sequence_suggests_the_layout_with_that_sequence(sequence: list[str]) -> None:
    for written in (json.dumps(sequence), str(sequence), "[" + ", ".join(sequence) + "]"):
        error = _error("spec", f"tensor a : f32[4, 4] {{ param = {written} over mesh[2,2] }}")
        assert to_colossalai(parse_layout(_suggestion(error))) == sequence, written


def test_a_layout_without_its_mesh_suggests_the_declared_mesh() -> None:
    for end in ("}", "\n  grad = R over w }", "\ntensor b : f32[2] { param = R over w }"):
        error = _error("spec", f"mesh w = [2]\ntensor a : f32[4] {{ param = S0{end}")
        assert _suggestion(error) == "S0 over w", end


def test_placements_in_a_layout_with_a_valid_layout_are_left_alone() -> None:
    # A layout that parses is not second-guessed, and an error elsewhere gets no notation hint.
    assert str(parse_layout("S0,R over mesh[2,2]")) == "S0,R over mesh[2,2]"
    error = _error("spec", "tensor a : f32[4] { param = S0 over mesh[2] grad = S0 ovr mesh[2] }")
    assert "did you mean" not in error.message and "DTensor" not in error.message


# --- a layout in the wrong place ------------------------------------------------------------------
T = "tensor a : f32[4, 4] "
P = "param = R,R over w  "  # an entry before the mistake
MISPLACED = [
    # (how the layout is misplaced, the spec as it should read ({layout}: the layout), and where
    # the suggestion goes back in the text ({s}))
    (T + "{{ {layout} }}", T + "{{ param = {layout} }}", T + "{{ {s} }}"),
    (T + "{{\n  param = R,R over w\n  {layout}\n}}", T + "{{ " + P + "grad = {layout} }}", T + "{{ " + P + "{s} }}"),
    (T + "{{ param: {layout} }}", T + "{{ param = {layout} }}", T + "{{ {s} }}"),
    (T + "{{ " + P + "grad {layout} }}", T + "{{ " + P + "grad = {layout} }}", T + "{{ " + P + "{s} }}"),
    (T + "{layout}", T + "{{ param = {layout} }}", "{s}"),
    (T + "= {layout}", T + "{{ param = {layout} }}", "{s}"),
    ('rule "a*" {layout}', 'rule "a*" {{ param = {layout} }}', "{s}"),
]  # fmt: skip
WRITTEN = [
    # (the layout as typed, as shardlang writes it): shardlang's own, DTensor's, ColossalAI's
    ("S(tp),R over w", "S(tp),R over w"),
    ("R,S0 | P1:avg over w", "R,S0 | P1:avg over w"),
    ("Shard(1), Replicate() over w", "R,S0 over w"),
    ("[Replicate(), Shard(0)] over w", "S1,R over w"),
    ('["S01", "R"] over w', "S01,R over w"),
]


@pytest.mark.parametrize(("wrong", "right", "back"), MISPLACED)
@pytest.mark.parametrize(("typed", "meant"), WRITTEN)
def test_a_misplaced_layout_suggests_the_text_that_parses_to_what_was_meant(
    wrong: str, right: str, back: str, typed: str, meant: str
) -> None:
    head = "mesh w = [dp=2, tp=2]\n"
    error = _error("spec", head + wrong.format(layout=typed) + "\n")
    assert isinstance(error, ParseError) and error.position is not None
    # Put back where the mistake was, the suggestion gives the spec written right by hand
    # (independently of the hint's own translation).
    suggested = parse_spec(head + back.format(s=_suggestion(error))).resolve("a", (4, 4), "f32")
    assert suggested.layouts == parse_spec(head + right.format(layout=meant)).resolve("a", (4, 4), "f32").layouts


FOREIGN = [
    "Shard(", "Shard(0)", "Replicate()", "Partial()", "Partial('x')", "dist.", "[", "]", "(", ")", "-1", "0",
    ",", "'S0'", '"R"', "over", "mesh[2,2]", "w", "{", "}", "=", "param", "tensor", "rule", '"a*"', "\n",
    "\u2028", "\r", "_StridedShard(0, split_factor=2)", "Shard(dim=1)", "Partial(reduce_op='sum')",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FOREIGN), max_size=12))
def test_foreign_notation_anywhere_is_a_placed_parse_error(pieces: list[str]) -> None:
    for text in ("mesh w = [2]\ntensor a : f32[4, 4] { param = " + " ".join(pieces), " ".join(pieces)):
        try:
            parse_spec(text, "x.shard")
            parse_layout(text, {"w": parse_spec("mesh w = [2]").mesh("w")})
        except ShardlangError as e:
            assert e.position is not None
            assert 1 <= e.position.column <= len(e.position.line_text) + 1
            assert e.position.line_text in text.splitlines() or e.position.line_text == ""


# --- every line break alike, in load_spec and the command -------------------------------------
BREAKS = ["\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\r", "\r\n"]


@pytest.mark.parametrize("brk", BREAKS, ids=[repr(b) for b in BREAKS])
def test_parse_spec_load_spec_and_check_place_an_error_alike(tmp_path: Path, brk: str) -> None:
    # The error sits on line 3 at column 33 by str.splitlines, which an editor that shows these
    # breaks agrees with: the same in all three readers.
    text = f"mesh w = [2]  # a{brk}# x{brk}tensor a : f32[4] {{ param = S0,S0 over w }}\n"
    path = tmp_path / "breaks.shard"
    path.write_bytes(text.encode())
    expected_line = text.splitlines()[2]
    for read in (lambda: parse_spec(text, str(path)), lambda: load_spec(path)):
        with pytest.raises(ShardlangError) as caught:
            read()
        position = caught.value.position
        assert position is not None
        assert (position.line, position.column, position.line_text) == (3, 33, expected_line)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["check", str(path)])
    assert code == 1
    assert err.getvalue().startswith(f"{path}:3:33: mesh axis 0 is used twice")
    assert err.getvalue().splitlines()[1] == "    " + expected_line
