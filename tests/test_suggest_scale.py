"""``shardlang suggest`` at cluster sizes: its work follows tensors and mesh axes, not ranks.

A mesh declared without a ``ranks`` clause holds its ranks as ``RowMajorRanks`` (its length
only); pricing, solving and evaluating a problem on one must never walk its ranks, which is
what made a 131,072-rank problem take minutes (collective kinds keyed by ``tuple(mesh.ranks)``
and hashed on every evaluation)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from planner.knapsack import suggest_best
from planner.suggest import build_problems
from shardlang import parse_spec
from shardlang.mesh import RowMajorRanks

BIG = """
mesh world = [dp={n}]  bandwidth 25e9  latency 20us
tensor w : bf16[{rows}, 64] {{ param = R,R over world  grad = R,R | P(dp):avg over world  state = S(dp),R over world }}
tensor n : f32[64] {{ param = R over world  grad = R | P(dp):avg over world }}
"""


def _refuse(self: RowMajorRanks) -> Iterator[int]:
    raise AssertionError(f"walked the {len(self)} ranks of a row-major mesh")


def test_suggest_never_walks_the_ranks_of_a_row_major_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_spec(BIG.format(n=2**20, rows=2**20))
    monkeypatch.setattr(RowMajorRanks, "__iter__", _refuse)
    problems = build_problems(spec, "adamw")
    result = suggest_best(problems, 2**40)
    for p in problems:
        for name in p.strategy_names():
            p.strategy(name)
    assert result.best.memory <= 2**40


def test_a_mesh_of_other_ranks_than_0_to_n() -> None:
    # rank 0 is in no mesh of this spec: pricing plans as the mesh's first rank
    spec = parse_spec(BIG.replace("[dp={n}]", "[dp={n}] ranks 8..11").format(n=4, rows=8))
    plain = build_problems(spec, "adamw")[0]
    assert [p.flat_axis for p in build_problems(spec, "adamw")] == [None, "dp"]
    assert plain.original().memory > 0
