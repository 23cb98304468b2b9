"""The cost model: bytes sent per rank and latency rounds of each step, and their time.

Sizes use padded pieces (``Layout.local_shape``). For a step on mesh axis ``a`` of size ``n``,
with ``b`` the local bytes of the state it starts from and ``b'`` of the state it ends in:

=============== ========================================================= ==========
op              bytes sent per rank                                       rounds
=============== ========================================================= ==========
all_gather      (n-1) * b                                                 n-1
reduce_scatter  (n-1) * b'                                                n-1
all_reduce      2 * (n-1) * ceil(E/n) * itemsize, E = local elements      2(n-1)
all_to_all      (n-1) * (b with dim j's local length cut to ceil(Lj/n))   n-1
slice, partial  0                                                         0
=============== ========================================================= ==========

Step time = rounds * alpha[a] + bytes / bandwidth[a] + overhead + copied / copy_bandwidth; plan
time = sum of step times.

Local copies (``copied``): the elements a collective step copies to pack its blocks and unpack
its result, by the copy table of ``planner.copies`` (:func:`~planner.copies.copy_elements`),
times the itemsize.

Executor terms (both measured by ``shardlang calibrate``, both free in the default model;
docs/calibration.md says what they stand for and how they are fitted). ``overhead`` is the
fixed cost of one step of any kind, local steps included (the executor's own work per step:
dispatch, views, the buffer it allocates); a collective's measured fixed cost beyond it is its
``alpha``. ``copy_bandwidth`` prices local copies: each collective step's ``copied`` bytes
(above), each point-to-point step's (:func:`exchange_copy_elements`: the boxes a rank keeps,
and the messages it packs or places because they are not one run of its piece), and the copy
of the target piece that a plan which sends nothing makes (the executor returns fresh memory: a
plan of slice and partial steps only ends in a copy of its result), added to that plan's last
step; ``None`` means free, so the default model prices none of them.

The choice margin (``margin``, seconds; 0 in the default model): not a time, but what the search
charges every step beside the overhead when it compares plans, so that a plan of more steps is
taken only where it is predicted to save more than the margin for each step it adds.
``shardlang calibrate`` sets it to how far its fitted lines typically miss a sample
(``planner.fit``): a smaller predicted saving is not known to be one. Step and plan seconds
never include it (docs/calibration.md, "The choice margin").

Per-collective figures. A model may give any of the priced kinds (:data:`PRICED_OPS`) its own
per-axis alpha and bandwidth (``CostModel.ops``, e.g. measured by ``shardlang calibrate``,
docs/tutorials/calibrating.md); a kind it does not name uses the model's own ``alpha`` and ``bandwidth``. The
formula stays ``rounds * alpha[op][a] + bytes / bandwidth[op][a]``, with the rounds and bytes of
the table, so a measured figure is the per-round latency and the bandwidth that make the table
true for that kind on that axis. ``CostModel.from_file`` reads such a model from a hints file.
Point-to-point steps (``planner.p2p``) are priced per rank from their messages and links; that
model is documented there.

Large messages (:class:`Regime`). A collective kind may also give figures of its own for steps
of at least ``from_bytes`` (the table's bytes, per axis): a step is priced by the one regime its
bytes fall in, so the kind's time is a line in the bytes up to the break and another line from
it, as ``shardlang calibrate`` fits where a backend's time per byte changes with the message
(docs/calibration.md). The search keeps its exact comparison (the large regime is one more
pseudo-kind on the integer scale, :func:`large_key`), its lower bound (``planner.bound``: each
kind at the least rates of its regimes) and its pruning rules (``planner.space``: a rule holds on an axis
only if it holds for every pair of regimes). Point-to-point steps have one regime.

The search compares times exactly: :func:`planner.units.integer_rates` scales the model so that
every step time is an integer, so equal-time plans compare equal whatever the order of their
steps, and the fewer-steps rule decides between them. The overhead and the margin are on the
same scale (the pseudo-kind :data:`STEP` of :meth:`CostModel.figures`): every move of the search
pays them, the lower bound charges them only for the steps each axis still needs at least (so it
stays admissible, ``planner.bound``), and the pruning rules of
``planner.space``, which never trade a plan for one with more steps, stay exact. A step's
``copied`` bytes are on that scale too (the per-byte figure of the pseudo-kind :data:`COPY`),
and the bound leaves them out as well (they are never negative); ``planner.space`` says which
pruning rule they touch. The copy of a plan that sends nothing is not part of the search's
comparison: it exists only when slices alone reach the target, and then every other plan
communicates and writes a buffer at least as large as the target piece (docs/calibration.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from planner.errors import PlanError
from planner.hints import hints_json, hints_model, read_hints
from planner.op_costs import PRICED_OPS, OpCost, Regime, check_figures, op_costs, per_axis
from shardlang.mesh import Mesh
from shardlang.spec import CostHints

DEFAULT_ALPHA = 5e-6
DEFAULT_BANDWIDTH = 1e11

# The pseudo-kind of :meth:`CostModel.figures` whose per-round figure is the per-step overhead
# and choice margin.
STEP = "step"
# The pseudo-kind whose bandwidth is the copy bandwidth (only in a model that prices copies).
COPY = "copy"
LOCAL_OPS = ("slice", "partial")


def _axis_values(what: str, value: float | tuple[float, ...], mesh: Mesh) -> tuple[float, ...]:
    if isinstance(value, float):
        return (value,) * mesh.ndim
    if len(value) != mesh.ndim:
        raise PlanError(f"{what} gives {len(value)} values for the {mesh.ndim}-axis {mesh.describe()}")
    return value


def _regime_values(op: str, large: Regime, mesh: Mesh) -> tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]]:
    """Per axis (from_bytes, alpha, bandwidth) of ``op``'s large-message regime on ``mesh``."""
    counts = large.from_bytes if isinstance(large.from_bytes, tuple) else (large.from_bytes,) * mesh.ndim
    if len(counts) != mesh.ndim:
        raise PlanError(f"{op} from_bytes gives {len(counts)} values for the {mesh.ndim}-axis {mesh.describe()}")
    alphas = _axis_values(f"{op} large-message latency", large.alpha, mesh)
    return counts, alphas, _axis_values(f"{op} large-message bandwidth", large.bandwidth, mesh)


