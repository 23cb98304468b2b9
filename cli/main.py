"""The ``shardlang`` console script (also ``python -m cli``).

Exit codes: 0 success; 1 bad input (a spec or layout error, no plan, a file that cannot be
read or written, no ``dot``); 2 bad usage (unknown options, missing arguments); 130 on
Ctrl-C. Every error a user can cause is one message, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from cli.buckets import summary_line
from cli.calibrate import add_calibrate_parser, cmd_calibrate
from cli.check import describe_spec, error_text, run_check
from cli.check_model import add_model_options, run_model_check
from cli.explain import explain, explained_json, format_explained
from cli.init import add_init_parser, cmd_init
from cli.inputs import (
    Pair,
    UsageError,
    axis_arg,
    bandwidth_arg,
    bucket_cap_arg,
    bytes_arg,
    check_flat_axis,
    duration_arg,
    read_pair,
    read_spec,
    shape_arg,
)
from cli.matrices import add_optimizer_options, format_matrices, with_matrices
from cli.picture import picture_dot, plan_picture, summary_dot, tensor_picture
from cli.plan_report import (
    format_plan,
    format_spec_report,
    format_spec_summary,
    max_states_arg,
    plan_json,
    spec_plan_json,
    with_collective_fallback,
)
from cli.render import FORMATS, RenderError, draw, output_format, write
from cli.show import format_show, show_json
from cli.suggest import add_suggest_parser, cmd_suggest, suggest_line
from cli.summary import TensorGroup, group_tensors, plan_spec_with_progress
from cli.terminal import Progress, Style
from cli.timeline import add_timeline_parser, cmd_timeline
from planner import DEFAULT_MAX_STATES, CostModel, Plan, plan
from planner.legs import DEFAULT_OVERLAP_BUCKET_BYTES
from planner.spec_plan import SpecPlan
from shardlang import Spec, TensorSpec, load_spec, parse_layout
from shardlang.dtypes import ITEMSIZE
from shardlang.errors import ShardlangError, SpecError

COMMANDS = ("check", "plan", "show", "render", "explain", "init", "calibrate", "suggest", "timeline")
BUNDLED_EXAMPLE = "gpt2_small_dp2_tp2.shard"


def bundled_example() -> Path:
    """The example spec shipped inside the package (a link to examples/ in a checkout)."""
    return (Path(__file__).resolve().parent / BUNDLED_EXAMPLE).resolve()


def _add_cost_options(p: argparse.ArgumentParser, memory: bool = True) -> None:
    p.add_argument(
        "--p2p",
        action="store_true",
        help="layouts on one mesh: also consider point-to-point steps and mixes, and take the cheapest "
        "(layouts on two different meshes always use them)",
    )
    p.add_argument(
        "--costs",
        metavar="HINTS.json",
        help="the cost model of a hints file (`shardlang calibrate -o`): per-axis, per-collective latency and "
        "bandwidth; replaces the spec's hints, and --alpha/--bandwidth override its defaults",
    )
    p.add_argument(
        "--alpha",
        type=duration_arg,
        metavar="SECONDS",
        help="latency per round (5e-6 or 5us; default 5us, or the spec file's mesh latency)",
    )
    p.add_argument(
        "--bandwidth",
        type=bandwidth_arg,
        metavar="B[,B...]",
        help="bytes per second, one for every mesh axis or one per axis (default 1e11, or the spec's)",
    )
    if memory:
        p.add_argument(
            "--max-local-bytes",
            type=bytes_arg,
            metavar="N",
            help="no state of a plan may hold more bytes per rank (1048576, 64MiB)",
        )
    _add_max_states(p)


def _add_max_states(p: argparse.ArgumentParser) -> None:
    """The search budget, wherever a budget error tells the user to raise it."""
    p.add_argument(
        "--max-states",
        type=max_states_arg,
        metavar="N",
        help=f"the search budget in states of each pair of layouts (default {DEFAULT_MAX_STATES})",
    )


def _add_step_options(p: argparse.ArgumentParser, buckets: bool = True) -> None:
    """The optimizers' step options, for a spec file (docs/reference/optimizers.md)."""
    p.add_argument(
        "--flat-axis",
        type=axis_arg,
        metavar="AXIS",
        help="with a spec file: flat sharding over this mesh axis (name or index), as the optimizers' "
        "flat_axis; the plan is rank 0's",
    )
    if buckets:
        p.add_argument(
            "--bucket-bytes",
            type=bucket_cap_arg,
            metavar="N",
            help="with a spec file: the most buffer bytes a bucket holds per rank (default 32MiB, 4MiB with "
            "--overlap; 1 puts every step in a bucket of its own; auto: the cost model's cap)",
        )
        p.add_argument(
            "--overlap",
            action="store_true",
            help="with a spec file: buckets before the update start during backward, as the optimizers' overlap=True",
        )
        p.add_argument(
            "--prefetch",
            action="store_true",
            help="with a spec file: buckets after the update start after the step, as with prefetch_params",
        )


