"""The layout language: every example of docs/language.md, canonical forms, round trips, chunking
against torch.chunk, and every layout error with its exact position."""

from __future__ import annotations

import itertools
import math
from typing import ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardlang import (
    REDUCE_OPS,
    Layout,
    LayoutError,
    Mesh,
    ParseError,
    ShardlangError,
    chunk_bounds,
    format_layout,
    padded_length,
    parse_layout,
    parse_spec,
)
from shardlang.mesh import RESERVED_WORDS

M22 = Mesh(shape=(2, 2))
M24 = Mesh(shape=(2, 4))
DPTP = Mesh(shape=(2, 2), axis_names=("dp", "tp"))
WORLD = Mesh(shape=(2, 2), axis_names=("dp", "tp"), name="world")


# --- the examples of docs/language.md -----------------------------------------------------
DOC_EXAMPLES = [
    ("S0,R over mesh[2,2]", Layout(dims=((0,), ()), mesh=M22)),
    ("R,S1 over mesh[2,2]", Layout(dims=((), (1,)), mesh=M22)),
    ("S01,R over mesh[2,2]", Layout(dims=((0, 1), ()), mesh=M22)),
    ("S10,R over mesh[2,2]", Layout(dims=((1, 0), ()), mesh=M22)),
    ("R,S1 | P0 over mesh[2,2]", Layout(dims=((), (1,)), mesh=M22, partial=((0, "sum"),))),
    ("R,R | P0:avg,P1:max over mesh[2,4]", Layout(dims=((), ()), mesh=M24, partial=((0, "avg"), (1, "max")))),
    ("() over mesh[2,2]", Layout(dims=(), mesh=M22)),
    ("S(dp),S(tp) over world", Layout(dims=((0,), (1,)), mesh=WORLD)),
    ("S(dp,tp),R over mesh[dp=2,tp=2]", Layout(dims=((0, 1), ()), mesh=DPTP)),
]


@pytest.mark.parametrize(("text", "expected"), DOC_EXAMPLES)
def test_doc_examples_parse_to_the_layout_they_describe(text: str, expected: Layout) -> None:
    layout = parse_layout(text, {"world": WORLD})
    assert layout == expected
    assert str(layout) == text  # every example is already written canonically


def test_nesting_order_makes_a_different_layout() -> None:
    assert parse_layout("S01,R over mesh[2,2]") != parse_layout("S10,R over mesh[2,2]")


def test_declared_mesh_and_its_inline_twin_differ_only_by_name() -> None:
    declared = parse_layout("S(dp),R over world", {"world": WORLD})
    inline = parse_layout("S(dp),R over mesh[dp=2,tp=2]")
    assert declared.mesh.anonymous() == inline.mesh
    assert declared != inline


# --- canonical forms ----------------------------------------------------------------------
CANONICAL = [
    ("R | P0,P1 over mesh[2,2]", "R | P01 over mesh[2,2]"),
    ("R | P1,P0 over mesh[2,2]", "R | P01 over mesh[2,2]"),
    ("R | P0:sum over mesh[2]", "R | P0 over mesh[2]"),
    ("R | P1:avg,P0:avg over mesh[2,2]", "R | P01:avg over mesh[2,2]"),
    ("R | P(0,1) over mesh[2,2]", "R | P01 over mesh[2,2]"),
    ("R | P2:max,P1,P0:max over mesh[2,2,2]", "R | P02:max,P1 over mesh[2,2,2]"),
    ("R | P1,P0:min over mesh[2,2]", "R | P0:min,P1 over mesh[2,2]"),
    ("S(0,1),R over mesh[2,2]", "S01,R over mesh[2,2]"),
    ("S(1),S(0) over mesh[2,2]", "S1,S0 over mesh[2,2]"),
    ("S0,R over mesh[dp=2,tp=2]", "S(dp),R over mesh[dp=2,tp=2]"),
    ("S10 over mesh[dp=2,tp=2]", "S(tp,dp) over mesh[dp=2,tp=2]"),
    ("R | P(1):avg,P(dp) over mesh[dp=2,tp=2]", "R | P(dp),P(tp):avg over mesh[dp=2,tp=2]"),
    ("R over mesh[2,2] ranks 0..3", "R over mesh[2,2]"),
    ("R over mesh[2,2] ranks [0,1,2,3]", "R over mesh[2,2]"),
    ("R over mesh[2,2] ranks [4,5,6,7]", "R over mesh[2,2] ranks 4..7"),
    ("R over mesh[2] ranks [3,1]", "R over mesh[2] ranks [3,1]"),
    ("R over mesh[1] ranks 5", "R over mesh[1] ranks [5]"),
    ("  S0 ,R|P1   over\tmesh[ 2 , 2 ]  ", "S0,R | P1 over mesh[2,2]"),
    ("S0 over mesh[2] # a comment", "S0 over mesh[2]"),
    ("S(10) over mesh[1,1,1,1,1,1,1,1,1,1,2]", "S(10) over mesh[1,1,1,1,1,1,1,1,1,1,2]"),
    ("S(9,10) over mesh[1,1,1,1,1,1,1,1,1,2,2]", "S(9,10) over mesh[1,1,1,1,1,1,1,1,1,2,2]"),
    ("S9 over mesh[1,1,1,1,1,1,1,1,1,2,2]", "S9 over mesh[1,1,1,1,1,1,1,1,1,2,2]"),
]


