"""Local copies in the cost model (``planner.cost``'s copy table): the table is what the
runtime's moves copy, the planner is optimal when they are priced (against the brute force of
tests/test_planner_optimal.py, which reads the table its own way), and a priced copy turns the
planner away from a collective of a dimension that is not the first."""

from __future__ import annotations

import json
import math
import random

import attrs
import pytest
import torch

import planner
from cli.main import main
from planner.copies import exchange_copy_elements
from planner.cost import LOCAL_OPS
from planner.fit import LOCAL, Sample, fit_model
from runtime.comm.exchange import compile_exchange
from runtime.execution.program import CollectiveMove, compile_plan
from runtime.measure.calibrate import SWEEP_BYTES, sample_bytes, step_plans
from shardlang import Mesh, parse_layout
from tests.overhead_reference import ReferenceWithOverhead, assert_brute_force_optimal
from tests.test_planner_optimal import OPS, calibrated_looking, random_case, random_layout, reference_for


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def runtime_copied(plan: planner.Plan, index: int) -> int:
    """The most bytes a rank of step ``index``'s group at coordinate 0 (of the other axes)
    copies in ``CollectiveMove.send`` and ``finish``, from a contiguous piece: every element of
    a send buffer that is not a view of the piece, and of a result that is not a view of what
    the collective received."""
    step = plan.steps[index]
    mesh = step.layout.mesh
    most = 0
    for rank in mesh.ranks:
        if any(c for a, c in enumerate(mesh.coordinate(rank)) if a != step.axis):
            continue
        move = compile_plan(plan, rank)[index]
        assert isinstance(move, CollectiveMove)
        if move.is_local:
            continue
        piece = torch.zeros(move.before)
        sent = move.send(piece, writable=True)
        received = torch.zeros(move.n * move.chunk if step.op in ("all_gather", "all_to_all") else move.chunk)
        result = move.finish(received)
        assert tuple(result.shape) == move.after
        copied = (0 if _shares(sent, piece) else sent.numel()) + (0 if _shares(result, received) else result.numel())
        most = max(most, copied * 4)
    return most


def test_the_copy_table_is_what_the_runtime_copies():
    """Every collective step of random plans (uneven pieces, dims that lead and dims that do
    not, axes of 2-4 ranks nested on one dim): the bytes ``Plan.copied_bytes`` gives are what
    the executor's moves copy, from a contiguous piece."""
    rng = random.Random(5)
    seen: set[tuple[str, bool]] = set()
    for _ in range(300):
        mesh = Mesh(rng.choice(((2,), (3,), (4,), (2, 2), (2, 3), (4, 2))))
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice((0, 1, 2, 3, 5, 8, 12, 37)) for _ in range(ndim))
        src = random_layout(rng, mesh, ndim, OPS if rng.random() < 0.5 else ())
        dst = random_layout(rng, mesh, ndim, ())
        cost = planner.CostModel(ops={"all_to_all": {"alpha": 1e-6, "bandwidth": 1e12}}) if rng.random() < 0.3 else None
        plan = planner.plan(src, dst, shape, "f32", cost)
        for index, (step, copied) in enumerate(zip(plan.steps, plan.copied_bytes(), strict=True)):
            if step.op in LOCAL_OPS:
                assert copied == 0
                continue
            assert copied == runtime_copied(plan, index), f"{src} -> {dst} {shape}: step {index + 1} {step.describe()}"
            seen.add((step.op, copied > 0))
    kinds = ("all_gather", "reduce_scatter", "all_to_all")
    assert {(op, c) for op in kinds for c in (False, True)} <= seen, seen
    assert ("all_reduce", False) in seen


