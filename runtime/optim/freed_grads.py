"""What ``.grad`` is once overlap has freed a gradient: a placeholder without memory.

With ``overlap=True`` (and ``free_grads``, its default) each gradient is freed as soon as its
bucket has packed it, during backward, as FSDP2 frees its unsharded gradients after their
reduce-scatter (docs/memory.md, "Gradients"). ``None`` there would let code that reads the
gradients after backward (``torch.nn.utils.clip_grad_norm_``, ``GradScaler.unscale_``, a norm
logged by hand) run on nothing without a word, and a second backward outside ``no_sync()``
would start a new gradient from zero. So ``.grad`` becomes a :class:`FreedGrad`: the
parameter's shape, dtype and device, holding no memory, and every operation on it raises
:class:`FreedGradError`, which names the parameter and what to do. ``zero_grad()`` (of the
optimizer or the module) and ``step()`` clear it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_flatten

from runtime.optim.errors import OptimizerError
from runtime.optim.slots import names_text
from shardlang.interop import is_dtensor

# Zeroing a freed gradient asks for what zero_grad(set_to_none=False) means: no gradient; the
# optimizer's zero_grad then sets .grad to None.
_ZEROING = ("aten::zero_", "aten::_foreach_zero_")


class FreedGradError(OptimizerError):
    """An operation on a gradient that overlap freed during backward (:class:`FreedGrad`)."""


class FreedGrad(torch.Tensor):
    """A freed gradient's placeholder: the shape, dtype and device of the gradient, no storage;
    any operation on it raises :class:`FreedGradError` (zeroing it does nothing)."""

    param_name: str
    owner: str
    written: bool  # something tried to change it in place (a backward accumulating into it)
    _FIX: ClassVar[str] = (
        "clip with optimizer.clip_grad_norm_(...) or the optimizer's max_grad_norm, accumulate "
        "micro-batches inside optimizer.no_sync(), or pass free_grads=False to keep the gradients "
        "(docs/memory.md, 'Gradients')"
    )

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str, owner: str) -> FreedGrad:
        placeholder = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=like.device, requires_grad=False
        )
        placeholder.param_name, placeholder.owner, placeholder.written = name, owner, False
        return placeholder

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"FreedGrad('{self.param_name}', shape={list(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        tensors = [x for x in tree_flatten((args, kwargs or {}))[0] if isinstance(x, torch.Tensor)]
        freed = [x for x in tensors if isinstance(x, FreedGrad)]
        if func._schema.name in _ZEROING:
            for tensor in tensors:
                if not isinstance(tensor, FreedGrad):
                    tensor.zero_()
            return args[0] if func._schema.name == "aten::zero_" else None
        if func._schema.is_mutable:
            for placeholder in freed:
                placeholder.written = True
        first = freed[0]
        names = names_text([x.param_name for x in freed])
        raise FreedGradError(
            f"{first.owner}: the gradient of {names} was freed during backward once its bucket had reduced "
            f"it (overlap=True frees the gradients: ZeRO-2); .grad holds a placeholder without memory until "
            f"step() or zero_grad(), and {func._schema.name} cannot run on it: {cls._FIX}"
        )


def freed_grad(grad: torch.Tensor, name: str, owner: str) -> torch.Tensor:
    """The placeholder for ``grad`` once freed: a :class:`FreedGrad`, or for a DTensor's
    gradient a DTensor of the same placements whose local tensor is one."""
    if not is_dtensor(grad):
        return FreedGrad(grad, name, owner)
    from torch.distributed.tensor import DTensor

    return DTensor(FreedGrad(grad.to_local(), name, owner), grad._spec, requires_grad=False)


def freed_of(grad: torch.Tensor | None) -> FreedGrad | None:
    """The placeholder ``grad`` is (or a DTensor's gradient holds), or ``None``."""
    if grad is None:
        return None
    local = grad._local_tensor if is_dtensor(grad) else grad
    return local if isinstance(local, FreedGrad) else None


def is_freed(grad: torch.Tensor | None) -> bool:
    """Whether ``grad`` is a gradient overlap freed (its placeholder)."""
    return freed_of(grad) is not None
