"""The search's packed moves read through their named view (``planner.space.MoveFields``):
the worked example of its docstring, with every field counted by hand from the cost table."""

from __future__ import annotations

import pytest

import planner
import planner.search
from planner.space import REPLICATED, MoveFields, role_code
from shardlang import parse_layout


def test_the_docstring_move_is_what_the_search_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    paths = []
    search = planner.search._astar

    def spy(*args, **kwargs):
        path = search(*args, **kwargs)
        paths.append(path)
        return path

    monkeypatch.setattr(planner.search, "_astar", spy)
    planner.plan(parse_layout("S0,R over mesh[4]"), parse_layout("R,R over mesh[4]"), (8, 8), "f32")
    ((move,),) = paths
    fields = MoveFields(*move)
    piece_bytes = (8 // 4) * 8 * 4  # a 2x8 f32 piece
    assert fields == MoveFields(
        op="all_gather",
        axis=0,
        dim=0,
        to_dim=None,
        reduce_op=None,
        state=0,
        bytes=3 * piece_bytes,  # (n-1) * b
        rounds=3,  # n-1
        role_before=role_code("S", 0),
        role_after=REPLICATED,
        elements=8 * 8,
        copied=0,  # the default model prices no copies (and dim 0's even blocks need none)
    )
    assert move == ("all_gather", 0, 0, None, None, 0, 192, 3, 5, 0, 64, 0)  # as the docstring writes it