@pytest.mark.parametrize(("text", "canonical"), CANONICAL)
def test_canonical_form(text: str, canonical: str) -> None:
    layout = parse_layout(text)
    assert str(layout) == canonical
    assert parse_layout(canonical) == layout


def test_format_layout_is_str() -> None:
    layout = parse_layout("S1,R | P0:avg over mesh[2,3]")
    assert format_layout(layout) == str(layout) == "S1,R | P0:avg over mesh[2,3]"
    assert repr(layout) == "Layout('S1,R | P0:avg over mesh[2,3]')"


# --- generated layouts --------------------------------------------------------------------
# Names that look like the language's own tokens, next to ordinary identifiers.
TRICKY_NAMES = ["S0", "P1", "R0", "S01", "Rx", "mesh_", "over1", "bandwidth", "latency", "dp", "tp", "_", "x9"]
IDENTIFIERS = st.one_of(
    st.sampled_from(TRICKY_NAMES),
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True).filter(lambda n: n not in RESERVED_WORDS),
)


# Strategies are built once where they can be: one built inside a draw is built and validated
# again at every draw, which cost more than the checks themselves.
MESH_NAMES = st.none() | IDENTIFIERS
RANK_ORDERS = st.sampled_from(("row-major", "shifted", "permuted", "scattered"))
ROLES = st.sampled_from(("replicated", "split", "partial"))
REDUCE_OP = st.sampled_from(REDUCE_OPS)


@st.composite
def meshes(draw: st.DrawFn, max_axes: int = 5, max_size: int = 4) -> Mesh:
    shape = tuple(draw(st.lists(st.integers(1, max_size), min_size=1, max_size=max_axes)))
    names = None
    if draw(st.booleans()):
        names = tuple(draw(st.lists(IDENTIFIERS, min_size=len(shape), max_size=len(shape), unique=True)))
    size = math.prod(shape)
    order = draw(RANK_ORDERS)
    if order == "row-major":
        ranks = tuple(range(size))
    elif order == "shifted":
        lo = draw(st.integers(0, 50))
        ranks = tuple(range(lo, lo + size))
    elif order == "permuted":
        ranks = tuple(draw(st.permutations(range(size))))
    else:
        ranks = tuple(draw(st.lists(st.integers(0, 10 * size), min_size=size, max_size=size, unique=True)))
    return Mesh(shape=shape, ranks=ranks, axis_names=names, name=draw(MESH_NAMES))


