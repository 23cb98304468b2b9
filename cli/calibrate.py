"""``shardlang calibrate``: measure the machine's collectives and fit the cost model to them
(docs/tutorials/calibrating.md); ``--check`` times a sample of plans against what the model predicts.

Run under ``torchrun``, one process per rank of the mesh (``--mesh`` declares it as a spec
file's mesh line does); rank 0 prints and writes, the others only measure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import attrs

from cli.inputs import UsageError
from cli.tables import format_bytes, format_seconds, format_table
from planner import CostModel, Plan, plan
from planner.cost import PRICED_OPS
from planner.fit import LOCAL, Line, fit_model, median_relative_error, spearman
from shardlang import Mesh, parse_mesh

DEFAULT_CHECK_PLANS = 8


def add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure collectives and fit per-axis, per-collective latency and bandwidth (under torchrun)",
        description="Under torchrun, one process per rank of --mesh: time every collective kind on every mesh "
        "axis at 4 KiB-16 MiB, and a slice that sends nothing; fit latency and bandwidth per kind and axis, the "
        "executor's overhead per step and its copy bandwidth, and the choice margin (how far the fitted lines "
        "typically miss a sample; docs/calibration.md), and write the hints file that "
        "--costs reads. With --check HINTS.json: time a sample of plans and print predicted against measured.",
    )
    p.add_argument("--mesh", metavar="DECL", help="the mesh, as a spec file declares it: 'world = [dp=2,tp=2]'")
    p.add_argument("-o", "--output", metavar="HINTS.json", help="where to write the hints (default: standard output)")
    p.add_argument("--check", metavar="HINTS.json", help="time a sample of plans under this model instead")
    p.add_argument(
        "--reps", type=int, default=7, metavar="N", help="repetitions per size and pass (default 7, two passes)"
    )
    p.add_argument("--budget", type=float, default=45.0, metavar="SECONDS", help="time for the sweep (default 45)")
    p.add_argument("--plans", type=int, default=DEFAULT_CHECK_PLANS, metavar="N", help="plans --check times")


def read_mesh(text: str) -> Mesh:
    """The mesh of ``world = [dp=2,tp=2]`` or ``mesh[4]`` (``mesh`` in front is optional)."""
    body = text.strip()
    mesh = parse_mesh(body if body.startswith("mesh") else f"mesh {body}", filename="--mesh")
    if 1 in mesh.shape:
        raise UsageError(f"--mesh {text!r}: an axis of size 1 sends nothing; leave it out of the calibration")
    return mesh


def cmd_calibrate(args: argparse.Namespace) -> int:
    model = CostModel.from_file(args.check) if args.check else None
    mesh_text = args.mesh
    if mesh_text is None and args.check:
        mesh_text = json.loads(Path(args.check).read_text()).get("mesh")
    if not mesh_text:
        raise UsageError("give the mesh to measure: --mesh 'world = [dp=2,tp=2]'")
    mesh = read_mesh(mesh_text)
    if args.reps < 1 or args.budget <= 0 or args.plans < 1:
        raise UsageError("--reps and --plans are positive counts and --budget a positive number of seconds")
    world = _start(mesh)
    import runtime  # after the checks: torch is slow to import
    from runtime.measure.calibrate import known_breaks, sample_pairs, sweep, time_plans

    try:
        if model is None:
            samples = sweep(mesh, reps=args.reps, budget=args.budget)
            fitted, lines = fit_model(samples, known_breaks(mesh))  # the runtime's own switches (planner.fit)
            if world.rank == 0:
                fitted = _with_flop_rate(fitted)
                _report_fit(fitted, lines, mesh, samples, args.output)
        else:
            pairs = sample_pairs(mesh, args.plans, random.Random(0), 16 * 2**10, 16 * 2**20)
            plans = [plan(src, dst, shape, "f32", model) for src, dst, shape in pairs]
            measured = time_plans(plans, reps=args.reps)
            if world.rank == 0:
                print(format_check(plans, measured))
    finally:
        runtime.shutdown()
    return 0


def _with_flop_rate(fitted: CostModel) -> CostModel:
    """The model with rank 0's measured bf16 matrix-product rate (``runtime.measure.flops``), which
    prices Muon's Newton-Schulz iterations (``planner.matrices``)."""
    from runtime.measure.flops import matmul_rate

    rate = matmul_rate()
    print(f"matrix products (bf16, rank 0): {rate:.3g} flop/s", file=sys.stderr)
    return attrs.evolve(fitted, flops_per_second=rate)


