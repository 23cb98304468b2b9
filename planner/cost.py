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

Step time = rounds * alpha[a] + bytes / bandwidth[a]; plan time = sum of step times.
Point-to-point steps (``planner.p2p``) are priced per rank from their messages and links; that
model is documented there.

The search compares times exactly: :func:`integer_rates` scales the model so that
every step time is an integer, so equal-time plans compare equal whatever the order of their
steps, and the fewer-steps rule decides between them.
"""

from __future__ import annotations

import functools
import math

import attrs

from shardlang.errors import ShardlangError
from shardlang.mesh import Mesh
from shardlang.spec import CostHints

DEFAULT_ALPHA = 5e-6
DEFAULT_BANDWIDTH = 1e11


class PlanError(ShardlangError):
    """No plan exists (or the request is malformed): names the layouts and the reason."""


class PlanBudgetError(PlanError):
    """The search for a plan used up its budget (``max_states``, see ``planner.search``) before
    it finished: names the pair, the budget, and what to change."""


def _per_axis(value: object) -> float | tuple[float, ...]:
    try:
        if isinstance(value, (int, float)):
            return float(value)
        return tuple(float(v) for v in value)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise PlanError(f"a latency or bandwidth is a number or one number per mesh axis, not {value!r}") from None


@attrs.frozen
class CostModel:
    """Latency ``alpha`` (seconds per round) and ``bandwidth`` (bytes/s), each one number for
    every mesh axis or a tuple with one number per axis."""

    alpha: float | tuple[float, ...] = attrs.field(default=DEFAULT_ALPHA, converter=_per_axis)
    bandwidth: float | tuple[float, ...] = attrs.field(default=DEFAULT_BANDWIDTH, converter=_per_axis)

    def __attrs_post_init__(self) -> None:
        alphas = self.alpha if isinstance(self.alpha, tuple) else (self.alpha,)
        betas = self.bandwidth if isinstance(self.bandwidth, tuple) else (self.bandwidth,)
        if not alphas or not all(math.isfinite(a) and a >= 0 for a in alphas):
            raise PlanError(f"latency (alpha) must be finite and zero or positive, got {self.alpha}")
        if not betas or not all(math.isfinite(b) and b > 0 for b in betas):
            raise PlanError(f"bandwidth must be finite and positive, got {self.bandwidth}")

    @classmethod
    def from_hints(cls, hints: CostHints) -> CostModel:
        """The model a spec file's mesh declaration asks for, defaults where it is silent."""
        return cls().with_overrides(alpha=hints.latency, bandwidth=hints.bandwidth)

    def with_overrides(
        self, alpha: float | tuple[float, ...] | None = None, bandwidth: float | tuple[float, ...] | None = None
    ) -> CostModel:
        """This model with ``alpha`` and ``bandwidth`` replaced where they are given (not ``None``)."""
        return CostModel(
            alpha=self.alpha if alpha is None else alpha,
            bandwidth=self.bandwidth if bandwidth is None else bandwidth,
        )

    def for_mesh(self, mesh: Mesh) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per-axis (alpha, bandwidth) for ``mesh``; a :class:`PlanError` if lengths differ."""
        out = []
        for what, value in (("latency", self.alpha), ("bandwidth", self.bandwidth)):
            if isinstance(value, float):
                out.append((value,) * mesh.ndim)
            elif len(value) != mesh.ndim:
                raise PlanError(f"{what} gives {len(value)} values for the {mesh.ndim}-axis {mesh.describe()}")
            else:
                out.append(value)
        return out[0], out[1]

    def to_json(self) -> dict[str, object]:
        return {
            "alpha": list(self.alpha) if isinstance(self.alpha, tuple) else self.alpha,
            "bandwidth": list(self.bandwidth) if isinstance(self.bandwidth, tuple) else self.bandwidth,
        }


# Shared by every request that names no model (building one runs its checks; plans are memoized).
DEFAULT_COST = CostModel()


def collective_rounds(op: str, n: int) -> int:
    """The rounds column of the table: latency rounds of ``op`` on a mesh axis of size ``n``."""
    if op in ("slice", "partial"):
        return 0
    return 2 * (n - 1) if op == "all_reduce" else n - 1


@functools.lru_cache(maxsize=256)
def integer_rates(alpha: tuple[float, ...], bandwidth: tuple[float, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-axis (units per round, units per byte): the integers ``alpha[a] * D`` and
    ``D / bandwidth[a]`` for one common scale ``D``, so that a step's time times ``D`` is the
    integer ``rounds * units_per_round[a] + bytes * units_per_byte[a]``, exactly."""
    # Floats are exact ratios of integers: alpha = p / q, and 1 / bandwidth = q / p.
    ratios = {value: value.as_integer_ratio() for value in {*alpha, *bandwidth}}
    scale = math.lcm(*{ratios[a][1] for a in alpha}, *{ratios[b][0] for b in bandwidth})
    per_round = tuple(ratios[a][0] * (scale // ratios[a][1]) for a in alpha)
    per_byte = tuple(ratios[b][1] * (scale // ratios[b][0]) for b in bandwidth)
    return per_round, per_byte
