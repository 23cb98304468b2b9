"""Every line of the shared conformance data: our plan costs the independent optimum.

The data (``shared/conformance/reshard_costs.jsonl``) comes from an exhaustive search outside
this project; ``steps_of_one_optimal_plan`` is the length of a cheapest plan, and no plan of
equal time is shorter, so ours must have exactly that many steps.
"""

from __future__ import annotations

import pytest

import planner
from shardlang import parse_layout


def test_every_conformance_line_is_planned_at_the_optimal_cost(reshard_costs):
    assert len(reshard_costs) == 400
    wrong = []
    for line in reshard_costs:
        src, dst = parse_layout(line["src"]), parse_layout(line["dst"])
        cost = planner.CostModel(alpha=line["alpha"], bandwidth=line["bandwidth"])
        got = planner.plan(src, dst, line["shape"], line["dtype"], cost)
        if got.total_seconds != pytest.approx(line["optimal_seconds"], rel=1e-9, abs=0):
            wrong.append(f"{line['src']} -> {line['dst']}: {got.total_seconds} s, optimal {line['optimal_seconds']} s")
        elif len(got.steps) != line["steps_of_one_optimal_plan"]:
            wrong.append(
                f"{line['src']} -> {line['dst']}: {len(got.steps)} steps, want {line['steps_of_one_optimal_plan']}"
            )
        assert got.src == src and got.dst == dst and (not got.steps or got.steps[-1].layout == dst)
    assert not wrong, "\n".join(wrong)


def test_conformance_covers_what_it_should(reshard_costs):
    """The sample exercises partial sources, per-axis bandwidths and non-trivial plans."""
    assert any(" | P" in line["src"] for line in reshard_costs)
    assert any(len(set(line["bandwidth"])) > 1 for line in reshard_costs)
    assert any(line["steps_of_one_optimal_plan"] >= 3 for line in reshard_costs)


def test_the_vendored_copy_is_the_shared_data():
    """tests/conformance is a verbatim copy of ../shared/conformance, for clones without it."""
    from tests.conftest import SHARED_CONFORMANCE, VENDORED_CONFORMANCE

    if not SHARED_CONFORMANCE.is_dir():
        pytest.skip(f"no {SHARED_CONFORMANCE} to compare with; the checks above used the vendored copy")
    for name in ("reshard_costs.jsonl", "README.md"):
        assert (VENDORED_CONFORMANCE / name).read_bytes() == (SHARED_CONFORMANCE / name).read_bytes(), name