def large_key(op: str) -> str:
    """The pseudo-kind of :meth:`CostModel.figures` that prices ``op``'s large messages."""
    return f"{op} large"


def priced_as(op: str, axis: int, nbytes: int, large_from: Mapping[str, tuple[int, ...]]) -> str:
    """The kind of :meth:`CostModel.figures` that prices a step of ``op`` sending ``nbytes`` on
    ``axis``: ``op``, or :func:`large_key` where ``large_from`` (:meth:`CostModel.large_from`)
    says its bytes are large."""
    starts = large_from.get(op)
    return op if starts is None or nbytes < starts[axis] else large_key(op)


@attrs.frozen(cache_hash=True)  # a key of every plan and bucket kind: hashed once, not per lookup
class CostModel:
    """Latency ``alpha`` (seconds per round) and ``bandwidth`` (bytes/s), each one number for
    every mesh axis or a tuple with one number per axis."""

    alpha: float | tuple[float, ...] = attrs.field(default=DEFAULT_ALPHA, converter=per_axis)
    bandwidth: float | tuple[float, ...] = attrs.field(default=DEFAULT_BANDWIDTH, converter=per_axis)

    ops: tuple[OpCost, ...] = attrs.field(default=(), converter=op_costs)
    # Matrix-product flops per second of one rank (``shardlang calibrate``'s timed matmuls),
    # which prices compute beside communication (Muon's iterations, ``planner.matrices``);
    # ``None``: the stated default rate of ``planner.owners``.
    flops_per_second: float | None = None
    # The executor terms (module docstring): seconds per step, and bytes/s of a local copy.
    overhead: float = attrs.field(default=0.0, converter=float)
    copy_bandwidth: float | None = attrs.field(default=None, converter=attrs.converters.optional(float))
    # The choice margin (module docstring): seconds a step must save to be taken; not a time.
    margin: float = attrs.field(default=0.0, converter=float)

    def __attrs_post_init__(self) -> None:
        check_figures(self.alpha, self.bandwidth, "")
        if not math.isfinite(self.overhead) or self.overhead < 0:
            raise PlanError(f"the step overhead must be finite and zero or positive, got {self.overhead}")
        if not math.isfinite(self.margin) or self.margin < 0:
            raise PlanError(f"the choice margin must be finite and zero or positive, got {self.margin}")
        if self.copy_bandwidth is not None and not (math.isfinite(self.copy_bandwidth) and self.copy_bandwidth > 0):
            raise PlanError(f"the copy bandwidth must be finite and positive, got {self.copy_bandwidth}")
        if self.flops_per_second is not None and not (
            isinstance(self.flops_per_second, (int, float))
            and math.isfinite(self.flops_per_second)
            and self.flops_per_second > 0
        ):
            raise PlanError(f"flops_per_second must be a positive number, got {self.flops_per_second!r}")

    @classmethod
    def from_file(cls, path: str | Path) -> CostModel:
        """The model of a hints file (JSON; docs/reference/cost-model.md), read and checked by
        :func:`planner.hints.read_hints`: a :class:`PlanError` naming the file and the field when
        it is unreadable or a value is bad."""
        return read_hints(path, cls)

    @classmethod
    def from_json(cls, data: object, where: str = "the cost hints") -> CostModel:
        """The model of a hints file's parsed JSON (:func:`planner.hints.hints_model`); errors name ``where``."""
        return hints_model(data, cls, where)

    def to_json(self) -> dict[str, object]:
        """The JSON form, as a hints file holds it (:func:`planner.hints.hints_json`)."""
        return hints_json(self)

    @classmethod
    def from_hints(cls, hints: CostHints) -> CostModel:
        """The model a spec file's mesh declaration asks for, defaults where it is silent: one
        object per hints, so that the plan and bucket caches, keyed by models, find equal
        ones by identity (suggest looks them up hundreds of thousands of times at scale)."""
        return _hinted(cls, hints)

    def with_overrides(
        self, alpha: float | tuple[float, ...] | None = None, bandwidth: float | tuple[float, ...] | None = None
    ) -> CostModel:
        """This model with ``alpha`` and ``bandwidth`` replaced where they are given (not ``None``);
        per-collective figures and every other term are kept."""
        if alpha is None and bandwidth is None:
            return self
        return attrs.evolve(
            self,
            alpha=self.alpha if alpha is None else alpha,
            bandwidth=self.bandwidth if bandwidth is None else bandwidth,
        )

    def for_mesh(self, mesh: Mesh) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per-axis (alpha, bandwidth) for ``mesh``; a :class:`PlanError` if lengths differ."""
        for c in self.ops:
            _axis_values(f"{c.op} latency", c.alpha, mesh)
            _axis_values(f"{c.op} bandwidth", c.bandwidth, mesh)
            if c.large is not None:
                _regime_values(c.op, c.large, mesh)
        return _axis_values("latency", self.alpha, mesh), _axis_values("bandwidth", self.bandwidth, mesh)

    def for_op(self, op: str, mesh: Mesh) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per-axis (alpha, bandwidth) of the kind ``op`` for ``mesh``: its own figures where the
        model gives them, else the model's (slice and partial steps, which send nothing, too)."""
        for c in self.ops:
            if c.op == op:
                return _axis_values(f"{op} latency", c.alpha, mesh), _axis_values(f"{op} bandwidth", c.bandwidth, mesh)
        return _axis_values("latency", self.alpha, mesh), _axis_values("bandwidth", self.bandwidth, mesh)

    def large_from(self, mesh: Mesh) -> dict[str, tuple[int, ...]]:
        """Per collective kind with a large-message regime, the bytes per axis where it starts."""
        return {c.op: _regime_values(c.op, c.large, mesh)[0] for c in self.ops if c.large is not None}

    def on_axis(self, op: str, mesh: Mesh, axis: int) -> OpCost:
        """The figures of the kind ``op`` on mesh ``axis`` alone (for a one-axis mesh), its
        large-message regime included."""
        alphas, bandwidths = self.for_op(op, mesh)
        large = None
        for c in self.ops:
            if c.op == op and c.large is not None:
                starts, large_alphas, large_bandwidths = _regime_values(op, c.large, mesh)
                large = Regime(starts[axis], large_alphas[axis], large_bandwidths[axis])
        return OpCost(op, alphas[axis], bandwidths[axis], large)

    def figures_at(self, op: str, mesh: Mesh, axis: int, nbytes: int) -> tuple[float, float]:
        """(alpha, bandwidth) of a step of ``op`` sending ``nbytes`` on ``axis``: of the regime
        its bytes fall in (module docstring)."""
        key = (self, op, mesh.ndim)
        figures = _FIGURES_AT.get(key)
        if figures is None:
            large = next((c.large for c in self.ops if c.op == op and c.large is not None), None)
            figures = (None if large is None else _regime_values(op, large, mesh), self.for_op(op, mesh))
            if len(_FIGURES_AT) >= 1024:
                _FIGURES_AT.clear()
            _FIGURES_AT[key] = figures
        regime, (alphas, bandwidths) = figures
        if regime is not None and nbytes >= regime[0][axis]:
            return regime[1][axis], regime[2][axis]
        return alphas[axis], bandwidths[axis]

    def figures(self, mesh: Mesh) -> dict[str, tuple[tuple[float, ...], tuple[float, ...]]]:
        """:meth:`for_op` of every op a plan step can have, under :func:`large_key` the figures
        of each large-message regime, and under :data:`STEP` the overhead and the choice margin
        per axis as its per-round figure (with the model's bandwidths, so that the integer scale
        of :func:`integer_op_rates` covers it and changes nothing else): what the search charges
        every step beyond its kind's figures."""
        out = {op: self.for_op(op, mesh) for op in (*PRICED_OPS, *LOCAL_OPS)}
        for c in self.ops:
            if c.large is not None:
                out[large_key(c.op)] = _regime_values(c.op, c.large, mesh)[1:]
        out[STEP] = ((self.overhead + self.margin,) * mesh.ndim, _axis_values("bandwidth", self.bandwidth, mesh))
        if self.copy_bandwidth is not None:
            out[COPY] = ((0.0,) * mesh.ndim, (self.copy_bandwidth,) * mesh.ndim)
        return out

    def copy_seconds(self, nbytes: int) -> float:
        """A local copy of ``nbytes``: a step's ``copied`` bytes, or the target piece of a plan
        that sends nothing."""
        return 0.0 if self.copy_bandwidth is None else nbytes / self.copy_bandwidth


@functools.lru_cache(maxsize=64)
def _hinted(cls: type[CostModel], hints: CostHints) -> CostModel:
    return cls().with_overrides(alpha=hints.latency, bandwidth=hints.bandwidth)


# Shared by every request that names no model (building one runs its checks; plans are memoized).
DEFAULT_COST = CostModel()
# (model, op, mesh axes) -> the figures figures_at picks from: a bucket's time reads them, and
# suggest times hundreds of thousands of buckets (the figures depend on the number of axes only).
_FIGURES_AT: dict[tuple[CostModel, str, int], tuple[Any, tuple[tuple[float, ...], tuple[float, ...]]]] = {}


def collective_rounds(op: str, n: int) -> int:
    """The rounds column of the table: latency rounds of ``op`` on a mesh axis of size ``n``."""
    if op in LOCAL_OPS:
        return 0
    return 2 * (n - 1) if op == "all_reduce" else n - 1
