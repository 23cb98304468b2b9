"""``runtime.measure.calibrate`` on 2 gloo ranks (small sizes, few repetitions; no timing asserts) and
the ``shardlang calibrate`` command's own checks and ``--check`` table."""

from __future__ import annotations

import planner
from cli.calibrate import format_check
from cli.main import main
from planner.fit import fit_model
from runtime.measure.calibrate import known_breaks, sweep, time_plans
from runtime.testing import run_ranks
from shardlang import Mesh, parse_layout


def _sweep_and_time(rank: int, world: int) -> tuple[list, list[float], dict]:
    samples = sweep(Mesh((2,)), sizes=(4096, 16384), reps=2)
    plans = [planner.plan(parse_layout("S0,R over mesh[2]"), parse_layout("R,R over mesh[2]"), (64, 8))]
    return samples, time_plans(plans, reps=2), known_breaks(Mesh((2, 3)))


def test_the_sweep_measures_every_kind_at_the_tables_bytes_on_every_rank():
    (samples, timed, breaks), other = run_ranks(_sweep_and_time, 2, timeout=120)
    assert other == (samples, timed, breaks)  # one all-reduce of the times: every rank has the same figures
    # gloo gathers a result of 1 MiB or more by messages: a piece of 2**19 bytes on an axis of 2
    # (1 * 2**19 bytes by the table), of ceil(2**20 / 3) = 349,526 on an axis of 3 (twice that).
    assert breaks == {("all_gather", 0): 524288, ("all_gather", 1): 699052}
    # A [16, 64] and a [64, 64] f32 tensor on 2 ranks, counted by hand from the cost table:
    # all_gather / reduce_scatter (n-1) * half, all_reduce 2 (n-1) * half, all_to_all and the
    # point-to-point exchange (one message each way) a quarter; and the slice of a tensor twice
    # as long, whose target piece (what the executor copies) is the whole of the first.
    got = [(s.op, s.axis, s.rounds, s.bytes) for s in samples]
    want = []
    for rows in (16, 64):
        half, quarter = rows * 64 * 4 // 2, rows * 64 * 4 // 4
        want += [("all_gather", 0, 1, half), ("reduce_scatter", 0, 1, half), ("all_reduce", 0, 2, 2 * half),
                 ("all_to_all", 0, 1, quarter), ("point_to_point", 0, 1, quarter),
                 ("slice", 0, 0, 2 * half)]  # fmt: skip
    assert got == want
    assert all(s.seconds > 0 for s in samples) and timed[0] > 0
    model, _ = fit_model(samples)
    assert [c.op for c in model.ops] == list(planner.PRICED_OPS[1:])  # all_gather's are the model's own
    assert model.copy_bandwidth is not None  # the slices price the executor terms


def test_calibrate_outside_torchrun_and_bad_meshes_are_clear_errors(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["calibrate", "--mesh", "world = [dp=2, tp=2]"]) == 2
    assert "torchrun --nproc-per-node 4 --no-python shardlang calibrate" in capsys.readouterr().err
    assert main(["calibrate", "--mesh", "world = [dp=2, tp=1]"]) == 2
    assert "an axis of size 1 sends nothing" in capsys.readouterr().err
    assert main(["calibrate", "--mesh", "world = [dp=2,"]) == 1
    err = capsys.readouterr().err
    assert "--mesh:1:" in err and "Traceback" not in err
    assert main(["calibrate"]) == 2
    assert "give the mesh to measure" in capsys.readouterr().err


def test_the_check_table():
    mesh = "over mesh[2]"
    plans = [
        planner.plan(parse_layout(f"S0,R {mesh}"), parse_layout(f"R,R {mesh}"), (1024, 256)),
        planner.plan(parse_layout(f"R,R | P0 {mesh}"), parse_layout(f"R,R {mesh}"), (1024, 256)),
    ]
    # By hand: 5 us + 512 KiB / 100 GB/s = 10.2 us; 2 * 5 us + 1 MiB / 100 GB/s = 20.5 us;
    # errors 1.76 / 12 and 2.49 / 18, median 14.2%.
    lines = format_check(plans, [12e-6, 18e-6]).splitlines()
    assert lines == [
        "plan                                       shape     predicted  measured  pred/meas",
        "S0,R over mesh[2] -> R,R over mesh[2]      1024x256  10.2 us    12 us     0.85",
        "R,R | P0 over mesh[2] -> R,R over mesh[2]  1024x256  20.5 us    18 us     1.14",
        "Spearman rank correlation 1.000, median |predicted - measured| / measured 14.2%",
    ]
