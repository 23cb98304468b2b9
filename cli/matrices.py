"""The matrices' part of the step plan (``planner.matrices``) for ``shardlang plan FILE.shard
--optimizer muon``: where each matrix's Newton-Schulz iteration runs, its moves and compute,
the buckets of the moves, and the estimate (docs/reference/optimizers.md)."""

from __future__ import annotations

import argparse
import math

import attrs

from cli.plan_report import leg_ops
from cli.tables import format_bytes, format_seconds, format_table
from cli.terminal import Style
from planner.legs import Bucket
from planner.matrices import TO, MatrixPlan, plan_matrices
from planner.owners import DEFAULT_FLOPS_PER_SECOND, PLACEMENTS
from planner.spec_plan import SpecPlan, step_tensor

OPTIMIZERS = ("adamw", "came", "adafactor", "muon")


def add_optimizer_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        help="with a spec file: the optimizer whose step is planned; muon adds where each matrix's Newton-Schulz "
        "iteration runs, its moves and their buckets (the others' steps move the same tensors)",
    )
    p.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="auto",
        help="with --optimizer muon: gather every matrix, give each an owner, or choose by cost (default auto)",
    )
    p.add_argument(
        "--flops-per-second",
        type=rate_arg,
        metavar="RATE",
        help=f"with --optimizer muon: the compute rate of one rank (default {DEFAULT_FLOPS_PER_SECOND:.0e})",
    )


def rate_arg(text: str) -> float:
    """A positive finite rate: ``1e11``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"'{text}': a rate is a positive number (flops per second)")
    return value


def with_matrices(
    spec_plan: SpecPlan,
    *,
    placement: str,
    flops_per_second: float | None,
    flat_axis: str | int | None = None,
) -> SpecPlan:
    """The spec plan with its step's matrix part: the 2-d tensors' iterations, as
    ``ShardedMuon`` plans them for the same tensors (its ``ns_steps`` default, 5)."""
    step = spec_plan.step
    tensors = [step_tensor(tp.tensor, tp.cost, flat_axis) for tp in spec_plan.tensors if len(tp.tensor.shape) == 2]
    matrices = plan_matrices(
        tensors,
        step.rank,
        placement=placement,
        flops_per_second=flops_per_second,
        bucket_bytes=step.bucket_bytes,
    )
    return attrs.evolve(spec_plan, step=attrs.evolve(step, matrices=matrices))


def _collective(bucket: Bucket) -> str:
    """A bucket's collective; an exchange of point-to-point messages as ``point_to_point bf16``."""
    return bucket.describe() if bucket.axis is not None else f"{bucket.op} {bucket.dtype}"


def format_matrices(plan: MatrixPlan, style: Style) -> str:
    """Per matrix its placement, moves and compute; the moves' buckets; the estimate."""
    stated = " (the stated default; --flops-per-second)" if plan.flops_per_second == DEFAULT_FLOPS_PER_SECOND else ""
    n = len(plan.matrices)
    title = style(
        f"Newton-Schulz iterations: {n} matri{'ces' if n != 1 else 'x'}, placement {plan.placement}, "
        f"compute at {plan.flops_per_second:.3g} flop/s{stated}",
        "bold",
    )
    if not plan.matrices:
        return f"{title}\n  none: no 2-d tensor"
    rows = []
    for m in plan.matrices:
        legs = [plan.legs[i] for i in m.legs]
        moves = ", ".join(leg_ops(hop.plan) for leg in legs for hop in leg.hops)
        rows.append(
            [
                m.name,
                "x".join(str(d) for d in m.shape),
                m.mode,
                moves,
                format_bytes(sum(leg.total_bytes for leg in legs)),
                format_seconds(sum(leg.total_seconds for leg in legs)),
                f"{m.flops / 1e6:.3g}",
                format_seconds(m.compute_seconds),
            ]
        )
    headers = ["matrix", "shape", "where", "moves (op(axis), ...)", "bytes/rank", "moving", "Mflop", "computing"]
    table = format_table(headers, rows, "<<<<>>>>", "  ")
    bucket_rows = [
        [
            str(k),
            "to" if b.stage == TO else "back",
            style(_collective(b), "cyan"),
            b.mesh.name or b.mesh.describe(),
            str(len(b.members)),
            ", ".join(dict.fromkeys(plan.legs[m.leg].tensor for m in b.members)),
            format_bytes(b.bytes),
            format_seconds(b.seconds),
        ]
        for k, b in enumerate(plan.buckets, 1)
    ]
    buckets = format_table(
        ["#", "stage", "collective", "mesh", "count", "tensors", "bytes/rank", "time"], bucket_rows, "><<<><>>", "  "
    )
    estimate = (
        f"estimate {format_seconds(plan.seconds)}: moves {format_seconds(plan.comm_seconds)} in "
        f"{plan.collectives} collectives or exchanges ({format_seconds(plan.unbucketed_seconds)} in "
        f"{plan.unbucketed_collectives} unbucketed) + the busiest rank's compute {format_seconds(plan.compute_seconds)}"
    )
    heading = "matrix buckets: one collective or exchange each, to the iteration, then back (stage)"
    return "\n".join([title, table, style(heading, "bold"), buckets, f"  {estimate}"])
