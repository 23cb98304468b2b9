"""Hints files: the JSON form of a :class:`~planner.cost.CostModel` (docs/reference/cost-model.md),
read with every field checked (a :class:`~planner.errors.PlanError` naming the file and the
field) and written back (``CostModel.from_file``, ``from_json`` and ``to_json`` call these)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from planner.errors import PlanError
from planner.op_costs import PRICED_OPS, OpCost, Regime

if TYPE_CHECKING:
    from planner.cost import CostModel

# The fields of a hints file (``CostModel.from_file``); "mesh" and "calibration" are notes.
# Readers ignore nothing: a field that is not here is an error, so a new term is added here
# (with its check in :func:`hints_model` and its docs in docs/calibration.md).
HINTS_FIELDS = (
    "mesh", "alpha", "bandwidth", "ops", "overhead", "copy_bandwidth", "margin", "calibration", "flops_per_second"
)  # fmt: skip


def read_hints(path: str | Path, model: type[CostModel]) -> CostModel:
    """The model of a hints file: optional ``alpha`` and ``bandwidth`` (one number or one per mesh
    axis; defaults where absent) and ``ops``, an object from collective kinds to their own
    ``alpha`` and ``bandwidth``; optional ``overhead`` (seconds per step) and ``copy_bandwidth``
    (bytes/s), one number each. A :class:`PlanError` naming the file and the field when it is
    unreadable or a value is bad."""
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else "not UTF-8 text"
        raise PlanError(f"{where}: cannot read the cost hints: {reason}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"{where}:{e.lineno}:{e.colno}: not JSON: {e.msg}") from None
    return hints_model(data, model, where)


def hints_model(data: object, model: type[CostModel], where: str = "the cost hints") -> CostModel:
    """The ``model`` (the class :class:`~planner.cost.CostModel`, passed in so that this
    module need not import it) of a hints file's parsed JSON (:func:`read_hints`); errors name
    ``where``."""
    data = _hint_object(data, "(top level)", where)
    unknown = sorted(set(data) - set(HINTS_FIELDS))
    if unknown:
        raise PlanError(f"{where}: unknown field '{unknown[0]}' (fields: {', '.join(HINTS_FIELDS)})")
    if not isinstance(data.get("mesh", ""), str):
        raise PlanError(f"{where}: field 'mesh': expected a mesh declaration as text")
    _hint_object(data.get("calibration", {}), "calibration", where)
    ops = {}
    for op, figures in _hint_object(data.get("ops", {}), "ops", where).items():
        if op not in PRICED_OPS:
            raise PlanError(f"{where}: field 'ops.{op}': no such collective kind (kinds: {', '.join(PRICED_OPS)})")
        figures = _hint_object(figures, f"ops.{op}", where)
        extra = sorted(set(figures) - {"alpha", "bandwidth", "large"})
        if extra:
            raise PlanError(f"{where}: field 'ops.{op}.{extra[0]}': unknown (fields: alpha, bandwidth, large)")
        ops[op] = _hint_figures(figures, f"ops.{op}.", where)
        if "large" in figures and op == "point_to_point":
            raise PlanError(f"{where}: field 'ops.{op}.large': point-to-point steps have one regime")
        if "large" in figures:
            ops[op]["large"] = _hint_regime(figures["large"], f"ops.{op}.large", where)  # type: ignore[assignment]
    top: dict[str, object] = dict(_hint_figures(data, "", where))
    for key in ("overhead", "copy_bandwidth", "margin"):
        if key in data:
            if isinstance(data[key], list):
                raise PlanError(f"{where}: field '{key}': expected one number, got {json.dumps(data[key])[:60]}")
            top[key] = _hint_figure(data[key], key, where, latency=key != "copy_bandwidth")
    built = model(**top, flops_per_second=_hint_rate(data.get("flops_per_second"), where))  # type: ignore[arg-type]
    ops_costs = [OpCost(op, **{"alpha": built.alpha, "bandwidth": built.bandwidth, **f}) for op, f in ops.items()]
    regimes = [c.large for c in ops_costs if c.large is not None]
    values = [v for c in (built, *ops_costs) for v in (c.alpha, c.bandwidth)]
    values += [v for r in regimes for v in (r.from_bytes, r.alpha, r.bandwidth)]
    lengths = {len(v) for v in values if isinstance(v, tuple)}
    if len(lengths) > 1:
        raise PlanError(f"{where}: per-axis lists of different lengths {sorted(lengths)}: give one per mesh axis")
    return attrs.evolve(built, ops=ops_costs)


def hints_json(model: CostModel) -> dict[str, object]:
    """The JSON form of ``model`` (``ops`` only when it has per-kind figures, other terms only
    when they are not their defaults), as a hints file holds it."""
    out: dict[str, object] = _figures_json(model.alpha, model.bandwidth)
    if model.ops:
        out["ops"] = {c.op: _op_json(c) for c in model.ops}
    if model.flops_per_second is not None:
        out["flops_per_second"] = model.flops_per_second
    if model.overhead:
        out["overhead"] = model.overhead
    if model.copy_bandwidth is not None:
        out["copy_bandwidth"] = model.copy_bandwidth
    if model.margin:
        out["margin"] = model.margin
    return out


def _hint_figure(value: object, field: str, where: str, latency: bool) -> float | tuple[float, ...]:
    """One alpha or bandwidth field of a hints file, checked, or a PlanError naming the field."""
    values = value if isinstance(value, list) else [value]
    if not values:
        raise PlanError(f"{where}: field '{field}': give one number or one per mesh axis, not an empty list")
    for i, v in enumerate(values):
        name = f"{field}[{i}]" if isinstance(value, list) else field
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise PlanError(f"{where}: field '{name}': expected a number, got {json.dumps(v)}")
        if not math.isfinite(v) or v < 0 or (v == 0 and not latency):
            want = "zero or a positive number of seconds" if latency else "a positive number of bytes per second"
            raise PlanError(f"{where}: field '{name}': expected {want}, got {v}")
    return tuple(float(v) for v in values) if isinstance(value, list) else float(value)  # type: ignore[arg-type]


def _hint_figures(data: Mapping[str, object], prefix: str, where: str) -> dict[str, float | tuple[float, ...]]:
    return {
        key: _hint_figure(data[key], prefix + key, where, latency=key == "alpha")
        for key in ("alpha", "bandwidth")
        if key in data
    }


def _hint_object(value: object, field: str, where: str) -> Mapping[str, object]:
    if not isinstance(value, dict):
        raise PlanError(f"{where}: field '{field}': expected an object, got {json.dumps(value)[:60]}")
    return value


def _hint_rate(value: object, where: str) -> float | None:
    """A hints file's ``flops_per_second``: absent, or a positive number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise PlanError(f"{where}: field 'flops_per_second': expected a positive number of flops per second")
    return float(value)