def exchange_copied(plan: planner.Plan, index: int) -> dict[int, int]:
    """Per rank, the elements the point-to-point step ``index`` copies in ``RankExchange.pack``,
    ``place`` and ``copy_local`` from a contiguous piece: every message that is not a view of
    the piece, every received buffer that is not a view of the output, every kept box."""
    step = plan.steps[index]
    before = plan.layouts()[index]
    copied = {}
    for rank in sorted({*before.mesh.ranks, *step.layout.mesh.ranks}):
        move = compile_exchange(plan, index, rank)
        piece = torch.zeros(before.rank_piece(plan.shape, rank).shape) if rank in before.mesh.ranks else None
        out = None if move.after is None else torch.zeros(move.after)
        count = sum(m.numel() for _, m in move.pack(piece) if not _shares(m, piece)) if move.sends else 0
        if move.receives:
            count += sum(buffer.numel() for _, buffer, in_place in move.receive_buffers(out) if not in_place)
        count += sum(source.numel for source, _ in move.copies)
        if count:
            copied[rank] = count
    return copied


def test_the_exchange_copies_are_what_the_runtime_copies():
    """Point-to-point steps of random pairs, on one mesh and across meshes (other shapes, other
    ranks, overlapping or not): ``planner.copies.exchange_copy_elements`` (what the model prices,
    and ``Plan.copied_bytes`` reports) is, rank by rank, what the runtime's exchange copies."""
    rng = random.Random(11)
    meshes = (Mesh((4,)), Mesh((2, 2)), Mesh((2, 2), ranks=(2, 0, 3, 1)), Mesh((2,), ranks=(4, 5)), Mesh((3,)))
    seen = set()
    for _ in range(150):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice((0, 1, 2, 3, 5, 8, 12)) for _ in range(ndim))
        src_mesh, dst_mesh = rng.choice(meshes), rng.choice(meshes)
        src, dst = random_layout(rng, src_mesh, ndim, ()), random_layout(rng, dst_mesh, ndim, ())
        plan = planner.point_to_point_plan(src, dst, shape, "f32")
        (step,) = plan.steps
        source = {r: src.rank_piece(shape, r) for r in src.mesh.ranks}
        target = {r: dst.rank_piece(shape, r) for r in dst.mesh.ranks}
        transfers = ((t.src_rank, t.dst_rank, t.box) for t in step.transfers)
        table = exchange_copy_elements(transfers, source.__getitem__, target.__getitem__)
        table = {rank: count for rank, count in table.items() if count}
        assert table == exchange_copied(plan, 0), f"{src} -> {dst} {shape}"
        assert plan.copied_bytes() == (max(table.values(), default=0) * 4,)
        seen.add(bool(table))
    assert seen == {False, True}


def test_a_priced_exchange_pays_its_busiest_rank_copies():
    """``S0,R -> R,S0`` of 64x64 on [4] by messages, copies at 1 GB/s: each rank keeps a 16x16
    block (copied), packs three 16x16 blocks of its rows (not runs of them) and receives three
    into its columns in place (runs of them): 4 x 1 KiB copied, priced in the step's time."""
    src, dst = parse_layout("S0,R over mesh[4]"), parse_layout("R,S0 over mesh[4]")
    free = planner.CostModel(alpha=1e-5, bandwidth=1e9)
    priced = attrs.evolve(free, copy_bandwidth=1e9)
    (plain,) = planner.point_to_point_plan(src, dst, (64, 64), "f32", free).steps
    plan = planner.point_to_point_plan(src, dst, (64, 64), "f32", priced)
    assert plan.copied_bytes() == (4 * 16 * 16 * 4,)
    assert plan.steps[0].seconds == pytest.approx(plain.seconds + 4 * 16 * 16 * 4 / 1e9)


