"""Plans as data: frozen step records that can be printed, saved as JSON and executed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, get_args

import attrs

from planner.copies import copy_elements, exchange_copy_elements
from planner.cost import CostModel
from planner.errors import PlanError
from planner.holdings import receive_lower_bound
from planner.transfers import Transfer
from shardlang.dtypes import itemsize
from shardlang.errors import ShardlangError
from shardlang.layout import Layout, ReduceOp
from shardlang.mesh import Mesh
from shardlang.parser import parse_layout, parse_mesh

if TYPE_CHECKING:
    from planner.pattern import ExchangePattern

# The baseline move set (README, "The planner"): one mesh axis per step. The default, and the move
# set whose optimum the shared conformance data records.
BaselineOp = Literal["slice", "partial", "all_gather", "all_to_all", "reduce_scatter", "all_reduce"]
Op = Literal[BaselineOp, "point_to_point"]
BASELINE_OPS: tuple[BaselineOp, ...] = get_args(BaselineOp)
OPS: tuple[Op, ...] = (*BASELINE_OPS, "point_to_point")
COMMUNICATING_OPS = ("all_gather", "all_to_all", "reduce_scatter", "all_reduce", "point_to_point")


@attrs.frozen
class Step:
    """One move: a collective or local move on one mesh axis, or a point-to-point exchange.

    ``dim`` is the tensor dim the axis leaves (all_gather, all_to_all) or joins (slice,
    reduce_scatter); ``to_dim`` is the dim it joins in an all_to_all; ``reduce_op`` is the
    reduction of reduce_scatter, all_reduce and partial. ``layout`` is the state after the
    step; ``seconds`` is the modeled time. ``bytes`` are sent per rank by a collective; for a
    ``point_to_point`` step (``axis`` None, its messages in ``transfers``, possibly between
    two meshes) they are the largest per-rank max(sent, received).

    ``transfers`` is a tuple, or for a large step whose senders take turns an
    :class:`~planner.pattern.ExchangePattern` that describes them (iterating it lists them all;
    :meth:`transfers_of` gives one rank's without the others, :meth:`Plan.expanded` the list).
    """

    op: Op
    axis: int | None
    dim: int | None
    to_dim: int | None
    reduce_op: ReduceOp | None
    layout: Layout
    bytes: int
    seconds: float
    transfers: tuple[Transfer, ...] | ExchangePattern = ()

    @property
    def message_count(self) -> int:
        """The messages over the wire of a point-to-point step: its transfers but local copies."""
        if not isinstance(self.transfers, tuple):
            return self.transfers.message_count
        return sum(t.src_rank != t.dst_rank for t in self.transfers)

    def transfers_of(self, rank: int) -> tuple[Transfer, ...]:
        """The transfers global ``rank`` sends, receives or copies, in the order of the step's list."""
        if not isinstance(self.transfers, tuple):
            return self.transfers.transfers_of(rank)
        return tuple(t for t in self.transfers if rank in (t.src_rank, t.dst_rank))

    def expanded(self) -> Step:
        """This step with its transfers as a list (itself when they are one)."""
        return self if isinstance(self.transfers, tuple) else attrs.evolve(self, transfers=self.transfers.expanded())

    def describe(self) -> str:
        """``all_gather(axis=1, dim=0)``: the op and its arguments, without the cost."""
        if self.axis is None:  # point_to_point
            return f"{self.op}(messages={self.message_count})"
        args = [f"axis={self.layout.mesh.axis_label(self.axis)}"]
        if self.dim is not None:
            args.append(f"dim={self.dim}")
        if self.to_dim is not None:
            args.append(f"to_dim={self.to_dim}")
        if self.reduce_op is not None:
            args.append(f"op={self.reduce_op}")
        return f"{self.op}({', '.join(args)})"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "op": self.op,
            "axis": self.axis,
            "dim": self.dim,
            "to_dim": self.to_dim,
            "reduce_op": self.reduce_op,
            "layout": str(self.layout),
            "bytes": self.bytes,
            "seconds": self.seconds,
        }
        if self.op == "point_to_point":
            patterned = not isinstance(self.transfers, tuple)
            out["transfers"] = (
                {"pattern": self.transfers.to_json()} if patterned else [t.to_json() for t in self.transfers]
            )
        return out


