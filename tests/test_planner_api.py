"""The planner's interface: memory bounds, JSON, determinism, errors and whole-model planning."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest

import planner
from planner import search
from planner.spec_plan import plan_spec
from shardlang import Layout, Mesh, ShardlangError, parse_layout, parse_spec
from tests.conftest import REPO
from tests.test_planner_budget import Searches
from tests.test_planner_optimal import ITEMSIZE, random_case

MESH = "mesh[2,4]"


def L(text: str) -> Layout:
    return parse_layout(text)


# --- max_local_bytes --------------------------------------------------------------------
def test_memory_bound_keeps_every_state_under_it():
    rng = random.Random(5)
    detours = 0
    for _ in range(300):
        src, dst, shape, dtype, cost = random_case(rng, naxes=rng.randint(2, 3))
        free = planner.plan(src, dst, shape, dtype, cost)
        ends = max(math.prod(x.local_shape(shape)) for x in (src, dst)) * ITEMSIZE[dtype]
        try:
            bounded = planner.plan(src, dst, shape, dtype, cost, max_local_bytes=ends)
        except planner.PlanError as e:
            assert "no plan takes" in e.message and "max_local_bytes" in e.message
            continue
        assert all(math.prod(x.local_shape(shape)) * ITEMSIZE[dtype] <= ends for x in bounded.layouts())
        assert bounded.total_seconds >= free.total_seconds * (1 - 1e-12)
        detours += bounded.steps != free.steps
    assert detours > 0  # the bound changed some plans (the brute-force tests check they are the cheapest)


def test_memory_bound_errors_name_the_layouts_and_the_reason():
    with pytest.raises(planner.PlanError, match=r"S0 over mesh\[4\] -> R over mesh\[4\]: the target holds 256 bytes"):
        planner.plan(L("S0 over mesh[4]"), L("R over mesh[4]"), (64,), max_local_bytes=128)
    with pytest.raises(planner.PlanError, match="the source holds 256 bytes per rank, more than max_local_bytes=100"):
        planner.plan(L("R over mesh[4]"), L("S0 over mesh[4]"), (64,), max_local_bytes=100)
    # Both ends fit, but every path passes through a bigger state: 8x16 S01 -> S10 must gather.
    with pytest.raises(
        planner.PlanError, match=r"no plan takes S01,R over mesh\[2,2\] to S10,R .* within max_local_bytes=128"
    ):
        planner.plan(L("S01,R over mesh[2,2]"), L("S10,R over mesh[2,2]"), (8, 16), max_local_bytes=128)
    for bad in (-1, 1.5, "1000", True):
        with pytest.raises(planner.PlanError, match="max_local_bytes must be a byte count"):
            planner.plan(L("S0 over mesh[4]"), L("R over mesh[4]"), (64,), max_local_bytes=bad)


# --- JSON ---------------------------------------------------------------------------------
ISSUE_KEYS = ["src", "dst", "shape", "dtype", "steps", "total_bytes", "total_seconds"]
STEP_KEYS = ["op", "axis", "dim", "to_dim", "reduce_op", "layout", "bytes", "seconds"]


def test_json_has_the_issue_schema():
    got = planner.plan(L("R | P01 over mesh[2,8]"), L("R over mesh[2,8]"), (1 << 20,), "f32",
                       planner.CostModel(bandwidth=(25e9, 300e9)))  # fmt: skip
    data = json.loads(json.dumps(got.to_json()))
    assert list(data)[: len(ISSUE_KEYS)] == ISSUE_KEYS
    # the model the seconds come from, and the receive lower bound (point-to-point issue)
    assert set(data) - set(ISSUE_KEYS) == {"cost", "lower_bound_bytes"}
    assert data["src"] == "R | P01 over mesh[2,8]" and data["dst"] == "R over mesh[2,8]"
    assert data["shape"] == [1 << 20] and data["dtype"] == "f32"
    assert data["cost"] == {"alpha": 5e-6, "bandwidth": [25e9, 300e9]}
    assert [list(s) for s in data["steps"]] == [STEP_KEYS] * 3
    rs, ar, ag = data["steps"]
    assert rs == {"op": "reduce_scatter", "axis": 1, "dim": 0, "to_dim": None, "reduce_op": "sum",
                  "layout": "S1 | P0 over mesh[2,8]", "bytes": 7 * (1 << 17) * 4,
                  "seconds": pytest.approx(7 * 5e-6 + 7 * (1 << 17) * 4 / 300e9)}  # fmt: skip
    assert ar["dim"] is None and ar["to_dim"] is None and ar["reduce_op"] == "sum"
    assert ag["reduce_op"] is None and ag["layout"] == "R over mesh[2,8]"
    assert data["total_bytes"] == sum(s["bytes"] for s in data["steps"])
    assert data["total_seconds"] == pytest.approx(sum(s["seconds"] for s in data["steps"]))
    a2a = planner.plan(L("S0,R over mesh[4]"), L("R,S0 over mesh[4]"), (8, 8)).to_json()["steps"][0]
    assert (a2a["op"], a2a["dim"], a2a["to_dim"], a2a["reduce_op"]) == ("all_to_all", 0, 1, None)


def test_json_round_trips_including_declared_meshes_and_cost_models():
    rng = random.Random(3)
    plans = [planner.plan(*random_case(rng, naxes=rng.randint(1, 3))) for _ in range(100)]
    spec = parse_spec(
        """mesh world = [dp=2, tp=4]
        tensor w : f32[10, 7] {
          param = R,S(tp) over world  grad = R,S(tp) | P(dp):avg over world  state = S(dp),S(tp) over world
        }"""
    )
    t = spec.tensors[0]
    plans.append(planner.plan(t.grad, t.state(), t.shape, "bf16", planner.CostModel(alpha=(1e-5, 2e-6))))
    assert plans[-1].to_json()["meshes"] == {"world": "mesh world = [dp=2,tp=4]"}
    assert plans[-1].to_json()["src"] == "R,S(tp) | P(dp):avg over world"
    for p in plans:
        text = json.dumps(p.to_json())
        back = planner.Plan.from_json(json.loads(text))
        assert back == p and json.dumps(back.to_json()) == text


ONE_STEP = {"src": "S0 over mesh[2]", "dst": "R over mesh[2]", "shape": [4], "dtype": "f32", "steps": []}


@pytest.mark.parametrize(
    "data, message",
    [
        ({}, "KeyError: 'steps'"),
        ({**ONE_STEP, "steps": [{"op": "teleport"}]}, "unknown op 'teleport'"),
        ({**ONE_STEP, "src": "S5 over mesh[2]"}, "mesh axis 5 is out of range"),
        ({**ONE_STEP, "cost": {"alpha": -1}}, "latency"),
        ({**ONE_STEP, "steps": [{"op": "all_gather", "axis": "x"}]}, "ValueError"),
    ],
)
def test_bad_json_is_a_plan_error(data, message):
    with pytest.raises(planner.PlanError, match=message):
        planner.Plan.from_json(data)


# --- determinism ------------------------------------------------------------------------
_DETERMINISM_SCRIPT = """
import json, random, sys
sys.path.insert(0, {repo!r})
import planner
from shardlang import parse_layout as L
from tests.test_planner_optimal import random_case
rng = random.Random(21)
cases = [random_case(rng, naxes=rng.randint(1, 4), sizes=(1, 2, 2, 4)) for _ in range(150)]
plans = [planner.plan(*c) for c in cases]
# Point-to-point and mixed plans: cross-mesh pairs, and a same-mesh pair with the flag.
pairs = [('R,R | P01 over mesh[2,2]', 'S0,R over mesh[3] ranks [5,1,2]', False),
         ('S0,R over mesh[8,8]', 'S1,R over mesh[8,8]', True),
         ('R,S0 over mesh[2,4]', 'S01,R over mesh[4,2] ranks [7,6,5,4,3,2,1,0]', False)]
