"""The step plan (planner.step): legs, buckets, their sizes and times, checked by hand."""

from __future__ import annotations

import random

import attrs
import pytest

import planner
from planner.legs import AFTER, BEFORE, DEFAULT_BUCKET_BYTES, StepTensor
from planner.step import StepPlan, plan_step
from shardlang import parse_layout
from tests.test_runtime_support import random_layout

DP4 = "mesh[dp=4]"
# Uneven and empty pieces on 4 ranks: 37 rows are 10,10,10,7; 3 rows are 1,1,1,0.
SHAPES = {"w": (37, 24), "b": (24,), "t": (4, 6, 5), "e": (3, 7)}


def L(text: str):
    return parse_layout(text)


def step_tensor(
    name: str, shape: tuple[int, ...], mesh: str, param: str, grad: str, state: str, **options: object
) -> StepTensor:
    """A tensor whose param, grad and state layouts are ``param``, ``grad`` and ``state`` over ``mesh``."""
    return StepTensor(
        name=name,
        shape=shape,
        param=L(f"{param} over {mesh}"),
        grad=L(f"{grad} over {mesh}"),
        state=L(f"{state} over {mesh}"),
        **options,
    )


def zero2(name: str, shape: tuple[int, ...], mesh: str = DP4) -> StepTensor:
    replicated = ",".join("R" for _ in shape)
    rows = ",".join(["S(dp)"] + ["R"] * (len(shape) - 1))
    return step_tensor(name, shape, mesh, replicated, f"{replicated} | P(dp):avg", rows)


