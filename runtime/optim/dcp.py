"""The sharded optimizers' states for ``torch.distributed.checkpoint`` (DCP), next to the model.

    dcp.save({"model": model.state_dict(), "optim": OptimizerState(optimizer)}, checkpoint_id=path)
    dcp.load({"model": model.state_dict(), "optim": OptimizerState(other_optimizer)}, checkpoint_id=path)

The form is the one ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` gives
for ``torch.optim`` optimizers: ``{"state": {fqn: {"step": 0-d float tensor, name: tensor}},
"param_groups": [{..., "params": [fqn, ...]}]}``, keyed by the parameters' canonical names
(``module.`` of DDP and ``_orig_mod.`` of ``torch.compile`` left out, as DCP does). Every state
is a DTensor over the state's mesh (a ``DeviceMesh`` made without process groups: DCP only reads
its coordinates), so DCP writes each block once and loads it into any other layout or world
size, and a ``torch.optim.AdamW`` checkpoint saved with ``get_optimizer_state_dict`` loads
into :class:`ShardedAdamW` (and ours into torch's with ``set_optimizer_state_dict``). A state
whose layout DTensor cannot express (flat ZeRO chunks, some nesting orders) is a
:class:`DCPLayoutError` that points at ``runtime.checkpoint``, which stores any layout. fp32
masters of bf16 parameters are saved as the state ``master`` (torch's optimizers keep none).

:func:`get_optimizer_state_dict` and :func:`set_optimizer_state_dict` are torch's functions of
those names for sharded optimizers too (torch's own cannot read them: seeing no
``optimizer.state``, it steps the optimizer once with zero gradients, then fails on the form of
its state dict). See docs/stacks/dcp.md.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from runtime.optim.errors import OptimizerError
from runtime.optim.full_state import FORMATS
from runtime.optim.records import HeldTensor, StateWhere
from shardlang.box import row_major_strides
from shardlang.errors import InteropError
from shardlang.interop import to_dtensor_placements
from shardlang.mesh import Mesh

if TYPE_CHECKING:
    from runtime.optim.base import ShardedOptimizer

# Name components that wrappers add and DCP's canonical names leave out: anywhere, and DDP's
# ``module`` in front.
WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
DDP_PART = "module"
STEP = "step"


class DCPLayoutError(OptimizerError):
    """A state lies in a layout that DCP (a DTensor) cannot express."""


def canonical_name(name: str) -> str:
    """``name`` without the components wrappers add (``module.`` of DDP, ``_orig_mod.`` of
    ``torch.compile``), as ``get_optimizer_state_dict`` keys the states."""
    parts = [p for p in name.split(".") if p not in WRAPPER_PARTS]
    while len(parts) > 1 and parts[0] == DDP_PART:
        parts = parts[1:]
    return ".".join(parts)


@functools.cache
def _device_mesh(mesh: Mesh, device_type: str) -> DeviceMesh:
    """A device mesh of ``mesh``'s ranks and axis names, without process groups (a DTensor's
    chunk of the checkpoint only needs the mesh's coordinates)."""
    ranks = torch.tensor(list(mesh.ranks), dtype=torch.int64).reshape(mesh.shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=mesh.axis_names, _init_backend=False)


def _as_dtensor(name: str, state: str, where: StateWhere, local: torch.Tensor) -> DTensor:
    if where.flat_of is not None:
        raise DCPLayoutError(
            f"tensor '{name}', state '{state}': flat ZeRO chunks (flat_axis) are pieces of a flattened block, "
            "which a DTensor cannot express; save this optimizer with runtime.checkpoint, which stores any "
            "layout and loads it into any other (docs/tutorials/checkpoints.md)"
        )
    try:
        placements = to_dtensor_placements(where.layout, where.shape)
    except InteropError as e:
        raise DCPLayoutError(
            f"tensor '{name}', state '{state}': {e.message}; save this optimizer with runtime.checkpoint, which "
            "stores any layout (docs/tutorials/checkpoints.md)"
        ) from None
    mesh = _device_mesh(where.layout.mesh, local.device.type)
    return DTensor.from_local(
        local,
        mesh,
        placements,
        run_check=False,
        shape=torch.Size(where.shape),
        stride=row_major_strides(where.shape),
    )


