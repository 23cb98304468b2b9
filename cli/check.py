"""``shardlang check FILE...``: a spec file is valid when it parses, means something, and
every tensor's optimizer step can be planned (under ``--costs``, by that cost model, which must
fit every mesh of the file)."""

from __future__ import annotations

import json
from typing import Any, TextIO

import attrs

from cli.plan_report import padding_warnings
from cli.summary import plan_spec_with_progress
from cli.terminal import Style
from planner import DEFAULT_MAX_STATES, CostModel
from shardlang import Spec, load_spec
from shardlang.errors import ShardlangError


@attrs.frozen
class Checked:
    path: str
    spec: Spec | None
    error: ShardlangError | None
    warnings: tuple[str, ...] = ()  # chunk padding (cli.plan_report.padding_warnings)


def check_file(
    path: str,
    progress: TextIO,
    flat_axis: str | int | None = None,
    cost: CostModel | None = None,
    max_states: int = DEFAULT_MAX_STATES,
) -> Checked:
    """Load and plan one file (with ``flat_axis``, as the optimizers' flat sharding over it;
    with ``cost``, under that model instead of the spec's hints; ``max_states``, the search
    budget of each tensor's pairs)."""
    try:
        spec = load_spec(path)
        spec_plan = plan_spec_with_progress(spec, progress, flat_axis=flat_axis, cost=cost, max_states=max_states)
    except ShardlangError as e:
        return Checked(path, None, e)
    return Checked(path, spec, None, tuple(padding_warnings(spec_plan)))


def describe_spec(spec: Spec) -> str:
    meshes = ", ".join(f"{d.mesh.name} = {d.mesh.describe()}" for d in spec.meshes) or "inline meshes only"
    t, r = len(spec.tensors), len(spec.rules)
    return f"{t} tensor{'s' * (t != 1)}, {r} rule{'s' * (r != 1)}; meshes: {meshes}"


def error_text(error: ShardlangError, style: Style) -> str:
    """``file:line:col: message``, the line and a caret (the prefix bold on a terminal)."""
    text = str(error)
    if error.position is not None:
        prefix = error.position.prefix() + ":"
        text = style(prefix, "bold") + text[len(prefix) :]
    return text


def error_json(checked: Checked) -> dict[str, Any]:
    assert checked.error is not None
    data = checked.error.to_json()
    data["file"] = data["file"] or checked.path
    return data


def run_check(
    paths: list[str],
    fmt: str,
    out: TextIO,
    err: TextIO,
    flat_axis: str | int | None = None,
    cost: CostModel | None = None,
    max_states: int = DEFAULT_MAX_STATES,
) -> int:
    results = [check_file(p, err, flat_axis, cost, max_states) for p in paths]
    if fmt == "json":
        files = [
            {
                "file": c.path,
                "ok": c.error is None,
                "tensors": len(c.spec.tensors) if c.spec else None,
                "rules": len(c.spec.rules) if c.spec else None,
                "errors": [error_json(c)] if c.error else [],
                "warnings": list(c.warnings),
            }
            for c in results
        ]
        json.dump({"ok": all(c.error is None for c in results), "files": files}, out, indent=2)
        out.write("\n")
    else:
        out_style, err_style = Style.for_stream(out), Style.for_stream(err)
        for c in results:
            if c.error is None:
                assert c.spec is not None
                out.write(f"{c.path}: {out_style('ok', 'green')}: {describe_spec(c.spec)}\n")
                err.writelines(f"{c.path}: {err_style(w, 'yellow')}\n" for w in c.warnings)
            else:
                err.write(error_text(c.error, err_style) + "\n")
    return 0 if all(c.error is None for c in results) else 1
