"""Full state dicts in torch's own formats, so a job moves between torch's optimizers and ours.

``full_state_dict`` gathers every state (and the parameter, for bf16 masters and CAME's
``RMS``) from the ranks that hold pieces of it, through one ``all_gather_object`` on the
default group, and assembles whole tensors (every rank gets all of them), in the format of
``torch.optim.AdamW.state_dict()`` for :class:`ShardedAdamW` (``step`` a float tensor, the
group keys torch's AdamW keeps) and of ``came_pytorch.CAME`` for :class:`ShardedCAME`
(``step`` an int, ``RMS``). ``load_full_state_dict`` slices such a dict to this rank's pieces
in their current layouts and loads them through ``load_state_dict``, so nothing changes unless
every state fits. fp32 master shards (bf16 parameters) are not in torch's format: they are
left out, and loading takes them from the parameters. See the README, "Torch state dicts".

This moves a job between optimizers; it is no per-step checkpoint (``runtime.checkpoint``
writes pieces without gathering them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from runtime.optim.errors import OptimizerError
from runtime.optim.records import STATE_DICT_FORMAT, HeldTensor, StateWhere
from shardlang.layout import chunk_bounds

if TYPE_CHECKING:
    from runtime.optim.base import ShardedOptimizer


@attrs.frozen
class TorchFormat:
    """How a reference optimizer writes its state dict: ``step`` as a float tensor or an int,
    the keys its param groups hold besides ours (with the values ours imply), and the state
    derived from the parameter that it keeps (CAME's ``RMS``)."""

    reference: str
    step_tensor: bool
    group_keys: Mapping[str, Any]
    rms: bool


FORMATS = {
    "ShardedAdamW": TorchFormat(
        reference="torch.optim.AdamW",
        step_tensor=True,
        group_keys={
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": True,
        },
        rms=False,
    ),
    "ShardedCAME": TorchFormat(reference="came_pytorch.CAME", step_tensor=False, group_keys={}, rms=True),
}
MASTER = "master"


def _format(optimizer: ShardedOptimizer) -> TorchFormat:
    name = type(optimizer).__name__
    for cls in type(optimizer).__mro__:
        if cls.__name__ in FORMATS:
            return FORMATS[cls.__name__]
    raise OptimizerError(f"{name} has no torch state-dict format (known: {', '.join(FORMATS)})")


def _gather(held: Sequence[HeldTensor]) -> list[tuple[int, list[HeldTensor]]]:
    """Every rank's held tensors, with its rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    # Copies: a state is a view of a flat buffer, which pickling would send whole.
    copies = [
        attrs.evolve(h, param=h.param.detach().clone(), states={k: v.clone() for k, v in h.states.items()})
        for h in held
    ]
    mine = (rank, copies)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def _slices(bounds: Sequence[tuple[int, int]]) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in bounds)


def _place(full: torch.Tensor, where: StateWhere, shape: tuple[int, ...], rank: int, piece: torch.Tensor) -> None:
    """Write ``rank``'s piece of a state lying as ``where`` into the whole tensor."""
    if where.flat_of is None:
        full[_slices(where.layout.rank_piece(where.shape, rank))] = piece
        return
    index = _slices(where.flat_of.rank_piece(shape, rank))
    flat = full[index].clone().reshape(-1)
    lo, hi = _flat_range(where, flat.numel(), rank)
    flat[lo:hi] = piece
    full[index] = flat.view(full[index].shape)


def _flat_range(where: StateWhere, numel: int, rank: int) -> tuple[int, int]:
    axis = where.layout.dims[0][0]  # a flat chunk's layout is the 1-d split over the flat axis
    mesh = where.layout.mesh
    return chunk_bounds(numel, mesh.shape[axis], mesh.coordinate(rank)[axis])


def _piece(full: torch.Tensor, where: StateWhere, shape: tuple[int, ...], rank: int) -> torch.Tensor:
    """``rank``'s piece of a whole state that lies as ``where``."""
    if where.flat_of is None:
        return full[_slices(where.layout.rank_piece(where.shape, rank))].clone()
    flat = full[_slices(where.flat_of.rank_piece(shape, rank))].reshape(-1)
    lo, hi = _flat_range(where, flat.numel(), rank)
    return flat[lo:hi].clone()


def _whole(name: str, gathered: Sequence[tuple[int, list[HeldTensor]]], state: str | None) -> torch.Tensor:
    """The whole state ``state`` (``None``: the parameter) of tensor ``name``."""
    full = None
    for rank, held in gathered:
        for h in held:
            if h.name != name:
                continue
            if state is None:
                piece, shape = h.param, h.shape
            else:
                piece, where = h.states[state], h.wheres[state]
                shape = where.shape if where.flat_of is None else h.shape
            if full is None:
                full = torch.zeros(shape, dtype=piece.dtype)
            if state is None:
                full[_slices(h.param_layout.rank_piece(h.shape, rank))] = piece.detach().cpu()
            else:
                _place(full, h.wheres[state], h.shape, rank, piece.detach().cpu())
    assert full is not None
    return full


def _indices(optimizer: ShardedOptimizer) -> dict[str, int]:
    names = [n for group in optimizer.param_groups for n in group["param_names"]]
    return {n: i for i, n in enumerate(names)}


def full_state_dict(optimizer: ShardedOptimizer) -> dict[str, Any]:
    """The whole states in the reference optimizer's format (see the module docstring)."""
    form = _format(optimizer)
    gathered = _gather(optimizer.held_tensors())
    steps = {h.name: h.step for _, held in gathered for h in held}
    state: dict[int, dict[str, Any]] = {}
    for name, index in _indices(optimizer).items():
        if steps.get(name, 0) == 0:
            continue  # torch keeps no state for a parameter never stepped
        holder = next(h for _, held in gathered for h in held if h.name == name)
        entry: dict[str, Any] = {"step": torch.tensor(float(holder.step)) if form.step_tensor else holder.step}
        for key in sorted(holder.states):
            if key != MASTER:
                entry[key] = _whole(name, gathered, key)
        if form.rms:
            param = _whole(name, gathered, None).to(holder.state_dtype)
            entry["RMS"] = param.norm(2) / math.sqrt(param.numel())  # as came_pytorch's _rms
        state[index] = entry
    groups = []
    indices = _indices(optimizer)
    for group in optimizer.param_groups:
        saved = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        saved |= dict(form.group_keys)
        saved["params"] = [indices[n] for n in group["param_names"]]
        saved["param_names"] = list(group["param_names"])
        groups.append(saved)
    return {"state": state, "param_groups": groups}


def load_full_state_dict(optimizer: ShardedOptimizer, state_dict: Mapping[str, Any]) -> None:
    """Load whole states in the reference optimizer's format, sliced to this rank's pieces."""
    form = _format(optimizer)
    where_from = f"the {form.reference} state dict"
    if not isinstance(state_dict, Mapping) or set(state_dict) != {"state", "param_groups"}:
        raise OptimizerError(f"{where_from} must have exactly the keys 'state' and 'param_groups'")
    theirs = list(state_dict["param_groups"])
    if [len(g["params"]) for g in theirs] != [len(g["params"]) for g in optimizer.param_groups]:
        raise OptimizerError(
            f"{where_from} has groups of {[len(g['params']) for g in theirs]} parameters, this optimizer "
            f"{[len(g['params']) for g in optimizer.param_groups]}"
        )
    for group, saved in zip(optimizer.param_groups, theirs, strict=True):
        if "param_names" in saved and list(saved["param_names"]) != list(group["param_names"]):
            raise OptimizerError(
                f"{where_from} names the parameters {saved['param_names']}, not {group['param_names']}"
            )
        for key, implied in form.group_keys.items():
            if key in saved and saved[key] != implied and key not in ("foreach", "fused"):
                raise OptimizerError(
                    f"{where_from} has {key}={saved[key]!r}; {type(optimizer).__name__} needs {implied!r}"
                )
    held = optimizer.held_tensors()
    needs_param = any(MASTER in h.wheres for h in held)
    gathered = _gather(held if needs_param else [])  # every rank calls: the parameters, for masters
    indices = _indices(optimizer)
    tensors = {}
    for h in held:
        entry = state_dict["state"].get(indices[h.name])
        if entry is None:
            continue
        records = {}
        for key, where in h.wheres.items():
            whole = _whole(h.name, gathered, None) if key == MASTER else entry.get(key)
            expected = where.shape if where.flat_of is None else h.shape
            if not isinstance(whole, torch.Tensor) or tuple(whole.shape) != tuple(expected):
                got = list(whole.shape) if isinstance(whole, torch.Tensor) else whole
                raise OptimizerError(
                    f"tensor '{h.name}', state '{key}': {where_from} holds {got}, expected a tensor of shape "
                    f"{list(expected)}"
                )
            piece = _piece(whole.to(h.state_dtype), where, h.shape, optimizer.rank)
            records[key] = where.record() | {"tensor": piece}
        step = entry["step"]
        tensors[h.name] = {"step": int(step.item() if isinstance(step, torch.Tensor) else step), "states": records}
    groups = []
    for group, saved in zip(optimizer.param_groups, theirs, strict=True):
        ours = {k: v for k, v in group.items() if k != "params"}
        ours |= {
            k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in ours and k != "param_names"
        }
        groups.append(ours)
    optimizer.load_state_dict(
        {"format": STATE_DICT_FORMAT, "optimizer": type(optimizer).__name__, "param_groups": groups, "tensors": tensors}
    )
