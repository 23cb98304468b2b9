"""Routes: how a tensor's local piece travels between its param, grad and state placements.

A route is a list of hops, each a planned reshard of one global shape between two layouts,
the local piece reshaped before the hop when the hop works on another view of it. A block
state needs one hop (``grad -> state``). Flat sharding over axis ``a`` works on the 1-d view
of the base block (the piece without ``a``), so its routes are two hops, e.g. for the
gradient: ``grad -> base (+ grad's partial on a)``, then on the flat view ``R | P(a) -> S(a)``
(one reduce_scatter); the parameter comes back with ``S(a) -> R`` (one all_gather) and
``base -> param``. Every hop is planned by the planner and so costed like any reshard.
"""

from __future__ import annotations

import datetime

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh

import planner
from planner.cost import CostModel
from planner.plan import Plan
from runtime.dtypes import dtype_name
from runtime.executor import reshard
from shardlang.layout import Layout


@attrs.frozen
class Hop:
    src: Layout
    dst: Layout
    shape: tuple[int, ...]
    # The local shape to view the piece as before the hop (None: as it comes).
    view: tuple[int, ...] | None = None


@attrs.frozen
class Route:
    hops: tuple[Hop, ...]
    # The cost model the hops are planned under (a spec's hints for the tensor's mesh).
    cost: CostModel = attrs.field(factory=CostModel)

    def plan(self, hop: Hop, dtype: torch.dtype) -> Plan:
        return planner.plan(hop.src, hop.dst, hop.shape, dtype_name(dtype), self.cost)

    def plans(self, dtype: torch.dtype) -> tuple[Plan, ...]:
        return tuple(self.plan(h, dtype) for h in self.hops if h.src != h.dst)

    def run(
        self,
        local: torch.Tensor,
        *,
        name: str,
        device_mesh: DeviceMesh | None,
        timeout: datetime.timedelta,
    ) -> torch.Tensor:
        """The rank's piece at the end of the route (``local`` itself when nothing moves)."""
        for hop in self.hops:
            if hop.view is not None:
                local = local.reshape(hop.view)
            if hop.src != hop.dst:
                local = reshard(
                    local,
                    hop.src,
                    hop.dst,
                    global_shape=hop.shape,
                    mesh=device_mesh,
                    plan=self.plan(hop, local.dtype),
                    timeout=timeout,
                    name=name,
                )
        return local


def flat_view(layout: Layout, axis: int) -> tuple[Layout, Layout]:
    """The 1-d layouts of a flattened base block: as it arrives (partial over ``axis`` when
    ``layout`` is, else replicated) and as the state holds it (split over ``axis``)."""
    partial = tuple((a, op) for a, op in layout.partial if a == axis)
    return Layout(dims=((),), mesh=layout.mesh, partial=partial), Layout(dims=((axis,),), mesh=layout.mesh)


def without_axis(layout: Layout, axis: int) -> Layout:
    """``layout``'s dims with ``axis`` taken out (the base of flat sharding over ``axis``)."""
    return Layout(dims=tuple(tuple(a for a in axes if a != axis) for axes in layout.dims), mesh=layout.mesh)