def _add_tensor_options(p: argparse.ArgumentParser, shape_required: bool = False) -> None:
    p.add_argument(
        "--shape",
        type=shape_arg,
        required=shape_required,
        metavar="L0xL1...",
        help="the global tensor shape, e.g. 32000x1024 (() for a scalar)",
    )
    p.add_argument(
        "--dtype", choices=list(ITEMSIZE), metavar="DTYPE", help=f"element type: {', '.join(ITEMSIZE)} (default f32)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardlang",
        description="Layouts of sharded tensors on device meshes: check spec files, plan the cheapest "
        "collectives (or point-to-point messages) between layouts, show and draw them.",
        epilog="Without a command, `shardlang [FILE.shard]` runs the main job on FILE (default: the bundled "
        f"example {BUNDLED_EXAMPLE}): check it, print every tensor's optimizer-step plans with totals, and "
        "draw the summary picture under out/.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "check",
        help="validate spec files",
        description="Validate spec files: errors as "
        "file:line:col: message, with the line and a caret; exit 1 on any error.",
    )
    p.add_argument("files", nargs="+", metavar="FILE")
    _add_step_options(p, buckets=False)
    p.add_argument(
        "--costs",
        metavar="HINTS.json",
        help="plan every tensor's step under the cost model of a hints file (`shardlang calibrate -o`) "
        "instead of the spec's hints: the file is checked, and must fit every mesh",
    )
    _add_max_states(p)
    p.add_argument("--format", choices=("text", "json"), default="text")
    add_model_options(p)

    pair_or_spec = "two layouts (SRC DST, with --shape) or one spec file (FILE.shard)"
    p = sub.add_parser(
        "plan",
        help="the cheapest plan between two layouts, or for a spec file",
        description=f"Plan a reshard. TARGET is {pair_or_spec}.",
    )
    p.add_argument("targets", nargs="+", metavar="TARGET")
    p.add_argument(
        "--tensor",
        action="append",
        metavar="NAME",
        help="with a spec file: plan only this tensor (repeatable); a name a rule matches needs --shape",
    )
    _add_tensor_options(p)
    _add_cost_options(p)
    _add_step_options(p)
    add_optimizer_options(p)
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument(
        "--expand",
        action="store_true",
        help="with two layouts: list every transfer of a point-to-point step (a large step whose senders take "
        "turns is written as its pattern otherwise)",
    )

    p = sub.add_parser(
        "show",
        help="which block each rank holds, as a grid",
        description="Which block of the global tensor each rank holds: mesh coordinates, "
        "rank ids and index ranges, padded and empty pieces marked.",
    )
    p.add_argument("layout", metavar="LAYOUT")
    p.add_argument("--shape", type=shape_arg, required=True, metavar="L0xL1...")
    p.add_argument("--format", choices=("text", "json"), default="text")

    p = sub.add_parser(
        "render",
        help="draw a plan (Graphviz)",
        description=f"Draw a plan: one panel per state, one arrow per step. TARGET is "
        f"{pair_or_spec}; for a spec file, --tensor NAME draws that tensor's optimizer step, "
        "--each draws every tensor into -o DIR, and nothing draws the summary of the whole step.",
    )
    p.add_argument("targets", nargs="+", metavar="TARGET")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--tensor", action="append", metavar="NAME", help="with a spec file: draw this tensor")
    group.add_argument("--each", action="store_true", help="with a spec file: one picture per tensor into -o DIR")
    _add_tensor_options(p)
    _add_cost_options(p)
    _add_step_options(p)
    p.add_argument("--format", choices=FORMATS, help="dot, svg or png (default: from -o's suffix, else svg)")
    p.add_argument("-o", "--output", metavar="FILE", help="where to write (default: standard output)")

    p = sub.add_parser(
        "explain",
        help="the chosen plan next to a one-axis-at-a-time greedy order",
        description="The chosen plan next to what a one-mesh-axis-at-a-time greedy order "
        "(DTensor's default) does, and what that costs.",
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    _add_tensor_options(p, shape_required=True)
    _add_cost_options(p, memory=False)
    p.add_argument("--format", choices=("text", "json"), default="text")
    add_init_parser(sub)
    add_suggest_parser(sub)
    add_calibrate_parser(sub)
    add_timeline_parser(sub)
    return parser


# --- commands ----------------------------------------------------------------------------
def _target(args: argparse.Namespace) -> Pair | Spec:
    if len(args.targets) == 2:
        if args.tensor:
            raise UsageError("--tensor applies to a spec file, not to a pair of layouts")
        if args.flat_axis is not None or args.bucket_bytes is not None or args.overlap or args.prefetch:
            raise UsageError(
                "--flat-axis, --bucket-bytes, --overlap and --prefetch apply to a spec file, not to a pair of layouts"
            )
        return read_pair(args.targets[0], args.targets[1], args.shape, args.dtype)
    if len(args.targets) == 1:
        if (args.shape is not None or args.dtype is not None) and not (args.tensor and args.shape is not None):
            raise UsageError(
                "with a spec file, --shape and --dtype describe a tensor that a rule matches: "
                "give --tensor NAME --shape L0xL1... [--dtype DTYPE]"
            )
        return read_spec(args.targets[0])
    raise UsageError(f"give two layouts (SRC DST) with --shape, or one spec file; got {len(args.targets)} arguments")


def _spec_tensors(
    spec: Spec, names: Sequence[str], shape: tuple[int, ...] | None, dtype: str | None
) -> list[TensorSpec]:
    chosen = []
    for name in names:
        if shape is not None:
            chosen.append(spec.resolve(name, shape, dtype or "f32"))
            continue
        try:
            chosen.append(spec.tensor(name))
        except SpecError as e:
            hint = "; for a tensor that a rule matches, give its --shape (and --dtype)" if spec.rules else ""
            raise SpecError(e.message + hint) from None
    return chosen


def _cost_model(args: argparse.Namespace) -> CostModel:
    """The model of ``--costs`` (or the default one), with ``--alpha`` and ``--bandwidth``."""
    base = CostModel.from_file(args.costs) if args.costs else CostModel()
    return base.with_overrides(alpha=args.alpha, bandwidth=args.bandwidth)


def _plan_pair(pair: Pair, args: argparse.Namespace) -> Plan:
    cost = _cost_model(args)
    budget = DEFAULT_MAX_STATES if args.max_states is None else args.max_states

    def run(p2p: bool) -> Plan:
        limit = args.max_local_bytes
        return plan(
            pair.src,
            pair.dst,
            pair.shape,
            pair.dtype,
            cost,
            max_local_bytes=limit,
            point_to_point=p2p,
            max_states=budget,
        )

    return with_collective_fallback(run, args.p2p, sys.stderr)


def _plan_spec(spec: Spec, args: argparse.Namespace) -> SpecPlan:
    tensors = _spec_tensors(spec, args.tensor, args.shape, args.dtype) if args.tensor else list(spec.tensors)
    check_flat_axis(tensors, args.flat_axis)
    return with_collective_fallback(
        lambda p2p: plan_spec_with_progress(
            spec,
            sys.stderr,
            tensors=tensors,
            alpha=args.alpha,
            bandwidth=args.bandwidth,
            cost=CostModel.from_file(args.costs) if args.costs else None,
            max_local_bytes=args.max_local_bytes,
            point_to_point=p2p,
            flat_axis=args.flat_axis,
            bucket_bytes=DEFAULT_OVERLAP_BUCKET_BYTES
            if args.overlap and args.bucket_bytes is None
            else args.bucket_bytes,
            overlap=args.overlap,
            prefetch=args.prefetch,
            max_states=DEFAULT_MAX_STATES if args.max_states is None else args.max_states,
        ),
        args.p2p,
        sys.stderr,
    )


def _emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def cmd_plan(args: argparse.Namespace) -> int:
    style = Style.for_stream(sys.stdout)
    target = _target(args)
    if isinstance(target, Pair):
        if args.optimizer is not None:
            raise UsageError("--optimizer applies to a spec file, not to a pair of layouts")
        result = _plan_pair(target, args)
        if args.expand:
            result = result.expanded()
        if args.format == "json":
            _emit_json(plan_json(result))
        else:
            print(format_plan(result, style))
        return 0
    if args.expand:
        raise UsageError("--expand applies to a pair of layouts (SRC DST --shape), not to a spec file")
    spec_plan = _plan_spec(target, args)
    if args.optimizer == "muon":
        spec_plan = with_matrices(
            spec_plan, placement=args.placement, flops_per_second=args.flops_per_second, flat_axis=args.flat_axis
        )
    if args.format == "json":
        _emit_json(spec_plan_json(spec_plan))
        return 0
    print(format_spec_report(spec_plan, style, each_tensor=bool(args.tensor), flat_axis=args.flat_axis))
    if spec_plan.step.matrices is not None:
        print(f"\n{format_matrices(spec_plan.step.matrices, style)}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    layout = parse_layout(args.layout, filename="LAYOUT")
    layout.check_shape(args.shape)
    if args.format == "json":
        _emit_json(show_json(layout, args.shape))
    else:
        width = shutil.get_terminal_size((100, 24)).columns
        print(format_show(layout, args.shape, Style.for_stream(sys.stdout), width))
    return 0


def _file_name(tensor_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", tensor_name)


def cmd_render(args: argparse.Namespace) -> int:
    fmt = output_format(args.format, args.output)
    target = _target(args)
    if isinstance(target, Pair):
        if args.each:
            raise UsageError("--each applies to a spec file")
        dot = picture_dot(plan_picture(_plan_pair(target, args)))
    else:
        if args.tensor and len(args.tensor) > 1:
            raise UsageError("render draws one --tensor per picture; use --each for every tensor")
        if (args.tensor or args.each) and args.flat_axis is not None:
            raise UsageError(
                "a tensor's picture draws layouts of the whole tensor, and a flat hop is a 1-d view of a rank's "
                "block: drop --flat-axis (the summary picture and `shardlang plan` take it)"
            )
        spec_plan = _plan_spec(target, args)
        groups = group_tensors(spec_plan)
        if args.each:
            return _render_each(groups, args.output, fmt)
        dot = (
            picture_dot(tensor_picture(spec_plan.tensors[0]))
            if args.tensor
            else summary_dot(spec_plan, groups, args.flat_axis)
        )
    written = write(draw(dot, fmt), args.output, fmt)
    if written:
        print(f"wrote {written}", file=sys.stderr)
    return 0


def _render_each(groups: list[TensorGroup], output: str | None, fmt: str) -> int:
    if not output or output == "-":
        raise UsageError("--each writes one file per tensor: give -o DIR")
    progress = Progress("drawing", len(groups), sys.stderr)
    try:
        for g in groups:
            progress.advance(g.label)
            picture = tensor_picture(g.first, label=g.label)
            write(draw(picture_dot(picture), fmt), str(Path(output) / f"{_file_name(g.first.tensor.name)}.{fmt}"), fmt)
    finally:
        progress.close()
    print(
        f"wrote {len(groups)} pictures to {output}/ (one per tensor; tensors declared together with "
        "equal plans share one, named after the first)",
        file=sys.stderr,
    )
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    pair = read_pair(args.src, args.dst, args.shape, args.dtype)
    cost = _cost_model(args)
    budget = DEFAULT_MAX_STATES if args.max_states is None else args.max_states
    ex = explain(pair.src, pair.dst, pair.shape, pair.dtype, cost, point_to_point=args.p2p, max_states=budget)
    if args.format == "json":
        _emit_json(explained_json(ex))
    else:
        print(format_explained(ex, Style.for_stream(sys.stdout)))
    return 0


def run_main_job(path: Path, bundled: bool) -> int:
    """Check a spec file, print its optimizer-step plans with totals, draw the summary."""
    style = Style.for_stream(sys.stdout)
    relative = os.path.relpath(path)
    shown = str(path) if relative.startswith("..") else relative
    origin = " (the bundled example; run `shardlang FILE.shard` for your own)" if bundled else ""
    print(f"{style('shardlang', 'bold')}: {shown}{origin}\n")
    spec = load_spec(shown)
    spec_plan = plan_spec_with_progress(spec, sys.stderr)
    print(f"check: {style('ok', 'green')}: {describe_spec(spec)}\n")
    print(format_spec_summary(spec_plan, style) + "\n")
    print(f"{style('buckets', 'bold')}: {summary_line(spec_plan.step)}\n")
    print(suggest_line(spec) + "\n")
    dot = summary_dot(spec_plan, group_tensors(spec_plan))
    stem = Path("out") / path.name.removesuffix(".shard")
    try:
        written = write(draw(dot, "svg"), f"{stem}.summary.svg", "svg")
    except RenderError as e:
        written = write(dot.encode(), f"{stem}.summary.dot", "dot")
        sys.stdout.flush()
        print(f"note: {e.message}", file=sys.stderr)
    print(f"summary picture: {written}")
    first = spec.tensors[0].name if spec.tensors else "NAME"
    print(
        "\nnext:\n"
        f"  shardlang plan {shown}    # the buckets: one collective each\n"
        f"  shardlang plan {shown} --tensor {first}\n"
        f"  shardlang render {shown} --tensor {first} -o {stem}.{_file_name(first)}.svg\n"
        f"  shardlang explain 'R,S1 | P0 over mesh[2,2]' 'S0,S1 over mesh[2,2]' --shape 32000x1024"
    )
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    if args.world is not None and args.model is None:
        raise UsageError("--world checks the meshes against the job of a model: give --model too")
    cost = CostModel.from_file(args.costs) if args.costs else None
    if args.model is not None:  # torch is imported to build the model, only then
        return run_model_check(args, sys.stdout, sys.stderr, cost)
    budget = DEFAULT_MAX_STATES if args.max_states is None else args.max_states
    return run_check(
        args.files, args.format, sys.stdout, sys.stderr, flat_axis=args.flat_axis, cost=cost, max_states=budget
    )


COMMAND_FUNCTIONS = {
    "check": cmd_check,
    "plan": cmd_plan,
    "show": cmd_show,
    "render": cmd_render,
    "explain": cmd_explain,
    "init": cmd_init,
    "suggest": cmd_suggest,
    "calibrate": cmd_calibrate,
    "timeline": cmd_timeline,
}


def _run(argv: list[str]) -> int:
    if not argv or (argv[0] not in COMMANDS and not argv[0].startswith("-")):
        if len(argv) > 1:
            build_parser().error(f"unknown command '{argv[0]}' (commands: {', '.join(COMMANDS)})")
        if argv and not argv[0].endswith(".shard") and not Path(argv[0]).is_file():
            build_parser().error(f"unknown command '{argv[0]}' (commands: {', '.join(COMMANDS)}, or a FILE.shard)")
        path = Path(argv[0]) if argv else bundled_example()
        return run_main_job(path, bundled=not argv)
    args = build_parser().parse_args(argv)
    return COMMAND_FUNCTIONS[args.command](args)


@contextlib.contextmanager
def _rare_collections() -> Iterator[None]:
    """Python's cyclic collector run rarely while a command works: planning builds hundreds of
    thousands of small objects that live until the command ends (plans, legs, candidates), and
    each default pass over them finds next to nothing to free (about 6% of a ``suggest`` at
    131,072 ranks; docs/reference/suggest.md). The objects from before are frozen out of its
    passes; both are undone after, for callers in the same process."""
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def entry() -> NoReturn:
    """The ``shardlang`` command's process (console script, ``python -m cli``): :func:`main`,
    then exit without the interpreter's last collection, which would walk every object a large
    plan left (a third of a second after a ``suggest`` at 131,072 ranks; docs/reference/suggest.md):
    they are frozen out of it, and freed with the process."""
    code = main()
    gc.freeze()
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        with _rare_collections():
            return _run(argv)
    except UsageError as e:
        print(f"shardlang: error: {e.message} (see shardlang --help)", file=sys.stderr)
        return 2
    except ShardlangError as e:
        sys.stdout.flush()
        print(error_text(e, Style.for_stream(sys.stderr)), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`shardlang plan ... | head`): stop quietly, as cat does.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
