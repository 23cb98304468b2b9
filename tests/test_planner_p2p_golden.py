"""Golden point-to-point, mixed and cross-mesh plans (tests/golden/planner_p2p_plans.txt): a
layout pair in, its exact steps and every transfer (``src -> dst box``) out.

The golden text pins the planner's choices (which replica sends, in what order) so that a
change shows up as a reviewable diff. Each case is also executed on real tensors
(``runtime.execution.simulate``) and checked against the full tensor sliced by hand, so a golden line
cannot record a plan that moves the wrong elements.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import planner
from runtime import simulate
from shardlang import parse_layout
from tests.test_planner_golden import read_cases
from tests.test_runtime_support import chunk_block, full_tensor, source_pieces

GOLDEN = Path(__file__).parent / "golden" / "planner_p2p_plans.txt"
CASES = read_cases(GOLDEN)


def request(case: dict) -> tuple:
    shape = tuple(int(n) for n in case["shape"].split("x"))
    return parse_layout(case["src"]), parse_layout(case["dst"]), shape, case.get("p2p") == "yes"


def rendered(plan: planner.Plan) -> list[str]:
    lines = []
    for step in plan.steps:
        lines.append(f"{step.describe()} -> {step.layout}")
        lines += [f"{t.src_rank} -> {t.dst_rank} {t.box.text()}" for t in step.transfers]
    return lines or ["(no steps)"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_golden_p2p_plan(case: dict) -> None:
    src, dst, shape, p2p = request(case)
    assert rendered(planner.plan(src, dst, shape, point_to_point=p2p)) == case["expect"], (
        f"{GOLDEN.name}:{case['line']}: {case['name']}"
    )


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_golden_p2p_plan_moves_the_right_elements(case: dict) -> None:
    src, dst, shape, p2p = request(case)
    plan = planner.plan(src, dst, shape, point_to_point=p2p)
    full = full_tensor(shape, torch.float32, seed=5)
    out = simulate(plan, source_pieces(full, src, seed=6))
    assert sorted(out) == sorted(dst.mesh.ranks)
    groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
    partial_axes = {a for a, _ in dst.partial}
    for rank, piece in out.items():
        coordinate = dst.mesh.coordinate(rank)
        key = tuple(c for a, c in enumerate(coordinate) if a not in partial_axes)
        groups.setdefault(key, []).append((coordinate, piece))
    ops = {op for _, op in dst.partial}
    for members in groups.values():
        coordinate = members[0][0]
        pieces = torch.stack([p for _, p in members])
        value = pieces.mean(0) if ops == {"avg"} else pieces.sum(0)
        torch.testing.assert_close(value, chunk_block(full, dst, coordinate), rtol=1e-6, atol=1e-5)


def test_golden_file_covers_point_to_point_mixed_and_cross_mesh_plans() -> None:
    steps = [[line.split("(")[0] for line in c["expect"] if "(" in line] for c in CASES]
    assert any(s == ["point_to_point"] for s in steps)  # point-to-point alone
    assert any("point_to_point" in s and len(s) > 1 for s in steps)  # mixed with collectives
    cross = [c for c in CASES if parse_layout(c["src"]).mesh.ranks != parse_layout(c["dst"]).mesh.ranks]
    assert len(cross) >= 3
