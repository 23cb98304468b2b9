"""Meshes and layouts as text: the canonical mesh text reads back on its own, a layout's repr
reads back to an equal value over declared meshes too, and mesh identity for planning is the
grid and its ranks, not the names."""

from __future__ import annotations

import pytest

import planner
from shardlang import Layout, LayoutError, Mesh, ParseError, parse_layout, parse_mesh, parse_spec

WORLD = Mesh(shape=(2, 2), ranks=(3, 2, 1, 0), axis_names=("dp", "tp"), name="world")


@pytest.mark.parametrize(
    ("mesh", "text"),
    [
        (Mesh(shape=(2, 3)), "mesh[2,3]"),
        (Mesh(shape=(4,), ranks=(4, 5, 6, 7)), "mesh[4] ranks 4..7"),
        (Mesh(shape=(2,), axis_names=("dp",), name="pp0"), "mesh pp0 = [dp=2]"),
        (WORLD, "mesh world = [dp=2,tp=2] ranks [3,2,1,0]"),
        (Mesh(shape=(4,), ranks=(0, 8, 16, 24)), "mesh[4] ranks 0..24 step 8"),
        (Mesh(shape=(2,), ranks=(2, 5)), "mesh[2] ranks [2,5]"),  # two ranks: the list is shorter
    ],
)
def test_mesh_text_is_canonical_and_reads_back(mesh: Mesh, text: str) -> None:
    assert mesh.text() == text
    back = parse_mesh(text)
    assert back == mesh and back.name == mesh.name


def test_parse_mesh_reads_the_declaration_form_with_spaces() -> None:
    mesh = parse_mesh("mesh  world=[ dp = 2 , tp=2 ]  ranks [3, 2, 1, 0]")
    assert mesh == WORLD


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("mesh[2", r"<text>:1:7: the '\[' at line 1, column 5 is not closed: write '\]' here"),
        ("mesh[0]", "mesh axis size 0 must be at least 1"),
        ("mesh R = [2]", "reserved word"),
        ("mesh[2] ranks 1..0", "rank range 1..0 is empty"),
        ("mesh[2] ranks 0..9 step 2", "9 is not 0 plus a multiple of a step"),
        ("mesh[2] ranks 0..8 step 0", "a step >= 1"),
        ("mesh[3] ranks 0..8 step 8", "holds 3 ranks but 2 are given"),
        ("world", "unexpected 'world'"),
    ],
)
def test_bad_mesh_text_is_a_placed_error(text: str, message: str) -> None:
    with pytest.raises((ParseError, LayoutError), match=message):
        parse_mesh(text)


@pytest.mark.parametrize(
    "text",
    [
        "S(dp),R over world",
        "R,S(tp) | P(dp):avg over world",
        "() over world",
        "S(tp,dp),R over world",
        "R | P(tp):max over world",
    ],
)
def test_repr_of_a_layout_over_a_declared_mesh_reads_back_alone(text: str) -> None:
    layout = parse_layout(text, {"world": WORLD})
    shown = repr(layout)
    assert shown.startswith("Layout('") and shown.endswith("')")
    inner = shown[len("Layout('") : -len("')")]
    assert inner.endswith(" over mesh world = [dp=2,tp=2] ranks [3,2,1,0]")
    back = parse_layout(inner)
    assert back == layout and back.mesh.name == "world"
    assert str(back) == str(layout) == text


def test_an_inline_named_mesh_must_match_the_declared_one() -> None:
    assert parse_layout("R over mesh world = [dp=2,tp=2] ranks [3,2,1,0]", {"world": WORLD}).mesh == WORLD
    with pytest.raises(LayoutError, match=r"1:8: mesh 'world' is declared as mesh world = \[dp=2,tp=2\] ranks"):
        parse_layout("R over mesh world = [dp=4]", {"world": WORLD})


def test_a_spec_entry_may_write_its_declared_mesh_out() -> None:
    spec = parse_spec("mesh w = [a=2]\ntensor x: f32[4] { param = S(a) over mesh w = [a=2] }")
    assert spec.tensors[0].layouts.param == Layout(dims=((0,),), mesh=spec.meshes[0].mesh)
    with pytest.raises(
        LayoutError, match="2:38: mesh 'w' is declared as mesh w = \\[a=2\\], not as mesh w = \\[a=4\\]"
    ):
        parse_spec("mesh w = [a=2]\ntensor x: f32[8] { param = S(a) over mesh w = [a=4] }")


def test_same_geometry_ignores_names_but_not_ranks() -> None:
    plain = Mesh(shape=(2, 2), ranks=(3, 2, 1, 0))
    assert WORLD.same_geometry(plain) and plain.same_geometry(WORLD)
    assert plain != WORLD
    assert not WORLD.same_geometry(Mesh(shape=(2, 2)))
    assert not WORLD.same_geometry(Mesh(shape=(4,), ranks=(3, 2, 1, 0)))