# The hash is cached: the runtime looks plans up by value on every reshard(plan=...) call, and
# a point-to-point plan holds one record per message.
@attrs.frozen(cache_hash=True)
class Plan:
    """The steps that take a tensor of ``shape`` and ``dtype`` from ``src`` to ``dst``."""

    src: Layout
    dst: Layout
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(x) for x in s))
    dtype: str
    steps: tuple[Step, ...]
    cost: CostModel = attrs.field(factory=CostModel)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.steps)

    @property
    def total_seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    @property
    def lower_bound_bytes(self) -> int:
        """The receive lower bound of the pair (``planner.holdings``): the largest, over target
        ranks, of the bytes of its target piece that a target rank does not already hold."""
        return receive_lower_bound(self.src, self.dst, self.shape, self.dtype)

    @property
    def collectives(self) -> tuple[Step, ...]:
        """The steps that communicate (everything but slice and partial)."""
        return tuple(s for s in self.steps if s.op in COMMUNICATING_OPS)

    def layouts(self) -> tuple[Layout, ...]:
        """Every state the tensor passes through, ``src`` first and ``dst`` last."""
        return (self.src, *(s.layout for s in self.steps))

    def copied_bytes(self) -> tuple[int, ...]:
        """Per step, the most bytes a rank copies locally: a collective to pack its blocks and
        unpack its result (``planner.copies.copy_elements``), a point-to-point step its kept boxes
        and the messages it packs or places (``planner.copies.exchange_copy_elements``); 0 for
        local steps."""
        copied = []
        for before, step in zip(self.layouts(), self.steps, strict=False):
            if step.axis is None and not isinstance(step.transfers, tuple):  # pattern-valued: its table
                copied.append(step.transfers.most_copied_elements() * itemsize(self.dtype))
                continue
            if step.axis is None:  # point_to_point
                elements = exchange_copy_elements(
                    ((t.src_rank, t.dst_rank, t.box) for t in step.transfers),
                    lambda r, layout=before: layout.rank_piece(self.shape, r),
                    lambda r, layout=step.layout: layout.rank_piece(self.shape, r),
                )
                copied.append(max(elements.values(), default=0) * itemsize(self.dtype))
                continue
            n = step.layout.mesh.shape[step.axis]
            old, new = before.local_shape(self.shape), step.layout.local_shape(self.shape)
            copied.append(copy_elements(step.op, n, step.dim, step.to_dim, old, new) * itemsize(self.dtype))
        return tuple(copied)

    def expanded(self) -> Plan:
        """This plan with every point-to-point step's transfers as a list (``shardlang plan --expand``)."""
        return attrs.evolve(self, steps=tuple(s.expanded() for s in self.steps))

    def to_json(self) -> dict[str, Any]:
        meshes = {lay.mesh.name: lay.mesh.text() for lay in (self.src, self.dst) if lay.mesh.name is not None}
        out: dict[str, Any] = {
            "src": str(self.src),
            "dst": str(self.dst),
            "shape": list(self.shape),
            "dtype": self.dtype,
            "steps": [s.to_json() for s in self.steps],
            "total_bytes": self.total_bytes,
            "total_seconds": self.total_seconds,
            "lower_bound_bytes": self.lower_bound_bytes,
            "cost": self.cost.to_json(),
        }
        if meshes:
            out["meshes"] = meshes
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        """Read back what :meth:`to_json` wrote (declared meshes come from ``"meshes"``: each
        name, and its mesh's text, :meth:`Mesh.text`)."""
        try:
            meshes = {name: parse_mesh(text) for name, text in data.get("meshes", {}).items()}
            misnamed = [name for name, mesh in meshes.items() if mesh.name != name]
            if misnamed:
                raise ValueError(f"the mesh under {misnamed[0]!r} is {data['meshes'][misnamed[0]]!r}")
            steps = tuple(_step_from_json(s, meshes) for s in data["steps"])
            return cls(
                src=parse_layout(data["src"], meshes),
                dst=parse_layout(data["dst"], meshes),
                shape=tuple(data["shape"]),
                dtype=str(data["dtype"]),
                steps=steps,
                cost=CostModel(**data.get("cost", {})),
            )
        except ShardlangError as e:
            raise PlanError(f"not a plan in JSON form: {e.message}") from None
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise PlanError(f"not a plan in JSON form: {type(e).__name__}: {e}") from None


def _step_from_json(data: Mapping[str, Any], meshes: Mapping[str, Mesh]) -> Step:
    if data["op"] not in OPS:
        raise ValueError(f"unknown op {data['op']!r} (expected one of {', '.join(OPS)})")
    return Step(
        op=data["op"],
        axis=None if data["axis"] is None else int(data["axis"]),
        dim=None if data["dim"] is None else int(data["dim"]),
        to_dim=None if data["to_dim"] is None else int(data["to_dim"]),
        reduce_op=data["reduce_op"],
        layout=parse_layout(data["layout"], meshes),
        bytes=int(data["bytes"]),
        seconds=float(data["seconds"]),
        transfers=_transfers_from_json(data.get("transfers", ()), meshes),
    )


def _transfers_from_json(data: Any, meshes: Mapping[str, Mesh]) -> tuple[Transfer, ...] | ExchangePattern:
    if isinstance(data, Mapping):
        from planner.pattern import ExchangePattern

        return ExchangePattern.from_json(data["pattern"], meshes)
    return tuple(Transfer(int(t["src"]), int(t["dst"]), t["box"]) for t in data)