def _local_states(held: HeldTensor) -> dict[str, torch.Tensor]:
    """The held tensor's states (copies), or zeros of their shapes before its first step."""
    device = held.param.device
    out = {}
    for state, where in held.wheres.items():
        value = held.states.get(state)
        if value is None:
            out[state] = torch.zeros(where.local_shape, dtype=held.state_dtype, device=device)
        else:
            out[state] = value.detach().clone()
    return out


def optimizer_state_dict(optimizer: ShardedOptimizer) -> dict[str, Any]:
    """This rank's states in the form ``get_optimizer_state_dict`` gives (module docstring):
    DTensors of copies, which ``dcp.save`` writes and ``dcp.load`` fills in place."""
    held = optimizer.held_tensors()
    state: dict[str, dict[str, Any]] = {}
    for h in held:
        entry: dict[str, Any] = {STEP: torch.tensor(float(h.step))}
        for name, local in _local_states(h).items():
            entry[name] = _as_dtensor(h.name, name, h.wheres[name], local)
        state[canonical_name(h.name)] = entry
    # The group keys torch's optimizer of the same kind keeps besides ours, so that its template
    # (``get_optimizer_state_dict``) finds every key in our checkpoint.
    form = FORMATS.get(type(optimizer).__name__)
    implied = dict(form.group_keys) if form is not None else {}
    groups = []
    for group in optimizer.param_groups:
        saved = {k: v for k, v in group.items() if k not in ("params", "param_names")} | implied
        saved["params"] = [canonical_name(n) for n in group["param_names"]]
        groups.append(saved)
    return {"state": state, "param_groups": groups}


def load_optimizer_state_dict(optimizer: ShardedOptimizer, state_dict: Mapping[str, Any]) -> None:
    """Load the form :func:`optimizer_state_dict` gives (as ``dcp.load`` filled it, or as
    ``get_optimizer_state_dict`` wrote it for ``torch.optim.AdamW``) into this rank's pieces.
    Nothing changes unless every state fits."""
    from runtime.optim.base import STATE_DICT_FORMAT

    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise OptimizerError("a DCP optimizer state dict has the keys 'state' and 'param_groups'")
    saved_groups = list(state_dict["param_groups"])
    ours = [[canonical_name(n) for n in g["param_names"]] for g in optimizer.param_groups]
    theirs = [list(g["params"]) for g in saved_groups]
    if theirs != ours:
        raise OptimizerError(f"the state dict's param groups hold the parameters {theirs}, this optimizer's {ours}")
    tensors = {}
    for h in optimizer.held_tensors():
        entry = state_dict["state"].get(canonical_name(h.name))
        if entry is None:
            continue
        records = {}
        for name, where in h.wheres.items():
            value = entry.get(name)
            if value is None:
                raise OptimizerError(
                    f"tensor '{h.name}': the state dict has no state '{name}' (it holds {sorted(entry)})"
                )
            local = value.to_local() if isinstance(value, DTensor) else value
            if not isinstance(local, torch.Tensor) or tuple(local.shape) != where.local_shape:
                got = list(local.shape) if isinstance(local, torch.Tensor) else type(local).__name__
                raise OptimizerError(
                    f"tensor '{h.name}', state '{name}': the state dict holds {got} on rank {optimizer.rank}, "
                    f"which holds {list(where.local_shape)} (load with dcp.load into OptimizerState(optimizer), "
                    "which reshards)"
                )
            records[name] = where.record() | {"tensor": local.to(h.state_dtype)}
        step = entry[STEP]
        tensors[h.name] = {"step": int(step.item() if isinstance(step, torch.Tensor) else step), "states": records}
    groups = []
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        kept = {k: v for k, v in group.items() if k != "params"}
        kept |= {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in kept and k != "params"}
        kept["param_names"] = group["param_names"]
        groups.append(kept)
    optimizer.load_state_dict(
        {"format": STATE_DICT_FORMAT, "optimizer": type(optimizer).__name__, "param_groups": groups, "tensors": tensors}
    )


