"""What each parameter is to a sharded optimizer and where its pieces live: its slot.

:class:`Slots` places every parameter from the spec (or its DTensor placements): its param,
grad and state layouts, the states the spec keeps in a layout of their own, this rank's part
of its state (:class:`~runtime.optim.shards.StateShard`) and the dtype of its math. It owns
the slots, in the optimizer's order (the step plan's and the flat buffers'), and answers which
of them a step takes and which ranks must agree on that step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from planner.cost import CostModel
from planner.legs import without_axis
from runtime.memory.dtypes import dtype_name
from runtime.optim.dtensors import dtensor_grad_layout, dtensor_param_layouts
from runtime.optim.errors import OptimizerError
from runtime.optim.shards import StateShard
from shardlang.errors import ShardlangError
from shardlang.interop import is_dtensor
from shardlang.layout import Layout
from shardlang.mesh import StridedRanks, as_ranks, highest_rank
from shardlang.spec import STATE_DEFAULT, Layouts, Spec, TensorSpec

SpecLike = Spec | Mapping[str, Layouts | TensorSpec] | None


@attrs.define(eq=False)
class Slot:
    """One parameter as this rank's optimizer sees it."""

    index: int  # in the optimizer's order (the step plan's and the flat buffers')
    name: str
    param: torch.Tensor
    shape: tuple[int, ...]  # the whole tensor's
    group: dict[str, Any]
    param_layout: Layout
    grad_layout: Layout | None  # None: read from the gradient (DTensor)
    state_layout: Layout
    own_layouts: dict[str, Layout]  # states kept in a layout of their own
    shard: StateShard | None  # None: this rank is outside the tensor's mesh
    flat_axis: int | None
    device_mesh: DeviceMesh | None
    dtype: torch.dtype  # of the states and the math
    cost: CostModel  # the reshards are planned under
    step: int = 0
    # A DTensor's gradient layout and dtype at its last step: what overlap plans the next for.
    seen_grad: tuple[Layout, torch.dtype] | None = None
    # free_grads: the gradient a bucket packed and that was then freed: an empty tensor of its
    # dtype standing in for it until the step, and its layout (None: the parameter's .grad).
    taken: tuple[torch.Tensor, Layout] | None = None
    # local_param's alias, and the address, dtype, shape and strides it was made for.
    _local: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)
    _local_of: tuple[object, ...] = attrs.field(default=(), init=False, repr=False)
    # A DTensor gradient's layout and what it was derived from (_dtensor_grad_layout).
    _grad_layout_of: tuple[object, ...] | None = attrs.field(default=None, init=False, repr=False)

    @property
    def needs_master(self) -> bool:
        return self.param.dtype != self.dtype

    def local_param(self) -> torch.Tensor:
        """The rank's piece of the parameter: a DTensor's local tensor, else the parameter
        detached, the same tensor from call to call while the parameter keeps its memory, so
        that a step's views of it are made once (``runtime.execution.buckets``, stable legs)."""
        param = self.param
        if is_dtensor(param):
            return param.to_local()
        # While the alias lives its memory cannot be reused, so an equal address is the same
        # memory; ``param.data = ...`` gives the parameter new memory or a new geometry.
        now = (param.data_ptr(), param.dtype, param.shape, param.stride())
        if self._local is None or now != self._local_of:
            self._local, self._local_of = param.detach(), now
        return self._local

    def local_grad(self) -> tuple[torch.Tensor, Layout]:
        if self.taken is not None:
            return self.taken
        grad = self.param.grad
        assert grad is not None
        if is_dtensor(grad):
            return grad.to_local(), self._dtensor_grad_layout(grad)
        if self.grad_layout is None:
            raise OptimizerError(f"tensor '{self.name}' is a DTensor but its gradient is a plain tensor")
        return grad, self.grad_layout

    def _dtensor_grad_layout(self, grad: Any) -> Layout:
        """A DTensor gradient's layout, derived once per device mesh, placements and shape:
        deriving it reads every coordinate of the mesh (``shardlang.interop.from_dtensor``),
        parameters times world size of work every step otherwise."""
        spec = grad._spec  # where from_dtensor reads the shard order too
        mesh = grad.device_mesh
        of = (spec.placements, spec.shard_order, spec.use_strided_shard_as_shard_order, grad.shape)
        cached = self._grad_layout_of
        if cached is not None and cached[0] is mesh and cached[1] == of:
            return cached[2]  # type: ignore[return-value]
        layout = dtensor_grad_layout(self.name, grad, self.grad_layout)
        self._grad_layout_of = (mesh, of, layout)
        return layout

    def own_piece_shape(self, state: str, rank: int) -> tuple[int, ...]:
        """The shape of ``rank``'s piece of a state kept in its own layout."""
        return self.own_layouts[state].rank_piece(self.shape, rank).shape