class _World:
    def __init__(self, rank: int) -> None:
        self.rank = rank


def _start(mesh: Mesh) -> _World:
    """Join the job torchrun started (its environment), on the backend its devices take."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UsageError(
            f"calibrate runs one process per rank under torchrun: torchrun --nproc-per-node {mesh.size} "
            "--no-python shardlang calibrate --mesh ..."
        )
    if int(os.environ["WORLD_SIZE"]) != mesh.size:
        raise UsageError(f"--mesh has {mesh.size} ranks but torchrun started {os.environ['WORLD_SIZE']}")
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return _World(dist.get_rank())


def fit_table(fitted: CostModel, lines: dict, mesh: Mesh) -> str:
    """The fitted figures per kind and axis, then the executor terms and the choice margin
    (``planner.fit``)."""
    rows = []
    for op in PRICED_OPS:
        alphas, bandwidths = fitted.for_op(op, mesh)
        for axis in range(mesh.ndim):
            if (op, axis) in lines:
                line = lines[op, axis]
                row = [op, mesh.axis_label(axis), format_seconds(alphas[axis]), f"{bandwidths[axis] / 1e9:.3g} GB/s"]
                pooled = _pooling(line, mesh)
                rows.append([*row, f"{line.kept}/{line.total}{pooled}"])
                large = fitted.on_axis(op, mesh, axis).large
                if line.large is not None and large is not None:  # its second regime (planner.fit)
                    rows.append(
                        [
                            f"  from {format_bytes(large.from_bytes)}",  # type: ignore[arg-type]
                            mesh.axis_label(axis),
                            format_seconds(large.alpha),  # type: ignore[arg-type]
                            f"{large.bandwidth / 1e9:.3g} GB/s",  # type: ignore[operator]
                            f"{line.large.kept}/{line.large.total}{pooled}",
                        ]
                    )
    if (LOCAL, -1) in lines:
        line, copy = lines[LOCAL, -1], fitted.copy_bandwidth
        rows.append(
            [
                "executor (per step, copy)",
                "any",
                format_seconds(fitted.overhead),
                "" if copy is None else f"{copy / 1e9:.3g} GB/s",
                f"{line.kept}/{line.total}",
            ]
        )
    if fitted.margin:  # what a step must save to be taken (planner.fit), on a row of its own
        rows.append(["choice margin (per step)", "any", format_seconds(fitted.margin), "", ""])
    return format_table(["collective", "axis", "latency/round", "bandwidth", "sizes kept"], rows)


def _pooling(line: Line, mesh: Mesh) -> str:
    """What a fitted line shares with other axes (``planner.fit``): all of it, its slope, or nothing."""
    parts = ((line.axes, "pooled"), (line.shared_slope, "bandwidth pooled"))
    shared = [f"{'+'.join(map(mesh.axis_label, axes))} {what}" for axes, what in parts if axes]
    return f" ({', '.join(shared)})" if shared else ""


def _report_fit(fitted: CostModel, lines: dict, mesh: Mesh, samples: list, output: str | None) -> None:
    table = fit_table(fitted, lines, mesh)
    data = {
        "mesh": mesh.text(),
        **fitted.to_json(),
        "calibration": {
            "samples": [[s.op, s.axis, s.bytes, s.seconds] for s in samples],
            "note": "op, axis, bytes per rank as the cost table counts them (slice: the target piece), "
            "median seconds of the slowest rank",
        },
    }
    text = json.dumps(data, indent=1) + "\n"
    if output and output != "-":
        Path(output).write_text(text)
        print(table, file=sys.stderr)
        print(f"wrote {output}", file=sys.stderr)
    else:
        print(table, file=sys.stderr)
        sys.stdout.write(text)


def format_check(plans: list[Plan], measured: list[float]) -> str:
    """Predicted against measured time per plan, then the rank correlation and median error."""
    rows = [
        [
            f"{p.src} -> {p.dst}",
            "x".join(map(str, p.shape)),
            format_seconds(p.total_seconds),
            format_seconds(m),
            f"{p.total_seconds / m:.2f}",
        ]
        for p, m in zip(plans, measured, strict=True)
    ]
    predicted = [p.total_seconds for p in plans]
    table = format_table(["plan", "shape", "predicted", "measured", "pred/meas"], rows)
    return (
        f"{table}\nSpearman rank correlation {spearman(predicted, measured):.3f}, "
        f"median |predicted - measured| / measured {median_relative_error(predicted, measured):.1%}"
    )
