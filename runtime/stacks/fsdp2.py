"""A sharded optimizer over the parameters accelerate's FSDP2 plugin shards (docs/stacks/huggingface.md).

    model, optimizer, data = prepare_fsdp2(
        accelerator, model, lambda m: ShardedAdamW(m.named_parameters(), spec, lr=3e-4), data
    )

Under FSDP2, ``accelerator.prepare(model, optimizer)`` shards the model (``fully_shard``: every
parameter becomes a new DTensor parameter) and then swaps the new parameters into the
optimizer's ``param_groups``. A sharded optimizer places its parameters when it is built, so
one built before ``prepare`` keeps the old, unsharded parameters: they get no gradient, and
its steps would do nothing. :func:`prepare_fsdp2` prepares the model first, builds the
optimizer from the sharded model (its parameters are then the DTensors, placed by the spec:
its state layouts, checked against their placements by :func:`check_spec`) and prepares
the optimizer and the rest with the model, as accelerate asks under FSDP2.

:func:`check_placed` says where an optimizer holds parameters the model no longer has. Save
and resume with ``torch.distributed.checkpoint`` and ``runtime.optim.dcp.OptimizerState``
(docs/stacks/dcp.md); accelerate's ``save_state`` reads the optimizer through torch's
``get_optimizer_state_dict``, which a sharded optimizer's state dict does not fit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from runtime.optim import OptimizerError, ShardedOptimizer
from shardlang.generate import dtype_of
from shardlang.interop import from_dtensor, is_dtensor
from shardlang.spec import Spec

MakeOptimizer = Callable[[torch.nn.Module], torch.optim.Optimizer]


class FSDP2Error(OptimizerError):
    """A sharded optimizer that does not fit the FSDP2-sharded model it is given with."""


def sharded_optimizer(optimizer: Any) -> ShardedOptimizer | None:
    """The sharded optimizer inside ``optimizer`` (accelerate wraps it), or ``None``."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, ShardedOptimizer) else None


def check_spec(named_parameters: Iterable[tuple[str, torch.Tensor]], spec: Spec) -> None:
    """Every DTensor parameter the spec places must lie as the spec's param layout says (a
    DTensor's own placements are its param layout; a spec that says otherwise was written
    for another sharding). Raises :class:`FSDP2Error` naming the tensor and both layouts."""
    for name, param in named_parameters:
        if not is_dtensor(param):
            continue
        entry = next((t for t in spec.tensors if t.name == name), None)
        if entry is None and any(rule.matches(name) for rule in spec.rules):
            entry = spec.resolve(name, tuple(param.shape), dtype_of(param.dtype))
        if entry is None:
            continue
        held = from_dtensor(param)
        declared = entry.param
        if not held.mesh.same_geometry(declared.mesh):
            continue  # a DTensor on a sub-mesh: runtime.optim lifts it and checks it there
        if held.dims != declared.dims or held.partial != declared.partial:
            raise FSDP2Error(
                f"tensor '{name}': FSDP2 shards it as '{held}' ({param.placements}), but the spec's param "
                f"layout is '{declared}'; write the spec for the sharded model (spec_for(model.named_parameters(), "
                "mesh, 'zero3') where FSDP2 splits the first dim)"
            )


def check_placed(optimizer: Any, model: torch.nn.Module) -> None:
    """Every parameter the sharded optimizer holds must be one of the model's now: one built
    before ``accelerator.prepare`` sharded the model holds the parameters FSDP2 replaced."""
    sharded = sharded_optimizer(optimizer)
    if sharded is None:
        return
    # A held tensor's ``param`` is this rank's piece (a DTensor's local tensor): the same memory.
    current = {_local(p).data_ptr() for p in model.parameters()}
    stale = [h.name for h in sharded.held_tensors() if h.param.numel() and h.param.data_ptr() not in current]
    if stale:
        shown = ", ".join(stale[:4]) + (f" and {len(stale) - 4} more" if len(stale) > 4 else "")
        raise FSDP2Error(
            f"{type(sharded).__name__} holds parameters the model no longer has ({shown}): it was built before "
            "FSDP2 sharded the model, and its steps would change nothing; build it from the prepared model "
            "(runtime.stacks.fsdp2.prepare_fsdp2)"
        )


def prepare_fsdp2(accelerator: Any, model: torch.nn.Module, make_optimizer: MakeOptimizer, *others: Any) -> tuple:
    """``accelerator.prepare`` under FSDP2 with the optimizer built over the sharded
    parameters: the model prepared alone (sharded), ``make_optimizer(model)``, then the model,
    the optimizer and ``others`` (data loaders, schedulers) prepared together. Returns what
    ``prepare`` returns: the model, the wrapped optimizer, then ``others``."""
    if not getattr(accelerator, "is_fsdp2", False):
        raise FSDP2Error(
            f"the accelerator runs {accelerator.distributed_type}, not FSDP2: give it "
            "FullyShardedDataParallelPlugin(fsdp_version=2) (accelerate takes the plugin only on GPUs and other "
            "accelerators; on CPU it runs DDP, where the optimizer is built before prepare: docs/stacks/huggingface.md)"
        )
    model = accelerator.prepare(model)
    optimizer = make_optimizer(model)
    check_placed(optimizer, model)
    prepared = accelerator.prepare(model, optimizer, *others)
    check_placed(prepared[1], prepared[0])
    return tuple(prepared)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if is_dtensor(param) else param
