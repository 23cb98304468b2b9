"""Spec files as input: what ``load_spec`` (and so the ``shardlang`` command) refuses before
reading (too large, not a regular file), bytes that are not UTF-8 placed by line and column,
the same text for ``load_spec`` and ``parse_spec`` whatever its line ends, and rule patterns
compiled once into one regular expression that matches what their brace expansions match."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardlang.parser
import shardlang.spec
from shardlang import ParseError, ShardlangError, SpecError, load_spec, parse_spec
from shardlang.spec import expand_braces, pattern_regex
from tests.cli_support import run
from tests.conftest import REPO

SPEC = "mesh w = [2]\ntensor a : f32[4] { param = S0 over w }\n"


# --- what is refused before it is read ----------------------------------------------------------
def test_a_file_over_the_limit_is_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.shard"
    path.write_text(SPEC + "#" * 200 + "\n")
    monkeypatch.setattr(shardlang.parser, "MAX_SOURCE_BYTES", len(SPEC) + 100)
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    limit = len(SPEC) + 100
    assert str(caught.value) == f"{path}: the file has {len(SPEC) + 201} bytes; a spec file may have at most {limit}"
    monkeypatch.undo()
    assert shardlang.parser.MAX_SOURCE_BYTES == 16 * 2**20
    assert load_spec(path).tensors[0].name == "a"


@pytest.mark.parametrize("kind", ["device", "fifo", "folder"])
def test_what_is_not_a_regular_file_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    """/dev/zero would never end, a FIFO without a writer would block: both are refused
    without a read, and a folder too, each by a SpecError naming it."""
    if kind == "device":
        path, words = Path("/dev/zero"), "it is a device, not a spec file"
    elif kind == "fifo":
        path, words = tmp_path / "pipe.shard", "it is a FIFO, not a spec file"
        os.mkfifo(path)
    else:
        path, words = tmp_path / "folder.shard", "it is a folder, not a spec file"
        path.mkdir()
    # The message says the kind was refused before any read (a read would block, or end in
    # the size limit's message); the command's bounded wait below catches a hang.
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert str(caught.value) == f"{path}: cannot read: {words}"


def test_the_command_refuses_them_too(tmp_path: Path) -> None:
    """``shardlang check`` on /dev/zero, a FIFO and a folder: exit 1, each named, no
    traceback, no hang (a bounded wait)."""
    fifo = tmp_path / "pipe.shard"
    os.mkfifo(fifo)
    (tmp_path / "folder.shard").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "cli", "check", "/dev/zero", str(fifo), str(tmp_path / "folder.shard")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert result.returncode == 1, result.stderr
    output = result.stdout + result.stderr
    assert "Traceback" not in output and "MemoryError" not in output, output
    for path, kind in (("/dev/zero", "a device"), (str(fifo), "a FIFO"), (f"{tmp_path}/folder.shard", "a folder")):
        assert f"{path}: cannot read: it is {kind}" in output, output


# --- bytes that are not UTF-8 ----------------------------------------------------------------------
def test_invalid_utf8_is_placed_by_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "latin1.shard"
    path.write_bytes(
        "mesh w = [2]\n# größe\ntensor a : f32[4] { param = S0 over w }  # Gr\xf6\xdfe\n".encode("latin-1")
    )
    with pytest.raises(ParseError) as caught:
        load_spec(path)
    error = caught.value
    assert error.position is not None
    # line 2 is "# größe" in latin-1: its first byte that is not UTF-8 is "ö", the 5th character
    assert (error.position.line, error.position.column) == (2, 5)
    assert str(error).startswith(f"{path}:2:5: the file is not valid UTF-8 here (byte 0xf6)")
    assert "byte offset" not in str(error)


def test_a_multibyte_character_before_the_bad_byte_counts_once(tmp_path: Path) -> None:
    path = tmp_path / "mixed.shard"
    path.write_bytes("tensor ä\u2028".encode() + b"\xc3(")
    with pytest.raises(ParseError) as caught:
        load_spec(path)
    assert caught.value.position is not None
    # U+2028 is a line break: the bad byte is the first character of line 2
    assert (caught.value.position.line, caught.value.position.column) == (2, 1)


# --- line ends: load_spec reads what parse_spec is given --------------------------------------------
LINE_END_CASES = {
    # a lone CR ends a comment (every line break str.splitlines knows does): the tensor after it counts
    "comment": b"mesh w = [2]\n# note\rtensor a : f32[4] { param = S0 over w }\n"
    b"tensor b : f32[2] { param = R over w }\n",
    # an error after a lone CR: line 2, counted from the CR
    "error": b"mesh w = [2]\rtensor a : f32[4] { param = S5 over w }\n",
    # a rule pattern (a quoted string) cannot hold a line break: the quote is left unclosed
    "string": b'mesh w = [2]\nrule "a\rb" { param = R over w }\n',
    "crlf": b"mesh w = [2]\r\ntensor a : f32[4] { param = S5 over w }\r\n",
}


@pytest.mark.parametrize("case", sorted(LINE_END_CASES))
def test_load_spec_and_parse_spec_read_the_same_text(tmp_path: Path, case: str) -> None:
    data = LINE_END_CASES[case]
    path = tmp_path / f"{case}.shard"
    path.write_bytes(data)

    def outcome(read: object) -> object:
        try:
            spec = read()  # type: ignore[operator]
        except ShardlangError as e:
            assert e.position is not None
            return (type(e).__name__, e.message, e.position.line, e.position.column, e.position.line_text)
        return ([t.name for t in spec.tensors], [r.pattern for r in spec.rules])

    loaded = outcome(lambda: load_spec(path))
    assert loaded == outcome(lambda: parse_spec(data.decode(), filename=str(path)))
    expected = {
        "comment": (["a", "b"], []),
        "error": ("LayoutError", 2, 30),
        "string": ("ParseError", 2, 6),
        "crlf": ("LayoutError", 2, 30),
    }[case]
    if isinstance(loaded[0], str):  # type: ignore[index]
        assert (loaded[0], loaded[2], loaded[3]) == expected, loaded  # type: ignore[index]
    else:
        assert loaded == expected


# --- rule patterns: one regex per pattern -----------------------------------------------------------
def _by_expansion(pattern: str, name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in expand_braces(pattern))


def _written_in(text: str, lo: int, hi: int) -> bool:
    """Whether ``text`` is ``str(k)`` of an integer ``lo <= k <= hi``."""
    try:
        k = int(text)
    except ValueError:
        return False
    return text == str(k) and lo <= k <= hi


@pytest.mark.parametrize(
    ("lo", "hi"), [(0, 0), (0, 9), (3, 17), (0, 99999), (7, 123), (-12, 105), (-30, -4), (95, 1000), (-1, 0)]
)
def test_a_brace_range_matches_exactly_its_numbers_as_written(lo: int, hi: int) -> None:
    regex = pattern_regex(f"x{{{lo}..{hi}}}")
    numbers = [*range(lo - 25, min(hi, lo + 300) + 25), *range(max(lo, hi - 300), hi + 25), hi * 10, -hi, 10**6]
    texts = [str(k) for k in numbers] + ["", "-", "-0", "+1", "00", "01", f"0{hi}", f"{lo} ", "a", f"{hi}0", "1e2"]
    for text in texts:
        assert (regex.match(f"x{text}") is not None) == _written_in(text, lo, hi), (lo, hi, text)


GLOB = st.text(alphabet="ab.*?[]!-", max_size=5)
BRACE = st.one_of(
    st.lists(st.text(alphabet="ab*?[]!-", min_size=1, max_size=3), min_size=1, max_size=3).map(
        lambda alts: "{" + ",".join(alts) + "}"
    ),
    # Short ranges: four braces of 41 values would expand to 2.8M names, each matched by fnmatch.
    st.tuples(st.integers(-12, 30), st.integers(0, 8)).map(lambda t: f"{{{t[0]}..{t[0] + t[1]}}}"),
)
PATTERN = st.lists(st.one_of(GLOB, BRACE), min_size=1, max_size=4).map("".join)
NAME = st.text(alphabet="ab.-0123456789[]!", max_size=8)


@settings(max_examples=400, deadline=None)
@given(PATTERN, st.lists(NAME, max_size=6), st.data())
def test_a_pattern_matches_what_its_expansions_match(pattern: str, names: list[str], data: st.DataObject) -> None:
    """Random patterns of globs (``*``, ``?``, ``[...]`` sets, ``!``, ranges) and braces
    (alternatives holding globs, ranges with negative ends) against random names and names
    made from an expansion: the compiled regex agrees with fnmatch over every expansion."""
    try:
        expansions = expand_braces(pattern)
    except ShardlangError:
        return
    made = data.draw(st.sampled_from(expansions))
    for name in [*names, made, made.replace("*", "ab").replace("?", "a")]:
        assert (pattern_regex(pattern).match(name) is not None) == _by_expansion(pattern, name), (pattern, name)


def test_sets_cut_by_a_brace_match_as_their_expansions_do() -> None:
    cases = {
        "[{a,b}]x": ["ax", "bx", "{x", "[a]x"],
        "{x[,y}]": ["x[]", "y]", "x]", "y"],
        "{a,[b}c]": ["ac]", "b", "c", "[bc]"],
        "h[0-9].{0..3}": ["h1.3", "h1.4", "hx.0"],
        "[!]{0..2}]": ["a", "]0]", "x1]", "]"],
    }
    for pattern, names in cases.items():
        for name in names:
            assert (pattern_regex(pattern).match(name) is not None) == _by_expansion(pattern, name), (pattern, name)


def test_a_huge_brace_range_costs_nothing_per_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """``x{0..99999}`` (the most names a rule may name) is not expanded: each pattern is
    compiled once into a short regex, and resolving names that no rule matches, and ones that
    it does, expands nothing (bench/bench_planner_budget.py times these lookups)."""
    spec = parse_spec('rule "x{0..99999}.w" { param = R over mesh[2] }\nrule "y.*" { param = R over mesh[2] }\n')
    shardlang.spec.pattern_regex.cache_clear()
    monkeypatch.setattr(shardlang.spec, "expand_braces", lambda *a, **k: pytest.fail(f"expanded {a}"))
    for i in range(2000):
        assert spec.resolve(f"y.{i}", (3,), "f32").param.ndim == 1
        assert spec.resolve(f"x{i * 37}.w", (3,), "f32").position.line == 1  # type: ignore[union-attr]
        with pytest.raises(SpecError, match="no rule matches"):
            spec.resolve(f"z{i}", (3,), "f32")
    assert shardlang.spec.pattern_regex.cache_info().misses == 2
    assert len(shardlang.spec.pattern_regex("x{0..99999}.w").pattern) < 200
    with pytest.raises(SpecError, match="no rule matches"):
        spec.resolve("x100000.w", (3,), "f32")
    with pytest.raises(SpecError, match="no rule matches"):
        spec.resolve("x007.w", (3,), "f32")


# --- names and lengths the language excludes -------------------------------------------------------
@pytest.mark.parametrize("name", ["x{a@b,c}", "h.{0..1}.{q/k,v}", "{é}"])
def test_a_brace_cannot_smuggle_in_a_character_names_exclude(name: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_spec(f"mesh w = [2]\ntensor {name} : f32[4] {{ param = R over w }}\n", "names.shard")
    assert str(info.value).startswith("names.shard:2:8: tensor name '")
    assert "may hold only letters, digits, '_', '.' and '-'" in info.value.message


def test_braces_of_allowed_characters_still_expand() -> None:
    spec = parse_spec("mesh w = [2]\ntensor h.{0..1}.{q-k,v_1} : f32[4] { param = R over w }\n")
    assert [t.name for t in spec.tensors] == ["h.0.q-k", "h.0.v_1", "h.1.q-k", "h.1.v_1"]


def test_the_command_caps_lengths_as_spec_files_do() -> None:
    """``--shape`` takes lengths up to 2^63-1, like a spec file's shape, and says so past it."""
    too_long = str(2**63)
    result = run("show", "S0 over mesh[2]", "--shape", too_long)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"'{too_long}': a length is at most 2^63-1 (9223372036854775807)" in result.stderr
    with pytest.raises(ParseError, match="too large \\(at most 9223372036854775807\\)"):
        parse_spec(f"mesh w = [2]\ntensor a : f32[{too_long}] {{ param = S0 over w }}\n")