@pytest.mark.parametrize("seed", range(2))
def test_plans_are_optimal_with_priced_copies(seed):
    """The brute force, every collective also paying its copies at a copy bandwidth as slow as
    the collectives' (so that copies decide between plans), and every step an overhead: the
    planner (its bound, its pruning rules with copies priced) finds its optimum. Some plans
    differ from those of the same model with free copies, so the prices matter."""
    rng = random.Random(900 + seed)
    differ = 0
    for _ in range(200):
        src, dst, shape, dtype, _ = random_case(rng, naxes=rng.choice((1, 2, 2, 3)))
        free = attrs.evolve(calibrated_looking(rng, src.mesh.ndim), overhead=rng.choice((0.0, 1e-6, 3e-5)))
        cost = attrs.evolve(free, copy_bandwidth=float(f"{math.exp(rng.uniform(math.log(1e8), math.log(1e10))):.2e}"))
        ref = ReferenceWithOverhead(reference_for(src, dst, shape, dtype, cost), cost.overhead)
        got = planner.plan(src, dst, shape, dtype, cost)
        if all(s.op in LOCAL_OPS for s in got.steps):
            continue  # the copy of a plan that sends nothing is priced outside the search (planner.cost)
        assert_brute_force_optimal(ref, got, cost)
        differ += got.steps != planner.plan(src, dst, shape, dtype, free).steps
    assert differ >= 5


def test_a_priced_copy_keeps_the_all_reduce_of_rows_that_do_not_split():
    """``R,R | P0 -> R,R`` of 765x1024 f32 on [4], where the calibrated model once chose a
    reduce_scatter and an all_gather of dim 1, measured 1.61x slower than one all_reduce. By
    hand, with 10 us per round, 1.25 GB/s for the reduce_scatter and all_gather, 1 GB/s for the
    all_reduce, 100 us per step:

    - all_reduce: 6 rounds, 2 * 3 * (765 * 1024 / 4) * 4 = 4,700,160 bytes: 4.86016 ms;
    - reduce_scatter + all_gather of dim 1: 3 + 3 rounds, 2 * 3 * 765 * 256 * 4 = 4,700,160
      bytes: 4.020128 ms, and they copy 4 * 765 * 256 * 4 = 3,133,440 bytes each (every row's
      column blocks are apart);
    - of dim 0 (765 rows pad to 768): 2 * 3 * 192 * 1024 * 4 = 4,718,592 bytes: 4.0348736 ms,
      copying 768 * 1024 * 4 = 3,145,728 bytes to pack the padded blocks and 192 * 1024 * 4 =
      786,432 for the short last piece.

    Free copies: the pair of dim 1 is cheapest. At 2 GB/s they add 3.13344 ms to it, 1.96608
    ms to the pair of dim 0, nothing to the all_reduce, which is then cheapest."""
    src, dst = parse_layout("R,R | P0 over mesh[4]"), parse_layout("R,R over mesh[4]")
    free = planner.CostModel(
        alpha=1e-5, bandwidth=1.25e9, ops={"all_reduce": {"alpha": 1e-5, "bandwidth": 1e9}}, overhead=1e-4
    )
    chosen = planner.plan(src, dst, (765, 1024), "f32", free)
    assert [(s.op, s.dim) for s in chosen.steps] == [("reduce_scatter", 1), ("all_gather", 1)]
    assert chosen.total_seconds == pytest.approx(4.020128e-3, rel=1e-12)
    assert chosen.copied_bytes() == (3_133_440, 3_133_440)
    priced = attrs.evolve(free, copy_bandwidth=2e9)
    chosen = planner.plan(src, dst, (765, 1024), "f32", priced)
    assert [s.op for s in chosen.steps] == ["all_reduce"]
    assert chosen.total_seconds == pytest.approx(4.86016e-3, rel=1e-12)
    # The others' steps, priced, include their copies: 130 us of rounds and overhead, the
    # bytes at 1.25 GB/s, the copies at 2 GB/s.
    legs = {
        ("R,R | P0", "R,S0"): 1.3e-4 + 2_350_080 / 1.25e9 + 3_133_440 / 2e9,
        ("R,S0", "R,R"): 1.3e-4 + 2_350_080 / 1.25e9 + 3_133_440 / 2e9,
        ("R,R | P0", "S0,R"): 1.3e-4 + 2_359_296 / 1.25e9 + 3_145_728 / 2e9,
        ("S0,R", "R,R"): 1.3e-4 + 2_359_296 / 1.25e9 + 786_432 / 2e9,
    }
    for (a, b), seconds in legs.items():
        (step,) = planner.plan(
            parse_layout(f"{a} over mesh[4]"), parse_layout(f"{b} over mesh[4]"), (765, 1024), "f32", priced
        ).steps
        assert step.seconds == pytest.approx(seconds, rel=1e-12), (a, b)