class Slots(Sequence[Slot]):
    """Every parameter of the optimizer, placed (see the module doc). ``state_shapes`` gives
    the states the math keeps for a slot (to check the spec's own-layout states against);
    ``owner`` names the optimizer in errors."""

    def __init__(
        self,
        spec: SpecLike,
        *,
        flat_axis: str | int | None,
        state_dtype: torch.dtype | None,
        cost: CostModel | None,
        rank: int,
        idle_ranks: bool,
        state_shapes: Callable[[Slot], dict[str, tuple[int, ...]]],
        owner: str,
    ) -> None:
        self._spec, self._flat_axis, self._state_dtype, self._cost = spec, flat_axis, state_dtype, cost
        self.rank, self._idle_ranks, self._state_shapes, self._owner = rank, idle_ranks, state_shapes, owner
        self._all: list[Slot] = []
        self._members_of: dict[tuple[int, ...], Sequence[int]] = {}  # per set of slots stepped

    def __len__(self) -> int:
        return len(self._all)

    def __getitem__(self, i: int) -> Slot:  # type: ignore[override]
        return self._all[i]

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._all)

    def place(self, group: dict[str, Any]) -> list[Slot]:
        """The slots of a param group's named parameters, numbered after those added so far
        (not added: :meth:`add`, once every one of them is placed)."""
        start = len(self._all)
        return [
            self._place(start + k, name, p, group)
            for k, (name, p) in enumerate(zip(group["param_names"], group["params"], strict=True))
        ]

    def add(self, placed: Sequence[Slot]) -> None:
        self._all += placed

    def held(self) -> list[Slot]:
        """The slots whose states this rank keeps (inside their state mesh)."""
        return [s for s in self._all if s.shard is not None]

    def stepped(self) -> list[Slot]:
        """The slots the coming step takes: held, with a gradient (or one a bucket took)."""
        return [s for s in self._all if s.shard is not None and (s.param.grad is not None or s.taken is not None)]

    def coming(self) -> tuple[list[Slot], list[tuple[Layout, torch.dtype] | None]]:
        """The slots the next step is planned for, with their gradients' layouts and dtypes:
        those with a gradient now; where none has one (before backward, or after a step freed
        them: ``free_grads``), every held slot with the gradient it expects (None where that is
        not known yet: a DTensor before its first step)."""
        stepped = self.stepped()
        if stepped:
            return stepped, [grad_key(s) for s in stepped]
        held = self.held()
        return held, [expected_grad(s) for s in held]

    def members(self, slots: Sequence[Slot]) -> Sequence[int]:
        """The ranks that must agree on a step of ``slots``: those of their state meshes, in
        increasing order. Where they share one mesh (or meshes of the same ranks) that is the
        mesh's own ranks object, held once (a run of ranks is a few numbers however many ranks
        it holds); the union of several is walked once per set of slots, and held in its one
        form (``shardlang.mesh.as_ranks``)."""
        key = tuple(slot.index for slot in slots)
        members = self._members_of.get(key)
        if members is None:
            # The distinct rank sets, by identity first: a mesh's listed ranks hash rank by rank.
            by_id = {id(ranks): ranks for ranks in (s.state_layout.mesh.ranks for s in slots)}
            distinct = list(dict.fromkeys(by_id.values()))
            if len(distinct) == 1 and isinstance(distinct[0], StridedRanks):  # increasing already
                members = distinct[0]
            else:
                members = as_ranks(sorted(set().union(*distinct)))
            self._members_of[key] = members
        return members

    def _place(self, index: int, name: str, param: torch.Tensor, group: dict[str, Any]) -> Slot:
        rank = self.rank
        try:
            shape, param_layout, grad_layout, state_layout, own, device_mesh = layouts_of(name, param, self._spec)
            # A spec file's cost hints for the state mesh (bandwidth, latency) steer the plans.
            if self._cost is not None:
                cost = self._cost
            elif isinstance(self._spec, Spec):
                cost = CostModel.from_hints(self._spec.hints(state_layout.mesh))
            else:
                cost = CostModel()
            for layout in (param_layout, grad_layout, state_layout, *own.values()):
                if layout is not None:
                    layout.check_shape(shape)
            if param_layout.is_partial or state_layout.is_partial or any(lay.is_partial for lay in own.values()):
                raise OptimizerError("its param and state layouts must not be partial")
            for layout in (param_layout, grad_layout, *own.values()):
                if layout is not None and not layout.mesh.same_geometry(state_layout.mesh):
                    raise OptimizerError(
                        f"its layouts lie on different meshes ({layout.mesh.describe()} and "
                        f"{state_layout.mesh.describe()}); an optimizer step moves tensors within one mesh"
                    )
            world = dist.get_world_size() if dist.is_initialized() else None
            if world is not None and highest_rank(state_layout.mesh.ranks) >= world:
                # Raised alike on every rank before any collective (whose group could not form).
                mesh = state_layout.mesh
                raise OptimizerError(
                    f"its mesh {mesh.describe()} holds ranks {ranks_text(mesh.ranks)} but the job has {world} "
                    f"(torch.distributed's world size): size the spec's meshes to the job ('shardlang check "
                    f"FILE --model MODULE:FACTORY --world {world}' lists every mesh that does not fit)"
                )
            axis = None if self._flat_axis is None else state_layout.mesh.axis_index(self._flat_axis)
            block = state_layout if axis is None else without_axis(state_layout, axis)
            inside = rank in state_layout.mesh.ranks
            if not inside and not self._idle_ranks:
                mesh = state_layout.mesh
                raise OptimizerError(
                    f"rank {rank} holds it, but its state mesh {mesh.describe()} is ranks "
                    f"{ranks_text(mesh.ranks)}: this rank would never update it; give the spec a mesh "
                    "over every rank that holds the tensor, or pass idle_ranks=True where a rank holds "
                    "tensors it does not step (a pipeline stage)"
                )
            shard = StateShard.of(shape, block, rank, axis) if inside else None
            if inside and not is_dtensor(param):
                piece = param_layout.rank_piece(shape, rank).shape
                if piece != tuple(param.shape):
                    raise OptimizerError(
                        f"rank {rank} holds a piece of shape {list(param.shape)}, but its param layout "
                        f"'{param_layout}' gives it {list(piece)} of {list(shape)}"
                    )
        except ShardlangError as e:
            raise OptimizerError(f"tensor '{name}': {e.message}") from None
        state_dtype = self._state_dtype
        dtype = state_dtype or (param.dtype if param.dtype in (torch.float32, torch.float64) else torch.float32)
        slot = Slot(
            index=index,
            name=name,
            param=param,
            shape=shape,
            group=group,
            param_layout=param_layout,
            grad_layout=grad_layout,
            state_layout=state_layout,
            own_layouts=own,
            shard=shard,
            flat_axis=axis,
            device_mesh=device_mesh,
            dtype=dtype,
            cost=cost,
        )
        if shard is not None:
            self._check_own_layouts(slot)
        return slot

    def _check_own_layouts(self, slot: Slot) -> None:
        """Only a state of the parameter's shape can be kept in a layout of its own."""
        shapes = self._state_shapes(slot)
        assert slot.shard is not None
        for state in slot.own_layouts:
            if state not in shapes:
                raise OptimizerError(
                    f"tensor '{slot.name}': the spec gives state.{state} a layout, but {self._owner} keeps "
                    f"no state '{state}' for it (it keeps {', '.join(sorted(shapes))})"
                )
            if shapes[state] != slot.shard.local_shape:
                raise OptimizerError(
                    f"tensor '{slot.name}': state.{state} does not have the parameter's shape "
                    f"({self._owner} derives it from the state layout), so it cannot have a layout of its own"
                )