@st.composite
def layouts(draw: st.DrawFn, mesh_strategy: st.SearchStrategy[Mesh] | None = None, max_dims: int = 4) -> Layout:
    mesh = draw(meshes() if mesh_strategy is None else mesh_strategy)
    ndim = draw(st.integers(0, max_dims))
    dims: list[list[int]] = [[] for _ in range(ndim)]
    partial = []
    # Every axis is replicated, splits a dim (appended in a random order), or is partial.
    for axis in draw(st.permutations(range(mesh.ndim))):
        role = draw(ROLES)
        if role == "split" and ndim:
            dims[draw(st.integers(0, ndim - 1))].append(axis)
        elif role == "partial":
            partial.append((axis, draw(REDUCE_OP)))
    return Layout(dims=tuple(tuple(d) for d in dims), mesh=mesh, partial=tuple(partial))


def declared(layout: Layout) -> dict[str, Mesh]:
    return {layout.mesh.name: layout.mesh} if layout.mesh.name else {}


@settings(max_examples=400, deadline=None)
@given(layouts())
def test_generated_layouts_round_trip(layout: Layout) -> None:
    text = str(layout)
    again = parse_layout(text, declared(layout))
    assert again == layout
    assert str(again) == text
    # The planner's unchecked constructor gives the same value from canonical parts.
    trusted = Layout.trusted(layout.dims, layout.mesh, layout.partial)
    assert trusted == layout and hash(trusted) == hash(layout) and str(trusted) == text


ANONYMOUS_LAYOUTS = layouts(meshes().map(Mesh.anonymous))
SPACE = st.sampled_from(("", " ", "  ", "\t", "\n"))


@st.composite
def spellings(draw: st.DrawFn) -> tuple[Layout, str]:
    """A layout with one of its many non-canonical spellings, written independently of
    format_layout: axes by number or name, digit or list form, partial axes in any grouping
    and order, ``:sum`` spelled out or not, random spaces, the mesh inline."""
    layout = draw(ANONYMOUS_LAYOUTS)
    mesh = layout.mesh

    def axis_ref(axis: int) -> str:
        by_name = mesh.axis_names is not None and draw(st.booleans())
        return mesh.axis_names[axis] if by_name else str(axis)  # type: ignore[index]

    def axis_group(letter: str, axes: list[int]) -> str:
        if mesh.axis_names is None and all(a < 10 for a in axes) and draw(st.booleans()):
            return letter + "".join(str(a) for a in axes)
        return letter + draw(SPACE) + "(" + ",".join(draw(SPACE) + axis_ref(a) + draw(SPACE) for a in axes) + ")"

    dims = [axis_group("S", list(axes)) if axes else "R" for axes in layout.dims]
    text = ",".join(draw(SPACE) + d + draw(SPACE) for d in dims) if dims else "(" + draw(SPACE) + ")"
    if layout.partial:
        entries = draw(st.permutations(layout.partial))
        groups: list[tuple[str, list[int]]] = []
        for axis, op in entries:
            if groups and groups[-1][0] == op and draw(st.booleans()):
                groups[-1][1].append(axis)
            else:
                groups.append((op, [axis]))
        written = []
        for op, axes in groups:
            suffix = "" if op == "sum" and draw(st.booleans()) else ":" + op
            written.append(axis_group("P", axes) + suffix)
        text += draw(SPACE) + "|" + draw(SPACE) + ",".join(written)
    shape = ",".join(
        str(s) if mesh.axis_names is None else f"{mesh.axis_names[i]}={s}" for i, s in enumerate(mesh.shape)
    )
    ranks = ""
    if mesh.ranks != tuple(range(mesh.size)) or draw(st.booleans()):
        ranks = " ranks [" + ",".join(map(str, mesh.ranks)) + "]"
    return layout, f"{text} over mesh[{shape}]{ranks}"


@settings(max_examples=300, deadline=None)
@given(spellings())
def test_every_spelling_reads_to_the_layout_and_prints_canonically(case: tuple[Layout, str]) -> None:
    layout, text = case
    parsed = parse_layout(text)
    assert parsed == layout
    assert str(parsed) == str(layout)