def padded_rows_bytes(shape: tuple[int, ...], n: int = 4, itemsize: int = 4) -> int:
    """Bytes one rank sends in a ring reduce_scatter/all_gather of the rows: (n-1) padded blocks."""
    rest = 1
    for length in shape[1:]:
        rest *= length
    return (n - 1) * -(-shape[0] // n) * rest * itemsize


def test_zero2_is_one_reduce_scatter_and_one_all_gather_for_every_tensor() -> None:
    tensors = [zero2(n, s) for n, s in SHAPES.items()]
    step = plan_step(tensors, 0)
    assert [b.describe() for b in step.buckets] == ["reduce_scatter(axis=dp, op=avg) f32", "all_gather(axis=dp) f32"]
    assert [b.stage for b in step.buckets] == [BEFORE, AFTER]
    names = [[step.legs[m.leg].tensor for m in b.members] for b in step.buckets]
    assert names == [list(SHAPES)] * 2  # in the order given
    expected = sum(padded_rows_bytes(s) for s in SHAPES.values())
    assert [b.bytes for b in step.buckets] == [expected, expected]
    # One latency of 3 rounds per bucket instead of one per tensor.
    alpha, bandwidth = planner.DEFAULT_ALPHA, planner.DEFAULT_BANDWIDTH
    assert step.buckets[0].seconds == pytest.approx(3 * alpha + expected / bandwidth)
    assert step.unbucketed_seconds == pytest.approx(2 * (len(SHAPES) * 3 * alpha + expected / bandwidth))
    assert step.collectives == 2 and step.unbucketed_collectives == 2 * len(SHAPES)
    # The buffer is n padded blocks per tensor: 4/3 of what a rank sends.
    assert step.max_buffer_bytes == expected // 3 * 4
    # The parameter's shard is a slice of the replicated parameter: a leg, but no collective.
    fetch = [leg for leg in step.legs if leg.what == "param -> state"]
    assert len(fetch) == len(SHAPES) and not any(leg.communicating for leg in fetch)
    assert step.bucket_bytes == DEFAULT_BUCKET_BYTES


def test_a_bucket_pays_the_executor_overhead_once() -> None:
    # Every plan step pays the cost model's overhead (planner.cost); a bucket is one collective,
    # so it pays one: 3 rounds of 5 us, the bytes at 100 GB/s, plus 40 us.
    cost = planner.CostModel(alpha=5e-6, bandwidth=1e11, overhead=40e-6)
    tensors = [attrs.evolve(zero2(n, s), cost=cost) for n, s in SHAPES.items()]
    step = plan_step(tensors, 0)
    expected = sum(padded_rows_bytes(s) for s in SHAPES.values())
    for bucket in step.buckets:
        assert bucket.seconds == pytest.approx(3 * 5e-6 + expected / 1e11 + 40e-6)
    # Unbucketed, every tensor's reduce_scatter and all_gather pay their own, and so does the
    # slice that fetches each parameter's shard.
    each = 2 * (3 * 5e-6 + 40e-6) + 40e-6
    assert step.unbucketed_seconds == pytest.approx(len(SHAPES) * each + 2 * expected / 1e11)


def test_bucket_bytes_cuts_a_kind_into_buckets_in_order() -> None:
    tensors = [zero2(f"w{i}", (40, 10)) for i in range(5)]  # each a 40*10*4 = 1600-byte buffer
    step = plan_step(tensors, 0, bucket_bytes=3200)
    sizes = [[step.legs[m.leg].tensor for m in b.members] for b in step.stage_buckets(BEFORE)]
    assert sizes == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert all(b.buffer_bytes <= 3200 for b in step.buckets)
    alone = plan_step(tensors, 0, bucket_bytes=1)
    assert alone.collectives == alone.unbucketed_collectives == 10
    assert alone.total_seconds == pytest.approx(alone.unbucketed_seconds)
    with pytest.raises(planner.PlanError, match="bucket_bytes must be at least 1"):
        plan_step(tensors, 0, bucket_bytes=0)


def test_other_dtypes_axes_and_ops_never_share_a_bucket() -> None:
    mesh = "mesh[dp=2, tp=2]"
    a = zero2("a", (8, 4), mesh)
    bf16 = attrs.evolve(zero2("b", (8, 4), mesh), grad_dtype="bf16", param_dtype="bf16")
    summed = attrs.evolve(zero2("c", (8, 4), mesh), grad=L(f"R,R | P(dp) over {mesh}"))
    tp = step_tensor("d", (8, 4), mesh, "R,R", "R,R | P(tp):avg", "R,S(tp)")
    step = plan_step([a, bf16, summed, tp], 0)
    before = [(b.describe(), [step.legs[m.leg].tensor for m in b.members]) for b in step.stage_buckets(BEFORE)]
    assert sorted(before) == [
        ("reduce_scatter(axis=dp, op=avg) bf16", ["b"]),
        ("reduce_scatter(axis=dp, op=avg) f32", ["a"]),
        ("reduce_scatter(axis=dp, op=sum) f32", ["c"]),
        ("reduce_scatter(axis=tp, op=avg) f32", ["d"]),
    ]
    after = [(b.describe(), [step.legs[m.leg].tensor for m in b.members]) for b in step.stage_buckets(AFTER)]
    assert sorted(after) == [
        ("all_gather(axis=dp) bf16", ["b"]),
        ("all_gather(axis=dp) f32", ["a", "c"]),
        ("all_gather(axis=tp) f32", ["d"]),
    ]


def test_flat_sharding_takes_two_hops_sized_by_the_ranks_base_block() -> None:
    # Base block of 'w' under R,S(tp) on [dp=2, tp=2]: 37 x 12 for every rank; flat over dp: 444 each half.
    mesh = "mesh[dp=2, tp=2]"
    w = step_tensor("w", (37, 25), mesh, "R,S(tp)", "R,S(tp) | P(dp):avg", "R,S(tp)", flat_axis=0)
    for rank, columns in ((0, 13), (1, 12)):
        step = plan_step([w], rank)
        grad = step.legs_of("w")[0]
        assert grad.what == "grad -> state" and len(grad.hops) == 2
        assert not grad.hops[0].plan.steps  # the gradient already is the base block, pending over dp
        flat = grad.hops[1]
        assert flat.plan.shape == (37 * columns,) and flat.view == (37 * columns,)
        assert [s.describe() for s in flat.plan.steps] == ["reduce_scatter(axis=dp, dim=0, op=avg)"]
        back = step.legs_of("w")[-1]
        assert back.what == "state -> param" and back.hops[1].view == (37, columns)
        assert [s.describe() for s in back.hops[0].plan.steps] == ["all_gather(axis=dp, dim=0)"]


def test_flat_hops_stay_in_the_ranks_flat_group_where_other_axes_are_faster() -> None:
    # The base blocks of S(tp),R differ across tp. With tp ten times faster than dp, planning the
    # flattened block as replicated over tp takes "slice over tp, all_reduce over dp, all_gather
    # over tp", which mixes the blocks of different tp ranks; it must be one reduce_scatter over
    # dp among the ranks holding this block, and one all_gather back.
    mesh = "mesh[dp=2, tp=4]"
    cost = planner.CostModel(alpha=(20e-6, 3e-6), bandwidth=(25e9, 300e9))
    w = step_tensor("w", (4096, 1024), mesh, "S(tp),R", "S(tp),R | P(dp):avg", "S(tp),R", flat_axis=0, cost=cost)
    for rank in range(8):
        step = plan_step([w], rank)
        grad, back = step.legs_of("w")[0], step.legs_of("w")[-1]
        same_block = {r for r in range(8) if r % 4 == rank % 4}  # rank = 4 * dp + tp
        for flat in (grad.hops[1], back.hops[0]):
            assert set(flat.plan.src.mesh.ranks) == same_block, rank
        assert [s.describe() for s in grad.hops[1].plan.steps] == ["reduce_scatter(axis=dp, dim=0, op=avg)"]
        assert [s.describe() for s in back.hops[0].plan.steps] == ["all_gather(axis=dp, dim=0)"]


def test_own_layout_states_get_a_leg_each_way() -> None:
    t = attrs.evolve(zero2("w", (8, 4)), own_states=(("exp_avg_sq", L("R,S(dp) over mesh[dp=4]")),))
    step = plan_step([t], 0)
    assert [(leg.what, leg.stage, leg.dtype) for leg in step.legs] == [
        ("grad -> state", BEFORE, "f32"),
        ("param -> state", BEFORE, "f32"),
        ("state.exp_avg_sq -> state", BEFORE, "f32"),
        ("state -> param", AFTER, "f32"),
        ("state -> state.exp_avg_sq", AFTER, "f32"),
    ]
    # R,S(dp) -> S(dp),R is one all_to_all; back the same way.
    assert [b.describe() for b in step.buckets] == [
        "reduce_scatter(axis=dp, op=avg) f32",
        "all_to_all(axis=dp) f32",
        "all_gather(axis=dp) f32",
        "all_to_all(axis=dp) f32",
    ]


def test_a_leg_waits_for_its_earlier_steps_and_kinds_with_more_left_go_first() -> None:
    """On [2,2], 'a' reduces over tp and then scatters over dp, 'b' only scatters over dp: the
    schedule runs a's first step alone, then both scatters in one bucket."""
    mesh = "mesh[dp=2, tp=2]"
    a = step_tensor("a", (8, 8), mesh, "S(dp),R", "R,R | P(dp),P(tp)", "S(dp),R")
    b = attrs.evolve(a, name="b", grad=L(f"R,R | P(dp) over {mesh}"))
    step = plan_step([b, a], 0)
    a_ops = [s.op for h in step.legs_of("a")[0].hops for s in h.plan.steps]
    before = [(b.op, [step.legs[m.leg].tensor for m in b.members]) for b in step.stage_buckets(BEFORE)]
    if a_ops == ["all_reduce", "reduce_scatter"]:
        assert before == [("all_reduce", ["a"]), ("reduce_scatter", ["b", "a"])]
    else:  # scatter first (cheaper): both scatter together, then a reduces
        assert a_ops[0] == "reduce_scatter" and before[0] == ("reduce_scatter", ["b", "a"]) and len(before) == 2


@pytest.mark.parametrize("seed", range(6))
def test_schedules_of_random_legs_keep_every_leg_in_order(seed: int) -> None:
    """Every communicating step runs exactly once, in its leg's order, in a bucket of one
    collective kind; buckets respect the cap."""
    rng = random.Random(seed)
    mesh = parse_layout("() over mesh[2,2]").mesh
    tensors = []
    for i in range(10):
        shape = rng.choice([(8, 6), (5, 3), (7,), (4, 4, 2)])
        grad = random_layout(rng, mesh, len(shape))
        state = random_layout(rng, mesh, len(shape))
        state = parse_layout(str(state).split(" | ")[0] + " over mesh[2,2]") if state.partial else state
        param = random_layout(rng, mesh, len(shape))
        param = parse_layout(str(param).split(" | ")[0] + " over mesh[2,2]") if param.partial else param
        tensors.append(StepTensor(name=f"t{i}", shape=shape, param=param, grad=grad, state=state))
    cap = rng.choice([1, 64, 256, None])
    step = plan_step(tensors, 0, bucket_bytes=cap)
    seen: dict[int, list[tuple[int, int]]] = {}
    for bucket in step.buckets:
        kinds = set()
        for m in bucket.members:
            leg = step.legs[m.leg]
            s = leg.hops[m.hop].plan.steps[m.step]
            assert leg.stage == bucket.stage
            kinds.add((s.op, s.axis, s.reduce_op, leg.dtype))
            seen.setdefault(m.leg, []).append((m.hop, m.step))
        assert len(kinds) == 1
        if cap is not None and len(bucket.members) > 1:
            assert bucket.buffer_bytes <= cap
    for index, leg in enumerate(step.legs):
        assert seen.get(index, []) == list(leg.communicating), leg
    assert step.collectives <= step.unbucketed_collectives
    assert step.total_bytes == sum(leg.total_bytes for leg in step.legs)


def test_a_step_plan_survives_json() -> None:
    mesh = "mesh[dp=2, tp=2]"
    tensors = [zero2(n, s, mesh) for n, s in SHAPES.items()]
    tensors.append(attrs.evolve(tensors[0], name="flat", flat_axis=0))
    step = plan_step(tensors, 3)
    again = StepPlan.from_json(step.to_json())
    assert again == step
    with pytest.raises(planner.PlanError, match="not a step plan in JSON form"):
        StepPlan.from_json({"legs": []})


def test_errors_name_the_tensor() -> None:
    with pytest.raises(planner.PlanError, match=r"tensor 'w': .*100"):
        plan_step([zero2("v", (4, 4)), zero2("w", (64, 64))], 0, max_local_bytes=100)


# --- the matrices' part (planner.matrices), numbers worked by hand ---------------------------
def _matrices_zero2() -> list[StepTensor]:
    """The 2-d tensors of tests/golden/cli_step/zero2.shard, under the default cost model
    (5 us a round, 100 GB/s)."""
    mesh = "mesh[dp=2, tp=2]"
    return [
        step_tensor("qkv", (64, 32), mesh, "R,R", "R,R", "S(tp,dp),R"),
        step_tensor("proj", (32, 64), mesh, "R,R", "R,R", "S(dp),S(tp)"),
        step_tensor("head", (40, 16), mesh, "R,R", "R,R", "S(tp,dp),R"),
    ]


def test_gathers_share_one_all_gather_per_axis() -> None:
    """Every piece is a quarter: qkv, proj 16x32 f32 = 2048 B, head 10x16 = 640 B. The gather
    goes one axis at a time: (n-1) b over the first axis (n = 2), then (n-1) 2b over the other;
    one bucket per axis saves 2 latencies each."""
    from planner.matrices import TO, plan_matrices

    plan = plan_matrices(_matrices_zero2(), 0, placement="gather", bucket_bytes=DEFAULT_BUCKET_BYTES)
    assert [m.owner for m in plan.matrices] == [None, None, None]
    assert [(b.stage, b.op, len(b.members)) for b in plan.buckets] == [(TO, "all_gather", 3)] * 2
    assert sorted(b.bytes for b in plan.buckets) == [2048 + 2048 + 640, 2 * (2048 + 2048 + 640)]
    assert (plan.collectives, plan.unbucketed_collectives) == (2, 6)
    assert abs(plan.unbucketed_seconds - plan.comm_seconds - 4 * 5e-6) < 1e-12
    # Every rank computes every matrix: 5 (4 m^2 n + 2 m^3) flops each at 1e11 flop/s.
    flops = 2 * 5 * (4 * 32 * 32 * 64 + 2 * 32**3) + 5 * (4 * 16 * 16 * 40 + 2 * 16**3)
    assert abs(plan.compute_seconds - flops / 1e11) < 1e-15


def test_moves_to_owners_share_one_exchange_each_way() -> None:
    """LPT owners: proj -> 0, qkv -> 1, head -> 2 (largest first, ties by name). Rank 0
    receives 3 x 2048 B, the most any rank sends or receives; back in bf16 the owners send
    3 x 1024 B. A message between the state mesh and a one-rank mesh is priced at the slowest
    figures of the two (planner.p2p): 5 us, 100 GB/s; rank 0 receives from 3 peers."""
    from planner.matrices import BACK, TO, MatrixPlan, plan_matrices

    plan = plan_matrices(_matrices_zero2(), 0, placement="owner", bucket_bytes=DEFAULT_BUCKET_BYTES)
    assert [(m.name, m.owner) for m in plan.matrices] == [("qkv", 1), ("proj", 0), ("head", 2)]
    assert [(b.stage, b.op, len(b.members), b.bytes) for b in plan.buckets] == [
        (TO, "point_to_point", 3, 6144),
        (BACK, "point_to_point", 3, 3072),
    ]
    assert [b.dtype for b in plan.buckets] == ["f32", "bf16"]
    assert abs(plan.buckets[0].seconds - (3 * 5e-6 + 6144 / 100e9)) < 1e-12
    assert (plan.collectives, plan.unbucketed_collectives) == (2, 6)
    # A cap of one byte: every move its own exchange.
    alone = plan_matrices(_matrices_zero2(), 0, placement="owner", bucket_bytes=1)
    assert alone.collectives == 6 and alone.total_bytes > plan.total_bytes
    # Carried by the step plan, through JSON.
    step = attrs.evolve(plan_step(_matrices_zero2(), 0), matrices=plan)
    assert StepPlan.from_json(step.to_json()) == step
    assert MatrixPlan.from_json(plan.to_json()) == plan


def test_the_flop_rate_comes_from_the_cost_model_unless_given() -> None:
    """A hints file's flops_per_second prices the iterations (compute = flops / rate); an
    explicit rate wins; without either, the stated default."""
    from planner.cost import CostModel
    from planner.matrices import plan_matrices
    from planner.owners import DEFAULT_FLOPS_PER_SECOND

    measured = CostModel.from_json({"alpha": 5e-6, "flops_per_second": 2.5e9})
    assert measured.flops_per_second == 2.5e9
    assert CostModel.from_json(measured.to_json()) == measured
    with pytest.raises(planner.PlanError, match="flops_per_second"):
        CostModel.from_json({"flops_per_second": -1})
    tensors = [attrs.evolve(t, cost=measured) for t in _matrices_zero2()]
    flops = 5 * (4 * 32 * 32 * 64 + 2 * 32**3)  # qkv
    rates = [
        plan_matrices(tensors, 0, bucket_bytes=DEFAULT_BUCKET_BYTES).flops_per_second,
        plan_matrices(tensors, 0, bucket_bytes=DEFAULT_BUCKET_BYTES, flops_per_second=1e12).flops_per_second,
        plan_matrices(_matrices_zero2(), 0, bucket_bytes=DEFAULT_BUCKET_BYTES).flops_per_second,
    ]
    assert rates == [2.5e9, 1e12, DEFAULT_FLOPS_PER_SECOND]
    slow = plan_matrices(tensors, 0, bucket_bytes=DEFAULT_BUCKET_BYTES)
    assert abs(slow.of("qkv").compute_seconds - flops / 2.5e9) < 1e-15


def _reference_rounds(legs: tuple, stage: str) -> list[list[tuple[int, int, int]]]:
    """The weighted majority merge (planner.legs' module doc) of one mesh's legs, chain by
    chain: each round takes the kind whose waiting chains have the most steps left (ties: the
    kind met first), every chain waiting on it moving on; members as (leg, hop, step)."""
    chains = [(i, leg.communicating) for i, leg in enumerate(legs) if leg.stage == stage and leg.communicating]

    def kind(i: int, where: tuple[int, int]) -> tuple:
        step = legs[i].hops[where[0]].plan.steps[where[1]]
        return step.op, step.axis, step.reduce_op, legs[i].dtype

    position = [0] * len(chains)
    rounds = []
    order: dict[tuple, int] = {}
    while True:
        waiting: dict[tuple, list[int]] = {}
        weight: dict[tuple, int] = {}
        for c, (i, steps) in enumerate(chains):
            if position[c] < len(steps):
                k = kind(i, steps[position[c]])
                order.setdefault(k, len(order))
                waiting.setdefault(k, []).append(c)
                weight[k] = weight.get(k, 0) + len(steps) - position[c]
        if not waiting:
            return rounds
        chosen = max(waiting, key=lambda k: (weight[k], -order[k]))
        rounds.append([(chains[c][0], *chains[c][1][position[c]]) for c in waiting[chosen]])
        for c in waiting[chosen]:
            position[c] += 1


@pytest.mark.parametrize("seed", range(12))
def test_buckets_follow_the_weighted_majority_merge_chain_by_chain(seed: int) -> None:
    """Tensors of a few layouts repeated and interleaved (the merge runs alike legs as one
    class): with no cap to cut them, each bucket is one round of the merge done chain by chain."""
    rng = random.Random(seed)
    mesh = L("R over mesh[a=2,b=2,c=2]").mesh
    kinds = []
    for _ in range(3):
        param, grad, state = (random_layout(rng, mesh, 2) for _ in range(3))
        grad = attrs.evolve(grad, partial=tuple((a, "sum") for a, _ in grad.partial))
        kinds.append((param, grad, state))
    tensors = []
    for n in range(14):
        param, grad, state = rng.choice(kinds)
        tensors.append(StepTensor(name=f"t{n}", shape=(8, 6), param=param, grad=grad, state=state))
    step = plan_step(tensors, 0, bucket_bytes=2**40)
    for stage in (BEFORE, AFTER):
        got = [[(m.leg, m.hop, m.step) for m in b.members] for b in step.buckets if b.stage == stage]
        assert got == _reference_rounds(step.legs, stage)
