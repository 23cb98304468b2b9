"""The layouts of DTensor parameters and gradients, for the sharded optimizers.

A DTensor's layout is its placements (``shardlang.interop.from_dtensor``: ``_StridedShard``
and ``shard_order`` read as nesting orders). A DTensor on a sub-mesh of the spec's mesh (TP
on ``mesh["tp"]`` inside a ``[dp, tp]`` job) is lifted to the spec's mesh, replicated over the
axes it leaves out, and its gradient then takes the spec's grad layout, which says what the
DTensor cannot: that the gradient still pends a reduction over those axes (``P(dp):avg``).
That layout must agree with the DTensor's gradient on the sub-mesh's axes. See the README,
"DTensor parameters".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.device_mesh import DeviceMesh

from runtime.optim.errors import OptimizerError
from shardlang.errors import ShardlangError
from shardlang.interop import from_dtensor, lift_layout
from shardlang.layout import Layout
from shardlang.spec import TensorSpec

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def dtensor_param_layouts(param: DTensor, entry: TensorSpec | None) -> tuple[Layout, Layout | None, DeviceMesh | None]:
    """A DTensor parameter's param layout, the grad layout the spec gives it (``None``: read
    from each gradient) and the device mesh whose groups its reshards may use."""
    layout = from_dtensor(param)
    if entry is None or layout.mesh.same_geometry(entry.state().mesh):
        return layout, None, param.device_mesh
    lifted = lift_layout(layout, entry.param.mesh)
    if lifted != entry.param:
        raise OptimizerError(
            f"the DTensor lies on {layout.mesh.describe()} as '{layout}', which on the spec's mesh is "
            f"'{lifted}', but the spec gives it the param layout '{entry.param}'"
        )
    # shardlang's own groups: the DTensor's device mesh is only a slice of the step's mesh.
    return lifted, entry.grad, None


def dtensor_grad_layout(name: str, grad: DTensor, declared: Layout | None) -> Layout:
    """The layout of a DTensor gradient: its placements, or, for a parameter on a sub-mesh,
    ``declared`` (the spec's grad layout), after checking that it says what the gradient's
    placements say on the sub-mesh's axes."""
    try:
        layout = from_dtensor(grad)
        if declared is None or layout.mesh.same_geometry(declared.mesh):
            return layout
        lifted = lift_layout(layout, declared.mesh)
    except ShardlangError as e:
        raise OptimizerError(f"tensor '{name}': its gradient: {e.message}") from None
    kept = {lifted.mesh.axis_index(n) for n in layout.mesh.axis_names or ()}
    on_sub_mesh = Layout(
        dims=tuple(tuple(a for a in axes if a in kept) for axes in declared.dims),
        mesh=declared.mesh,
        partial=tuple((a, op) for a, op in declared.partial if a in kept),
    )
    if on_sub_mesh != lifted:
        raise OptimizerError(
            f"tensor '{name}': its gradient lies as '{layout}' on {layout.mesh.describe()}, but the spec's grad "
            f"layout '{declared}' says '{on_sub_mesh}' on those axes"
        )
    return declared