# --- chunking against torch.chunk -----------------------------------------------------------
def torch_chunk_piece(full: torch.Tensor, layout: Layout, coordinate: tuple[int, ...]) -> torch.Tensor:
    """The block at ``coordinate``, cut from the full tensor with torch.chunk, dim by dim and
    mesh axis by mesh axis (outer first). torch.chunk returns fewer chunks than asked when
    trailing ones would be empty: those pieces are empty."""
    piece = full
    for d, axes in enumerate(layout.dims):
        for a in axes:
            chunks = torch.chunk(piece, layout.mesh.shape[a], dim=d)
            index = coordinate[a]
            piece = chunks[index] if index < len(chunks) else piece.narrow(d, piece.shape[d], 0)
    return piece


def check_against_torch_chunk(layout: Layout, shape: tuple[int, ...]) -> None:
    full = torch.arange(math.prod(shape)).reshape(shape)
    largest = [0] * len(shape)
    for coordinate in itertools.product(*(range(n) for n in layout.mesh.shape)):
        bounds = layout.piece(shape, coordinate)
        ours = full[tuple(slice(lo, hi) for lo, hi in bounds)]
        expected = torch_chunk_piece(full, layout, coordinate)
        assert ours.shape == expected.shape, (layout, shape, coordinate)
        assert torch.equal(ours, expected), (layout, shape, coordinate)
        largest = [max(m, s) for m, s in zip(largest, expected.shape, strict=True)]
        rank = layout.mesh.rank_at(coordinate)
        assert layout.rank_piece(shape, rank) == bounds
    assert list(layout.local_shape(shape)) == largest


SMALL_LAYOUTS = layouts(meshes(max_axes=3, max_size=4), max_dims=3)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_pieces_match_torch_chunk(data: st.DataObject) -> None:
    layout = data.draw(SMALL_LAYOUTS)
    shape = tuple(data.draw(st.lists(st.integers(0, 11), min_size=layout.ndim, max_size=layout.ndim)))
    check_against_torch_chunk(layout, shape)


@pytest.mark.parametrize(
    ("text", "shape"),
    [
        ("S0 over mesh[4]", (5,)),  # pieces 2,2,1,0: the last one is empty
        ("S0 over mesh[4]", (2,)),  # two empty pieces
        ("S0 over mesh[3]", (0,)),  # all empty
        ("S01,R over mesh[2,3]", (7, 3)),  # nested: 4 then 2,2,0; 3 then 1,1,1
        ("S10,R over mesh[2,3]", (7, 3)),
        ("S1,S0 over mesh[3,4]", (5, 2)),
        ("S012 over mesh[2,2,2]", (9,)),
        ("R,S(tp,dp) over mesh[dp=2,tp=2]", (3, 5)),
        ("S(tp),R | P(dp):max over mesh[dp=2,tp=3]", (2, 4)),
    ],
)
def test_uneven_and_empty_pieces_match_torch_chunk(text: str, shape: tuple[int, ...]) -> None:
    check_against_torch_chunk(parse_layout(text), shape)


