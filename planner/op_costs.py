"""The figures one collective kind is priced by (``planner.cost``'s ``ops``): its own
latency and bandwidth (:class:`OpCost`), and its figures for large messages
(:class:`Regime`), each checked as it is built. Below both ``planner.cost``, whose
:class:`~planner.cost.CostModel` holds them, and ``planner.hints``, which reads them from
files, so that neither of those imports the other's user."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs

from planner.errors import PlanError

N = TypeVar("N", int, float)


def _one_or_per_axis(value: object, number: Callable[[Any], N], what: str) -> N | tuple[N, ...]:
    """``value`` as one ``number`` for every mesh axis or a tuple of one per axis; a
    :class:`PlanError` saying ``what`` it is where it is neither."""
    try:
        if isinstance(value, (int, float)):
            return number(value)
        return tuple(number(v) for v in value)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise PlanError(f"{what}, not {value!r}") from None


def per_axis(value: object) -> float | tuple[float, ...]:
    return _one_or_per_axis(value, float, "a latency or bandwidth is a number or one number per mesh axis")


# The collective kinds a model may price apart; slice and partial steps send nothing.
PRICED_OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "point_to_point")


def check_figures(alpha: float | tuple[float, ...], bandwidth: float | tuple[float, ...], of: str) -> None:
    alphas = alpha if isinstance(alpha, tuple) else (alpha,)
    betas = bandwidth if isinstance(bandwidth, tuple) else (bandwidth,)
    if not alphas or not all(math.isfinite(a) and a >= 0 for a in alphas):
        raise PlanError(f"{of}latency (alpha) must be finite and zero or positive, got {alpha}")
    if not betas or not all(math.isfinite(b) and b > 0 for b in betas):
        raise PlanError(f"{of}bandwidth must be finite and positive, got {bandwidth}")


def _byte_counts(value: object) -> int | tuple[int, ...]:
    return _one_or_per_axis(value, int, "from_bytes is a byte count or one per mesh axis")


@attrs.frozen
class Regime:
    """A collective kind's figures for steps of at least ``from_bytes`` bytes (the table's,
    per rank; module docstring): ``from_bytes``, ``alpha`` and ``bandwidth`` each one number
    for every mesh axis or one per axis."""

    from_bytes: int | tuple[int, ...] = attrs.field(converter=_byte_counts)
    alpha: float | tuple[float, ...] = attrs.field(converter=per_axis)
    bandwidth: float | tuple[float, ...] = attrs.field(converter=per_axis)

    def __attrs_post_init__(self) -> None:
        counts = self.from_bytes if isinstance(self.from_bytes, tuple) else (self.from_bytes,)
        if not counts or min(counts) < 1:
            raise PlanError(f"a large-message regime starts at 1 byte or more, got from_bytes={self.from_bytes}")
        check_figures(self.alpha, self.bandwidth, "large messages: ")


def _regime(value: object) -> Regime | None:
    if value is None or isinstance(value, Regime):
        return value
    if isinstance(value, Mapping):
        try:
            return Regime(**value)
        except TypeError:
            pass
    raise PlanError(f"large messages are a Regime or {{from_bytes, alpha, bandwidth}}, not {value!r}")


def _op_cost_repr(cost: OpCost) -> str:
    """An OpCost's repr, ``large`` only where it has one (so older reprs read the same)."""
    large = "" if cost.large is None else f", large={cost.large!r}"
    return f"OpCost(op={cost.op!r}, alpha={cost.alpha!r}, bandwidth={cost.bandwidth!r}{large})"


@attrs.frozen(repr=False)
class OpCost:
    """One collective kind's own latency ``alpha`` (seconds per round) and ``bandwidth``
    (bytes/s), each one number for every mesh axis or one per axis; ``large``: its figures for
    large messages (:class:`Regime`), if they differ."""

    op: str
    alpha: float | tuple[float, ...] = attrs.field(converter=per_axis)
    bandwidth: float | tuple[float, ...] = attrs.field(converter=per_axis)
    large: Regime | None = attrs.field(default=None, converter=lambda v: _regime(v))

    def __attrs_post_init__(self) -> None:
        if self.op not in PRICED_OPS:
            raise PlanError(f"no collective kind '{self.op}' to price (kinds: {', '.join(PRICED_OPS)})")
        check_figures(self.alpha, self.bandwidth, f"{self.op}: ")
        if self.large is not None and self.op == "point_to_point":
            raise PlanError("point_to_point steps have one regime (planner.p2p prices them message by message)")

    __repr__ = _op_cost_repr


def op_costs(value: object) -> tuple[OpCost, ...]:
    """``ops`` as OpCosts in :data:`PRICED_OPS` order, from OpCosts or ``{op: {alpha, bandwidth}}``."""
    if isinstance(value, Mapping):
        try:
            items = [v if isinstance(v, OpCost) else OpCost(op, **v) for op, v in value.items()]
        except TypeError:
            raise PlanError(f"ops maps a collective kind to its alpha and bandwidth, not {value!r}") from None
    else:
        items = list(value)  # type: ignore[call-overload]
    if not all(isinstance(c, OpCost) for c in items) or len({c.op for c in items}) != len(items):
        raise PlanError(f"ops gives each collective kind at most one OpCost, got {value!r}")
    return tuple(sorted(items, key=lambda c: PRICED_OPS.index(c.op)))