def layouts_of(
    name: str, param: torch.Tensor, spec: SpecLike
) -> tuple[tuple[int, ...], Layout, Layout | None, Layout, dict[str, Layout], DeviceMesh | None]:
    """The whole tensor's shape, its (param, grad, state) layouts, the states the spec gives a
    layout of their own (other than the state layout), and its device mesh.

    A DTensor's param layout is its placements, its grad layout its gradient's (read each
    step), and the spec, when it places the tensor, gives the state layout (else the param
    layout); a DTensor on a sub-mesh of the spec's mesh takes the spec's grad layout
    (``runtime.optim.dtensors``). A plain tensor is the rank's piece of the shape the spec declares, or, placed
    by a rule or a :class:`Layouts`, the whole tensor.
    """
    if is_dtensor(param):
        shape = tuple(param.shape)
        entry = _spec_entry(name, shape, param.dtype, spec)
        if entry is not None and entry.shape != shape:
            raise OptimizerError(f"the spec declares shape {list(entry.shape)}, the DTensor has {list(shape)}")
        layout, grad, device_mesh = dtensor_param_layouts(param, entry)
        state = entry.state() if entry is not None else layout
        own = _own_layouts(entry) if entry is not None else {}
        return shape, layout, grad, state, own, device_mesh
    entry = _spec_entry(name, tuple(param.shape), param.dtype, spec)
    if entry is None:
        raise OptimizerError("it has no layouts: the spec does not place it, and it is not a DTensor")
    return entry.shape, entry.param, entry.grad, entry.state(), _own_layouts(entry), None


