"""Golden plans (tests/golden/planner_plans.txt): layout pairs in, exact step lines out.

The file's expected lines were written by reasoning from the cost tables; each case is also
checked against the brute-force reference, so a golden line can be neither a typo nor a
reasoning slip that the planner happens to share.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import planner
from shardlang import parse_layout
from tests.test_planner_optimal import check_optimal

GOLDEN = Path(__file__).parent / "golden" / "planner_plans.txt"


def read_cases(path: Path) -> list[dict]:
    cases: list[dict] = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("== "):
            cases.append({"name": line[3:], "line": number, "expect": []})
        elif raw.startswith("    ") or line == "(no steps)" or line.startswith("error: "):
            cases[-1]["expect"].append(line)
        else:
            key, _, value = line.partition(": ")
            cases[-1][key] = value
    return cases


CASES = read_cases(GOLDEN)


def request(case: dict):
    src, dst = parse_layout(case["src"]), parse_layout(case["dst"])
    shape = tuple(int(n) for n in case["shape"].split("x"))
    bandwidth = [float(b) for b in case.get("bandwidth", "1e11").split(",")]
    cost = planner.CostModel(
        alpha=float(case.get("alpha", "5e-6")), bandwidth=bandwidth[0] if len(bandwidth) == 1 else bandwidth
    )
    limit = int(case["max_local_bytes"]) if "max_local_bytes" in case else None
    return src, dst, shape, case.get("dtype", "f32"), cost, limit


def rendered(src, dst, shape, dtype, cost, limit) -> list[str]:
    try:
        got = planner.plan(src, dst, shape, dtype, cost, max_local_bytes=limit)
    except planner.PlanError as e:
        return [f"error: {e.message}"]
    return [f"{s.describe()} -> {s.layout}" for s in got.steps] or ["(no steps)"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_golden_plan(case):
    got = rendered(*request(case))
    expect = case["expect"]
    if expect and expect[0].startswith("error: "):
        assert len(got) == 1 and expect[0][len("error: ") :] in got[0], f"{GOLDEN.name}:{case['line']}: got {got}"
    else:
        assert got == expect, f"{GOLDEN.name}:{case['line']}: {case['name']}"


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_golden_plan_is_optimal_by_brute_force(case):
    src, dst, shape, dtype, cost, limit = request(case)
    check_optimal(src, dst, shape, dtype, cost, max_local_bytes=limit)


def test_golden_file_covers_every_op_and_the_must_show_cases():
    lines = [line for case in CASES for line in case["expect"]]
    for op in planner.BASELINE_OPS:
        assert any(line.startswith(op + "(") for line in lines), op
    names = " ".join(c["name"] for c in CASES)
    assert "hierarchical all-reduce" in names and names.count("Paddle seed") == 2
    assert any(line.startswith("error: ") for line in lines) and "(no steps)" in lines