class OptimizerState:
    """A sharded optimizer as DCP's ``Stateful``: ``dcp.save({"optim": OptimizerState(opt)})``
    writes its states as DTensors and ``dcp.load`` reads them into any other layout, world size
    or optimizer of the same kind (module docstring)."""

    def __init__(self, optimizer: ShardedOptimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return optimizer_state_dict(self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_optimizer_state_dict(self.optimizer, state_dict)


# --- torch.distributed.checkpoint.state_dict's two functions, for sharded optimizers too --------
def _sharded(optimizer: Any) -> ShardedOptimizer | None:
    from runtime.optim.base import ShardedOptimizer

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate and Lightning wrap optimizers
    return inner if isinstance(inner, ShardedOptimizer) else None


def _split(optimizers: Any) -> tuple[list[ShardedOptimizer], list[torch.optim.Optimizer]]:
    given = list(optimizers) if isinstance(optimizers, Sequence) else [optimizers]
    ours = [s for s in (_sharded(o) for o in given) if s is not None]
    if ours and len(ours) != len(given):
        raise OptimizerError(
            "get_optimizer_state_dict / set_optimizer_state_dict take sharded optimizers or torch's, not both in "
            "one call: call them once for each kind"
        )
    return ours, given


def _check_options(options: Any) -> None:
    if options is None:
        return
    unsupported = [k for k in ("full_state_dict", "flatten_optimizer_state_dict") if getattr(options, k, False)]
    if unsupported:
        raise DCPLayoutError(
            f"StateDictOptions({', '.join(f'{k}=True' for k in unsupported)}) for a sharded optimizer: its state "
            "dict holds DTensors of the pieces each rank keeps; gather them whole with optimizer.full_state_dict() "
            "(every rank calls it)"
        )


def _check_names(model: torch.nn.Module, optimizer: ShardedOptimizer) -> None:
    names = {canonical_name(n) for n, _ in model.named_parameters()}
    missing = [
        n for g in optimizer.param_groups for n in (canonical_name(m) for m in g["param_names"]) if n not in names
    ]
    if missing:
        raise OptimizerError(
            f"{type(optimizer).__name__} holds parameters the model has not: {missing[:4]} (the state dict is keyed "
            "by the model's parameter names, as torch's get_optimizer_state_dict keys it)"
        )


def get_optimizer_state_dict(
    model: torch.nn.Module, optimizers: Any, *, submodules: Any = None, options: Any = None
) -> dict[str, Any]:
    """``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``, which also takes
    sharded optimizers: theirs are :func:`optimizer_state_dict` (DTensors keyed by the model's
    parameter names), merged as torch merges several optimizers'; torch's optimizers go to
    torch's function. torch's own function cannot read a sharded optimizer: seeing no
    ``optimizer.state`` it steps it once with zero gradients (moving its moments and step
    count) and then fails on its state dict's form (docs/stacks/dcp.md)."""
    from torch.distributed.checkpoint import state_dict as torch_state_dict

    ours, given = _split(optimizers)
    if not ours:
        return torch_state_dict.get_optimizer_state_dict(
            model, given if len(given) > 1 else given[0], submodules=submodules, options=options
        )
    _check_options(options)
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for optimizer in ours:
        _check_names(model, optimizer)
        one = optimizer_state_dict(optimizer)
        merged["state"].update(one["state"])
        merged["param_groups"].extend(one["param_groups"])
    return merged


def set_optimizer_state_dict(
    model: torch.nn.Module, optimizers: Any, optim_state_dict: Mapping[str, Any], *, options: Any = None
) -> None:
    """``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict``, which also takes
    sharded optimizers: each loads its parameters' groups and states from ``optim_state_dict``
    (as :func:`get_optimizer_state_dict` gave it and ``dcp.load`` filled it, or as torch's
    function wrote it for ``torch.optim.AdamW``); torch's optimizers go to torch's function."""
    from torch.distributed.checkpoint import state_dict as torch_state_dict

    ours, given = _split(optimizers)
    if not ours:
        torch_state_dict.set_optimizer_state_dict(
            model, given if len(given) > 1 else given[0], dict(optim_state_dict), options=options
        )
        return
    _check_options(options)
    if not isinstance(optim_state_dict, Mapping) or not {"state", "param_groups"} <= set(optim_state_dict):
        raise OptimizerError("a DCP optimizer state dict has the keys 'state' and 'param_groups'")
    groups = list(optim_state_dict["param_groups"])
    for optimizer in ours:
        _check_names(model, optimizer)
        mine = {canonical_name(n) for g in optimizer.param_groups for n in g["param_names"]}
        own_groups = [g for g in groups if set(g["params"]) & mine]
        load_optimizer_state_dict(optimizer, {"state": optim_state_dict["state"], "param_groups": own_groups})