plans += [planner.plan(L(a), L(b), (37, 100), point_to_point=f) for a, b, f in pairs]
print(json.dumps([p.to_json() for p in plans]))
"""


def test_plans_are_deterministic_across_processes_and_hash_seeds():
    """Equal inputs give the same plan, also among equal-cost alternatives and the senders of
    point-to-point steps, whatever the process's hash seed (string hashing changes set and
    dict orders)."""
    script = _DETERMINISM_SCRIPT.format(repo=str(REPO))
    outputs = set()
    for seed in ("1", "2", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        outputs.add(done.stdout)
    assert len(outputs) == 1


def test_planning_again_cold_gives_the_same_plan():
    src, dst = L("R,R | P0:avg,P1 over mesh[2,4]"), L("S1,S0 over mesh[2,4]")
    first = planner.plan(src, dst, (37, 24), "bf16")
    search._plan_cached.cache_clear()
    again = planner.plan(parse_layout(str(src)), parse_layout(str(dst)), [37, 24], "bf16")
    assert again == first and again is not first


# --- errors -------------------------------------------------------------------------------
def test_collective_searches_refuse_layouts_on_different_meshes():
    def collective(src: str, dst: str) -> None:
        search.collective_outcome(search.checked(L(src), L(dst), (8,), "f32", None, None))

    with pytest.raises(planner.PlanError, match=r"different meshes \(mesh\[2,2\] and mesh\[4\]\)"):
        collective("S0 over mesh[2,2]", "S0 over mesh[4]")
    with pytest.raises(planner.PlanError, match=r"mesh\[2\] ranks \[1,0\]"):
        collective("S0 over mesh[2]", "R over mesh[2] ranks [1,0]")


def test_a_layout_of_another_rank_than_the_shape_is_refused():
    with pytest.raises(
        planner.PlanError, match=r"cannot plan S0,R over mesh\[2\] -> R,R over mesh\[2\]: .*2-d .*\[8\]"
    ):
        planner.plan(L("S0,R over mesh[2]"), L("R,R over mesh[2]"), (8,))
    with pytest.raises(planner.PlanError, match="negative"):
        planner.plan(L("S0 over mesh[2]"), L("R over mesh[2]"), (-3,))
    for shape in (("eight",), None, 8):
        with pytest.raises(planner.PlanError, match="is not a sequence of lengths"):
            planner.plan(L("S0 over mesh[2]"), L("R over mesh[2]"), shape)  # type: ignore[arg-type]


def test_an_unknown_dtype_is_refused():
    with pytest.raises(planner.PlanError, match=r"cannot plan .*: unknown dtype 'f33' \(expected one of f64, f32"):
        planner.plan(L("S0 over mesh[2]"), L("R over mesh[2]"), (8,), "f33")


@pytest.mark.parametrize(
    "cost, message",
    [
        (dict(bandwidth=(1e11, 1e11, 1e11)), r"bandwidth gives 3 values for the 2-axis mesh\[2,4\]"),
        (dict(alpha=(5e-6,)), r"latency gives 1 values for the 2-axis mesh\[2,4\]"),
    ],
)
def test_cost_models_of_the_wrong_length_are_refused(cost, message):
    with pytest.raises(planner.PlanError, match=r"cannot plan S0 over mesh\[2,4\] -> R over mesh\[2,4\]: " + message):
        planner.plan(L(f"S0 over {MESH}"), L(f"R over {MESH}"), (8,), "f32", planner.CostModel(**cost))


@pytest.mark.parametrize(
    "cost, message",
    [
        (dict(bandwidth=0), "bandwidth must be finite and positive"),
        (dict(bandwidth=(1e11, float("inf"))), "bandwidth must be finite and positive"),
        (dict(alpha=-1e-6), "latency .* must be finite and zero or positive"),
        (dict(alpha=float("nan")), "latency .* must be finite and zero or positive"),
        (dict(bandwidth=()), "bandwidth must be finite and positive"),
        (dict(alpha="fast"), "is a number or one number per mesh axis, not 'fast'"),
        (dict(bandwidth=None), "is a number or one number per mesh axis, not None"),
        (dict(bandwidth=(1e9, "x")), r"not \(1000000000.0, 'x'\)"),
    ],
)
def test_bad_cost_numbers_are_refused(cost, message):
    with pytest.raises(planner.PlanError, match=message):
        planner.CostModel(**cost)


# --- whole-model planning -----------------------------------------------------------------
SPEC = """
mesh world = [dp=2, tp=2]  bandwidth [25e9, 300e9]  latency [10us, 2us]