def _own_layouts(entry: TensorSpec) -> dict[str, Layout]:
    return {k: lay for k, lay in entry.layouts.states if k != STATE_DEFAULT and lay != entry.state()}


def _spec_entry(name: str, shape: tuple[int, ...], dtype: torch.dtype, spec: SpecLike) -> TensorSpec | None:
    """The spec's entry for a tensor; ``shape`` is assumed for one placed without a shape."""
    if spec is None:
        return None
    if isinstance(spec, Spec):
        declared = next((t for t in spec.tensors if t.name == name), None)
        if declared is not None or not any(rule.matches(name) for rule in spec.rules):
            return declared
        return spec.resolve(name, shape, dtype_name(dtype))
    entry = spec.get(name)
    if isinstance(entry, Layouts):
        return TensorSpec(name=name, dtype=dtype_name(dtype), shape=shape, layouts=entry)
    return entry


# --- gradients: which tensors, their keys, freeing them -------------------------------------
def memory_and_version(tensor: torch.Tensor) -> tuple[int, int]:
    """Which memory a tensor is, and how often it was changed in place (its version counter,
    shared by its views and ``detach()``)."""
    return tensor.data_ptr(), tensor._version


def grad_versions(grads: Sequence[tuple[torch.Tensor, Layout]]) -> tuple[tuple[int, int], ...]:
    """Which gradient tensors, and how often changed in place: a kept reduction's key."""
    return tuple(memory_and_version(grad) for grad, _ in grads)


def take_grad(slot: Slot, layout: Layout) -> None:
    """Free the slot's gradient, a bucket having packed it (``free_grads``): an empty tensor of
    its dtype stands in for it until the step."""
    grad = slot.param.grad
    assert grad is not None
    slot.taken = (torch.empty(0, dtype=grad.dtype, device=grad.device), layout)
    slot.param.grad = None


def grad_key(slot: Slot) -> tuple[Layout, torch.dtype]:
    """The layout and dtype of a slot's gradient as it is now."""
    grad, layout = slot.local_grad()
    return layout, grad.dtype


def expected_grad(slot: Slot) -> tuple[Layout, torch.dtype] | None:
    """The layout and dtype a slot's next gradient is planned with before it exists: the spec's
    grad layout, or a DTensor's gradient as last seen (None before its first step)."""
    if slot.grad_layout is not None and not is_dtensor(slot.param):
        return slot.grad_layout, slot.param.dtype
    return slot.seen_grad


def names_text(names: Sequence[str]) -> str:
    """``'w'``; several as ``'w' and 2 more``."""
    return f"'{names[0]}'" + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def ranks_text(ranks: Sequence[int]) -> str:
    """``[0, 1]``; a long list as ``[0, 1, 2, ..., 1023] (1024 ranks)``."""
    if len(ranks) <= 8:
        return str(list(ranks))
    return f"[{ranks[0]}, {ranks[1]}, {ranks[2]}, ..., {ranks[len(ranks) - 1]}] ({len(ranks)} ranks)"
