"""``shardlang check FILE.shard --model package.module:factory [--world N]``: the spec files
checked as ``check`` does, then each against the model the factory builds (on the CPU) and,
with ``--world``, against a job of N ranks (:func:`shardlang.model_check.check_model`).

Findings go to standard error as ``file:line:col: error|warning: message`` with the line and a
caret (or ``error|warning: message`` when no line of the spec is at fault), and one line per
file to standard output; the exit code is 1 when a file fails to load or has an error,
warnings alone exit 0. torch is imported here only, and only when the command runs.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

from cli.check import Checked, check_file, describe_spec, error_json, error_text
from cli.tables import format_bytes
from cli.terminal import Style
from planner import DEFAULT_MAX_STATES, CostModel
from planner.spec_plan import plan_spec
from shardlang.errors import ShardlangError
from shardlang.model_check import ERROR, Finding, ModelCheck, check_model, with_model_dtypes


def world_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a rank count (a positive integer)")
    return value


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="also check each file against a model: a function returning an nn.Module, called bare, on the "
        "CPU; its named_parameters() are the tensors (names, shapes, dtypes)",
    )
    p.add_argument(
        "--world",
        type=world_arg,
        metavar="N",
        help="with --model: the job's rank count, which every mesh of the spec must fit",
    )


def model_parameters(target: str) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, dtype)`` of every parameter of the model ``target`` builds on the CPU."""
    import torch

    from cli.init import _module  # the factory's import and call, every failure a SpecError

    with torch.device("cpu"):
        model = _module(target)
    return [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]


def run_model_check(args: argparse.Namespace, out: TextIO, err: TextIO, cost: CostModel | None = None) -> int:
    """``check`` of ``args.files`` with ``--model`` (and ``--world``)."""
    parameters = model_parameters(args.model)
    budget = DEFAULT_MAX_STATES if args.max_states is None else args.max_states
    results: list[tuple[Checked, ModelCheck | None]] = []
    priced: dict[str, tuple[int, int] | None] = {}
    for path in args.files:
        checked = check_file(path, err, args.flat_axis, cost, budget)
        found = None if checked.spec is None else check_model(checked.spec, parameters, world_size=args.world)
        results.append((checked, found))
        if found is not None and any(f.kind == "dtype" for f in found.findings):
            step_bytes = _step_bytes(checked, parameters, args.flat_axis, cost, budget)
            priced[path] = step_bytes if step_bytes is not None and step_bytes[0] != step_bytes[1] else None
    against = f"{args.model} ({len(parameters)} parameters" + (f", world {args.world})" if args.world else ")")
    if args.format == "json":
        json.dump(
            {
                "ok": all(_ok(c, m) for c, m in results),
                "files": [_json(c, m, against, priced.get(c.path)) for c, m in results],
            },
            out,
            indent=2,
        )
        out.write("\n")
    else:
        out_style, err_style = Style.for_stream(out), Style.for_stream(err)
        for checked, found in results:
            if found is None:
                assert checked.error is not None
                err.write(error_text(checked.error, err_style) + "\n")
                continue
            assert checked.spec is not None
            for finding in found.findings:
                err.write(_finding_text(finding, err_style) + "\n")
            if priced.get(checked.path):
                declared, real = priced[checked.path]  # type: ignore[misc]
                err.write(
                    f"{err_style('note', 'bold')}: with the model's dtypes the declared tensors' step moves "
                    f"{format_bytes(real)} per rank, as the optimizers run it; the spec as declared plans "
                    f"{format_bytes(declared)}\n"
                )
            verdict = out_style("ok", "green") if found.ok else out_style("fails", "bold")
            out.write(
                f"{checked.path}: {verdict} against {against}: {found.summary()}; {describe_spec(checked.spec)}\n"
            )
    return 0 if all(_ok(c, m) for c, m in results) else 1


def _ok(checked: Checked, found: ModelCheck | None) -> bool:
    return checked.error is None and found is not None and found.ok


def _finding_text(finding: Finding, style: Style) -> str:
    """As ``str(finding)``, its place bold and its severity colored on a terminal."""
    severity = style(finding.severity, "bold" if finding.severity == ERROR else "yellow")
    if finding.position is None:
        return f"{severity}: {finding.message}"
    head = style(finding.position.prefix() + ":", "bold")
    return f"{head} {severity}: {finding.message}\n{finding.position.caret()}"


def _step_bytes(
    checked: Checked,
    parameters: list[tuple[str, tuple[int, ...], str]],
    flat_axis: str | int | None,
    cost: CostModel | None,
    max_states: int,
) -> tuple[int, int] | None:
    """The bytes per rank of the declared tensors' step plan, as declared and in the model's
    dtypes (``None`` where the plan with the model's dtypes cannot be made)."""
    assert checked.spec is not None
    try:
        options: dict[str, Any] = {"flat_axis": flat_axis, "cost": cost, "max_states": max_states}
        real = plan_spec(with_model_dtypes(checked.spec, parameters), **options)
        declared = plan_spec(checked.spec, **options)
    except ShardlangError:
        return None
    return declared.total_bytes, real.total_bytes


def _json(
    checked: Checked, found: ModelCheck | None, against: str, priced: tuple[int, int] | None = None
) -> dict[str, Any]:
    if found is None:
        return {"file": checked.path, "ok": False, "errors": [error_json(checked)], "findings": []}
    findings = [
        {
            "kind": f.kind,
            "severity": f.severity,
            "message": f.message,
            "parameters": list(f.parameters),
            "line": f.position.line if f.position else None,
            "column": f.position.column if f.position else None,
        }
        for f in found.findings
    ]
    out = {"file": checked.path, "ok": found.ok, "model": against, "errors": [], "findings": findings}
    if priced is not None:  # where a dtype differs: the step's bytes per rank
        out["step_bytes"] = {"declared": priced[0], "model_dtypes": priced[1]}
    return out