tensor emb : f32[32000, 1024] {
  param = R,S(tp) over world
  grad  = R,S(tp) | P(dp) over world
  state = S(dp),S(tp) over world
}
tensor h.{0..2}.w : bf16[37, 24] {
  param = S(tp),R over world
  grad  = S(tp),R | P(dp):avg over world
  state = S(tp,dp),R over world
  state.exp_avg_sq = S(tp),S(dp) over world
}
tensor norm : f32[24] {
  param = R over world
  grad  = R | P(dp):avg over world
  state = R over world
}
"""


def test_spec_planning_gives_each_tensor_its_legs_and_totals():
    spec = parse_spec(SPEC, "model.shard")
    result = plan_spec(spec)
    assert [t.tensor.name for t in result.tensors] == ["emb", "h.0.w", "h.1.w", "h.2.w", "norm"]
    emb, h0, *_, norm = result.tensors
    cost = planner.CostModel(alpha=(10e-6, 2e-6), bandwidth=(25e9, 300e9))
    # The Paddle seed's embedding: one reduce_scatter, one all_gather (over dp: 32000/2 x 1024/2 f32).
    assert [s.describe() for s in emb.plan_of("grad -> state").steps] == ["reduce_scatter(axis=dp, dim=0, op=sum)"]
    assert [s.describe() for s in emb.plan_of("state -> param").steps] == ["all_gather(axis=dp, dim=0)"]
    assert emb.plan_of("grad -> state").total_bytes == 16000 * 512 * 4
    assert (
        emb.cost == cost
        and emb.plan_of("grad -> state").cost == cost
        and emb.plan_of("grad -> state").total_seconds == pytest.approx(10e-6 + 16000 * 512 * 4 / 25e9)
    )
    # The state override gets its own legs to and from the default state layout; a bf16
    # parameter keeps an f32 master, so its shard is not fetched (an f32 one's is, by a slice).
    assert [label for label, _ in h0.plans()] == [
        "grad -> state",
        "state.exp_avg_sq -> state",
        "state -> param",
        "state -> state.exp_avg_sq",
    ]
    assert [s.op for s in emb.plan_of("param -> state").steps] == ["slice"]
    for label, p in h0.plans():
        dtype = "f32" if label.startswith("state.") or label.startswith("state -> state.") else "bf16"
        assert p == planner.plan(p.src, p.dst, (37, 24), dtype, cost), label
    assert [s.op for s in norm.plan_of("grad -> state").steps] == ["all_reduce"] and not norm.plan_of(
        "state -> param"
    ).steps
    assert h0.total_bytes == sum(p.total_bytes for _, p in h0.plans())
    assert result.total_bytes == sum(t.total_bytes for t in result.tensors)
    # Buckets share latency: the step's time is below the tensors' plans on their own.
    assert result.step.unbucketed_seconds == pytest.approx(sum(t.total_seconds for t in result.tensors))
    assert result.total_seconds < result.step.unbucketed_seconds
    only = plan_spec(spec, tensors=["norm"], bandwidth=1e9)
    assert [t.tensor.name for t in only.tensors] == ["norm"]
    assert only.tensors[0].cost == planner.CostModel(alpha=(10e-6, 2e-6), bandwidth=1e9)


def test_identical_tensors_are_searched_once(monkeypatch):
    searches = []
    real = search._astar
    monkeypatch.setattr(search, "_astar", lambda *a: searches.append(a[4:6]) or real(*a))
    search._plan_cached.cache_clear()
    plan_spec(parse_spec(SPEC))
    # emb: 3 legs (param -> state a slice); h.0-2.w: 4 legs shared by the three; norm: 1 searched
    # leg (param -> state and state -> param are empty).
    assert len(searches) == 3 + 4 + 1
    plan_spec(parse_spec(SPEC))
    assert len(searches) == 8


def test_spec_planning_errors_name_the_tensor():
    spec = parse_spec(SPEC, "model.shard")
    with pytest.raises(planner.PlanError) as info:
        plan_spec(spec, max_local_bytes=10_000)
    assert info.value.message.startswith("tensor 'emb': ")
    assert "model.shard:4:" in str(info.value)  # points at the declaration
    with pytest.raises(planner.PlanError, match=r"tensor 'emb': .*bandwidth gives 3 values"):
        plan_spec(spec, bandwidth=(1e9, 1e9, 1e9))
    with pytest.raises(ShardlangError, match="no tensor named 'nope'"):
        plan_spec(spec, tensors=["nope"])


def test_whole_llama_example_plans_cold_in_a_tenth_of_one_budget(monkeypatch):
    """All of its searches together generate fewer states than a tenth of what one request may
    (planner.search: states bound the time on any machine; the seconds are timed by
    bench/bench_planner_speed.py, goal under 1 s)."""
    path = REPO / "examples" / "llama7b_dp4_tp8.shard"
    spec = parse_spec(path.read_text(), str(path))
    searches = Searches(monkeypatch)
    result = plan_spec(spec)
    assert len(result.tensors) > 200 and result.total_bytes > 0
    assert 0 < sum(searches.states) < planner.DEFAULT_MAX_STATES // 10, sum(searches.states)


def test_equal_requests_share_one_memo_entry():
    """Requests compare by value: equal layouts built differently find the same memoized plan."""
    a = planner.plan(L("S0 over mesh[4]"), L("R over mesh[4]"), (5,))
    b = planner.plan(Layout(((0,),), Mesh((4,))), Layout(((),), Mesh((4,))), [5])
    assert a is b