def test_the_fit_takes_a_steps_copies_out_of_its_line():
    """The calibration's all_to_all (``S0,R -> R,S0``) packs dim 1 of its piece, a copy the
    model prices apart: synthetic timings that include it at the slices' copy bandwidth give
    back the all_to_all's own bandwidth, and its one-step plan's prediction (line plus copy) is
    the sample; fitted with the copy in its line, the bandwidth would read 30% low."""
    mesh = Mesh((4,))
    overhead, copy_bandwidth = 1e-4, 2.5e9
    truth = {"all_gather": (2e-5, 1e9), "all_to_all": (3e-5, 8e8)}
    samples, plans = [], []
    for size in SWEEP_BYTES:
        step = step_plans(mesh, 0, size)
        target = sample_bytes(LOCAL, step[LOCAL])
        samples.append(Sample(LOCAL, 0, 0, target, overhead + target / copy_bandwidth))
        for op, (alpha, bandwidth) in truth.items():
            (moved,) = step[op].steps
            copied = step[op].copied_bytes()[0]
            # the whole piece: an all_to_all sends (n-1)/n of it
            assert copied == (moved.bytes * 4 // 3 if op == "all_to_all" else 0)
            seconds = overhead + 3 * alpha + moved.bytes / bandwidth + copied / copy_bandwidth
            samples.append(Sample(op, 0, 3, moved.bytes, seconds, copied))
        plans.append((step["all_to_all"], samples[-1].seconds))
    model, _ = fit_model(samples)
    assert model.copy_bandwidth == pytest.approx(copy_bandwidth, rel=1e-3)
    alphas, bandwidths = model.for_op("all_to_all", mesh)
    assert (alphas[0], bandwidths[0]) == (pytest.approx(3e-5, rel=1e-2), pytest.approx(8e8, rel=1e-2))
    for plan, measured in plans:
        (step,) = planner.plan(plan.src, plan.dst, plan.shape, plan.dtype, model).steps
        assert step.seconds == pytest.approx(measured, rel=1e-2)
    unpriced, _ = fit_model([attrs.evolve(s, copied=0) for s in samples])
    assert unpriced.for_op("all_to_all", mesh)[1][0] < 0.75 * 8e8


def test_the_plan_text_shows_the_copies_in_the_steps_times(tmp_path, capsys):
    """``shardlang plan --costs`` of an all_gather of dim 1 (765 rows before it): the step's time
    is 130 us of rounds and overhead, 3 * 765 * 256 * 4 bytes at 1.25 GB/s and its unpack of
    765 * 1024 * 4 bytes at 2 GB/s, 3.58 ms, and a line under the table names the copy; with
    free copies (the default model) there is no such line."""
    hints = tmp_path / "hints.json"
    hints.write_text(json.dumps({"alpha": 1e-5, "bandwidth": 1.25e9, "overhead": 1e-4, "copy_bandwidth": 2e9}))
    args = ["plan", "R,S0 over mesh[4]", "R,R over mesh[4]", "--shape", "765,1024"]
    assert main([*args, "--costs", str(hints)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].endswith("2.24 MiB  3.58 ms")
    assert lines[-1] == "  local copies at 2 GB/s, in the steps' times: step 1 2.99 MiB (1.57 ms)"
    assert main(args) == 0
    assert "local copies" not in capsys.readouterr().out