def _op_json(cost: OpCost) -> dict[str, object]:
    out = _figures_json(cost.alpha, cost.bandwidth)
    if cost.large is not None:
        starts = cost.large.from_bytes
        out["large"] = {
            "from_bytes": list(starts) if isinstance(starts, tuple) else starts,
            **_figures_json(cost.large.alpha, cost.large.bandwidth),
        }
    return out


def _hint_regime(value: object, field: str, where: str) -> Regime:
    """A hints file's ``ops.<kind>.large`` (``from_bytes``, ``alpha``, ``bandwidth``, all
    required), checked, or a PlanError naming the field."""
    data = _hint_object(value, field, where)
    fields = ("from_bytes", "alpha", "bandwidth")
    extra = sorted(set(data) - set(fields))
    if extra:
        raise PlanError(f"{where}: field '{field}.{extra[0]}': unknown (fields: {', '.join(fields)})")
    missing = [f for f in fields if f not in data]
    if missing:
        raise PlanError(f"{where}: field '{field}.{missing[0]}': missing (a regime gives {', '.join(fields)})")
    raw = data["from_bytes"]
    for i, v in enumerate(raw if isinstance(raw, list) else [raw]):
        name = f"{field}.from_bytes[{i}]" if isinstance(raw, list) else f"{field}.from_bytes"
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"{where}: field '{name}': expected a positive whole number of bytes, got {json.dumps(v)}")
    if raw == []:
        raise PlanError(f"{where}: field '{field}.from_bytes': give one number or one per mesh axis, not an empty list")
    return Regime(raw, **_hint_figures(data, f"{field}.", where))  # type: ignore[arg-type]


def _figures_json(alpha: float | tuple[float, ...], bandwidth: float | tuple[float, ...]) -> dict[str, object]:
    return {
        "alpha": list(alpha) if isinstance(alpha, tuple) else alpha,
        "bandwidth": list(bandwidth) if isinstance(bandwidth, tuple) else bandwidth,
    }