def test_plan_json_names_each_mesh_by_its_text() -> None:
    src = parse_layout("S(dp),R over world", {"world": WORLD})
    dst = parse_layout("R,R over world", {"world": WORLD})
    plan = planner.plan(src, dst, (4, 4), "f32")
    data = plan.to_json()
    assert data["meshes"] == {"world": "mesh world = [dp=2,tp=2] ranks [3,2,1,0]"}
    back = planner.Plan.from_json(data)
    assert back == plan and back.src.mesh.name == "world"
    with pytest.raises(planner.PlanError, match="the mesh under 'world' is 'mesh other = "):
        planner.Plan.from_json({**data, "meshes": {"world": "mesh other = [dp=2,tp=2] ranks [3,2,1,0]"}})


def test_a_rank_range_is_held_and_printed_by_its_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardlang.mesh import RowMajorRanks

    ranged = parse_mesh("mesh[dp=4096,tp=8] ranks 32768..65535")
    listed = Mesh((4096, 8), tuple(range(32768, 65536)), ("dp", "tp"))
    assert isinstance(ranged.ranks, RowMajorRanks) and isinstance(listed.ranks, RowMajorRanks)
    assert ranged == listed and hash(ranged) == hash(listed)
    assert ranged.ranks == tuple(range(32768, 65536)) and ranged.ranks != tuple(range(32768))
    assert ranged != Mesh((4096, 8), axis_names=("dp", "tp"))  # the same length from 0
    assert ranged.coordinate(32768 + 8 * 5 + 3) == (5, 3) and ranged.rank_at((4095, 7)) == 65535
    assert 32767 not in ranged.ranks and ranged.ranks.index(32770) == 2
    assert eval(repr(ranged), {"Mesh": Mesh, "RowMajorRanks": RowMajorRanks}) == ranged
    assert str(Mesh((1,), (7,))) == "mesh[1] ranks [7]"  # one rank: a list of one

    def refuse(self: RowMajorRanks) -> None:
        raise AssertionError("walked the ranks")

    monkeypatch.setattr(RowMajorRanks, "__iter__", refuse)
    assert ranged.describe() == "mesh[dp=4096,tp=8] ranks 32768..65535"
    assert parse_mesh(ranged.text()) == ranged


def test_a_strided_group_is_held_printed_and_read_back_by_its_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    from planner.legs import flat_group
    from shardlang.mesh import StridedRanks

    world = parse_mesh("mesh[dp=16384,tp=8] ranks 8..131079")
    # rank 8 + 8 * 3 + 5's group along dp: every 8th rank from 13, found without walking them
    monkeypatch.setattr(StridedRanks, "__iter__", lambda self: (_ for _ in ()).throw(AssertionError("walked")))
    group = flat_group(world, 0, 8 + 8 * 3 + 5)
    assert group.describe() == "mesh[dp=16384,tp=1] ranks 13..131077 step 8"
    assert parse_mesh(group.text()) == group and hash(parse_mesh(group.text())) == hash(group)
    assert group.coordinate(13 + 8 * 7) == (7, 0) and group.rank_at((16383, 0)) == 131077
    assert 14 not in group.ranks and 131085 not in group.ranks and 5 not in group.ranks
    monkeypatch.undo()
    # the same ranks listed: one value, one hash, whichever way they came
    listed = Mesh((16384, 1), tuple(range(13, 131078, 8)), ("dp", "tp"))
    assert listed == group and hash(listed) == hash(group) and isinstance(listed.ranks, StridedRanks)
    assert list(group.ranks) == [world.rank_at((k, 5)) for k in range(16384)]
    assert Mesh((3,), (0, 8, 17)).describe() == "mesh[3] ranks [0,8,17]"  # not a run: listed


def test_a_cross_mesh_request_over_many_axes_is_refused_within_its_budget() -> None:
    import time

    # 196,608 ranks a mesh: every leg's message named the target mesh by walking its ranks
    # (30 s of CPU before the refusal); now printed by the range's ends
    mesh = "mesh[3,2,4,2,2,4,8,1,2,4,8,1]"
    started = time.process_time()
    with pytest.raises(planner.PlanBudgetError):
        planner.plan(parse_layout(f"S(0,9,5) over {mesh}"), parse_layout(f"R over {mesh} ranks 196608..393215"), (95,))
    assert time.process_time() - started < 5


def test_a_flat_step_plan_names_its_groups_by_their_ends_in_json_and_reads_back() -> None:
    import json

    from planner.spec_plan import plan_spec
    from planner.step import StepPlan

    spec = parse_spec(
        "mesh world = [dp=512, tp=8]\n"
        "tensor w : f32[64, 64] { param = S(tp),R over world  grad = S(tp),R | P(dp):avg over world "
        "state = S(tp,dp),R over world }"
    )
    step = plan_spec(spec, flat_axis="dp", rank=13).step
    text = json.dumps(step.to_json())
    # rank 13's dp group: every 8th rank from 5, by its ends whatever its size
    assert "mesh[dp=512,tp=1] ranks 5..4093 step 8" in text and "8,16" not in text
    assert StepPlan.from_json(json.loads(text)) == step