def test_chunk_bounds_and_padded_length_by_hand() -> None:
    # torch.chunk(range(5), 4) -> [0,1], [2,3], [4]; the fourth piece is empty at the end.
    assert [chunk_bounds(5, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [chunk_bounds(0, 3, i) for i in range(3)] == [(0, 0)] * 3
    assert padded_length(7, [2, 3]) == 2  # ceil(ceil(7/2)/3)
    assert padded_length(0, [4]) == 0


def test_rank_piece_follows_explicit_ranks() -> None:
    layout = parse_layout("S0,S1 over mesh[2,2] ranks [3,1,0,2]")
    shape = (4, 6)
    # Ranks are laid out row-major: 3 at (0,0), 1 at (0,1), 0 at (1,0), 2 at (1,1).
    assert layout.rank_piece(shape, 3) == ((0, 2), (0, 3))
    assert layout.rank_piece(shape, 1) == ((0, 2), (3, 6))
    assert layout.rank_piece(shape, 0) == ((2, 4), (0, 3))
    assert layout.rank_piece(shape, 2) == ((2, 4), (3, 6))
    with pytest.raises(LayoutError, match="rank 4 is not in"):
        layout.rank_piece(shape, 4)


@settings(max_examples=200, deadline=None)
@given(meshes())
def test_coordinates_and_ranks_are_inverse(mesh: Mesh) -> None:
    # Row-major order, the last axis fastest: the i-th coordinate of itertools.product is ranks[i].
    for flat, coordinate in enumerate(itertools.product(*(range(n) for n in mesh.shape))):
        assert mesh.rank_at(coordinate) == mesh.ranks[flat]
        assert mesh.coordinate(mesh.ranks[flat]) == coordinate
    with pytest.raises(LayoutError, match=f"rank {max(mesh.ranks) + 1} is not in"):
        mesh.coordinate(max(mesh.ranks) + 1)


class CountedRank(int):
    """A rank that counts the comparisons made with it: a scan of a mesh's ranks compares it
    with every rank before it, a lookup in an index with about one."""

    compared: ClassVar[list[int]] = [0]

    def __eq__(self, other: object) -> bool:
        self.compared[0] += 1
        return int(self) == other

    __hash__ = int.__hash__


def test_rank_lookups_do_not_scan_the_mesh() -> None:
    # The receive lower bound and point-to-point plans look up every rank of a mesh: a scan of
    # the rank list per lookup made them quadratic (minutes on the largest meshes). Reversed,
    # the ranks looked up are the last ones a scan would reach (bench/bench_planner_budget.py
    # times these lookups).
    mesh = Mesh(shape=(512, 512), ranks=tuple(reversed(range(512 * 512))))
    CountedRank.compared[0] = 0
    coordinates = [mesh.coordinate(CountedRank(r)) for r in range(2000)]
    assert coordinates == [(511 - r // 512, 511 - r % 512) for r in range(2000)]
    assert CountedRank.compared[0] <= 2 * 2000, CountedRank.compared[0]


def test_shape_must_match_the_layout() -> None:
    layout = parse_layout("S0,R over mesh[2]")
    with pytest.raises(LayoutError, match=r"describes a 2-d tensor but the shape \[4\] has 1 dims"):
        layout.local_shape((4,))
    with pytest.raises(LayoutError, match="negative"):
        layout.piece((4, -1), (0,))


# --- errors, with their exact line and column ------------------------------------------------
LAYOUT_ERRORS = [
    # (text, error type, column, words the message must contain)
    ("S0,S0 over mesh[2,2]", LayoutError, 5, "mesh axis 0 is used twice (by dim 0 and by dim 1)"),
    ("S01,R | P1 over mesh[2,2]", LayoutError, 10, "mesh axis 1 is used twice (by dim 0 and by a partial)"),
    ("S(dp),S(dp) over mesh[dp=2]", LayoutError, 9, "mesh axis dp is used twice"),
    ("R | P00 over mesh[2]", LayoutError, 7, "mesh axis 0 is used twice"),
    ("S2,R over mesh[2,2]", LayoutError, 2, "mesh axis 2 is out of range for mesh[2,2]"),
    ("R | P(5) over mesh[2]", LayoutError, 7, "mesh axis 5 is out of range"),
    ("S(xp) over mesh[dp=2]", LayoutError, 3, "unknown mesh axis 'xp' for mesh[dp=2] (names: dp)"),
    ("S(dp) over mesh[2,2]", LayoutError, 3, "unknown mesh axis 'dp' for mesh[2,2] (names: none"),
    ("S0 over world", LayoutError, 9, "unknown mesh 'world' (meshes: none declared)"),
    ("R over mesh[2,2] ranks 0..2", LayoutError, 18, "mesh[2,2] holds 4 ranks but 3 are given"),
    ("R over mesh[2,2] ranks [0,1,2,3,4]", LayoutError, 18, "holds 4 ranks but 5 are given"),
    ("R over mesh[2] ranks [1,1]", LayoutError, 16, "rank 1 appears twice in the mesh"),
    ("R over mesh[2] ranks 3..1", LayoutError, 16, "rank range 3..1 is empty"),
    ("R over mesh[2,0]", LayoutError, 15, "mesh axis size 0 must be at least 1"),
    ("R over mesh[dp=2,2]", LayoutError, 13, "name every mesh axis or none of them"),
    ("R over mesh[a=2,a=2]", LayoutError, 17, "mesh axis name 'a' is used twice"),
    ("R over mesh[S=2]", LayoutError, 13, "axis name 'S' is a reserved word"),
    ("R over mesh[1024,1024,2]", LayoutError, 13, "larger than"),
    ("R over mesh[2] ranks 0..99999999999", LayoutError, 16, "larger than"),
    ("R | P0:prod over mesh[2]", LayoutError, 8, "unknown reduce op 'prod' (expected one of sum, avg, max, min)"),
    ("S0 R over mesh[2]", ParseError, 4, "separated by commas: did you mean 'S0,R over mesh[2]'?"),
    ("S0,R over", ParseError, 10, "the text ends too early; expected"),
    ("S0 over mesh[2", ParseError, 15, "the '[' at line 1, column 13 is not closed: write ']' here"),
    ("S0 @ over mesh[2]", ParseError, 4, "unexpected character '@'"),
    ("S0 over mesh[2] extra", ParseError, 17, "unexpected 'extra'; expected the end of the text"),
    ("", ParseError, 1, "the text ends too early"),
    ("S0, over mesh[2]", ParseError, 5, "unexpected 'over'"),
    ("Q0 over mesh[2]", ParseError, 1, "unexpected"),
    ("S0 over mesh[2.5]", ParseError, 15, "unexpected"),
]


@pytest.mark.parametrize(("text", "kind", "column", "words"), LAYOUT_ERRORS)
def test_layout_errors_name_the_item_and_its_place(text: str, kind: type, column: int, words: str) -> None:
    with pytest.raises(kind) as caught:
        parse_layout(text, filename="cfg.txt")
    error = caught.value
    assert words in error.message
    assert error.position is not None
    assert (error.position.filename, error.position.line, error.position.column) == ("cfg.txt", 1, column)
    rendered = str(error)
    caret_line = rendered.splitlines()[-1]
    assert rendered.startswith(f"cfg.txt:1:{column}: ")
    assert caret_line.index("^") == 4 + column - 1  # under the offending character
    assert error.to_json() == {
        "file": "cfg.txt",
        "line": 1,
        "column": column,
        "message": error.message,
        "kind": kind.__name__,
    }


def test_the_caret_keeps_tabs() -> None:
    with pytest.raises(LayoutError) as caught:
        parse_layout("\tS5 over mesh[2]")
    assert str(caught.value).splitlines()[-1] == "    \t ^"


def test_a_layout_and_a_spec_must_be_text() -> None:
    with pytest.raises(ParseError, match="a layout is text, not int"):
        parse_layout(5)  # type: ignore[arg-type]
    for value in (None, b"mesh w = [2]"):
        with pytest.raises(ParseError, match=f"a spec is text, not {type(value).__name__}"):
            parse_spec(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: Layout(dims=((0,), (0,)), mesh=M22), "mesh axis 0 is used twice (by dim 0 and by dim 1)"),
        (lambda: Layout(dims=((2,),), mesh=M22), "mesh axis 2 (dim 0) is out of range"),
        (lambda: Layout(dims=((0,),), mesh=M22, partial={0: "sum"}), "used twice (by dim 0 and by a partial)"),
        (lambda: Layout(dims=((),), mesh=M22, partial={1: "prod"}), "unknown reduce op 'prod'"),
        (lambda: Mesh(shape=()), "a mesh needs at least one axis"),
        (lambda: Mesh(shape=(2, 0)), "mesh axis 1 has size 0"),
        (lambda: Mesh(shape=(2,), ranks=(0, -1)), "rank -1 is negative"),
        (lambda: Mesh(shape=(2,), axis_names=("a", "b")), "2 axis names for a 1-axis mesh"),
        (lambda: Mesh(shape=(2,), axis_names=("a-b",)), "axis name 'a-b' is not an identifier"),
        (lambda: Mesh(shape=(2,), name="over"), "mesh name 'over' is a reserved word"),
    ],
)
def test_values_built_in_code_are_checked_too(build, words: str) -> None:
    with pytest.raises(LayoutError) as caught:
        build()
    assert words in caught.value.message
    assert caught.value.position is None
    assert isinstance(caught.value, ShardlangError)
