"""The global gradient norm of a step, clipping to it and the non-finite test.

Where no norm is taken, one pass over the reduced gradients tells whether they are finite
(:func:`gradients_finite`): a step whose gradients hold a NaN or inf is refused on every rank, or skipped
with ``skip_nonfinite`` (docs/design/failures.md).

The norm is taken where it is exact, on the reduced gradients in their state layout: every
slot's sum of squares is partial over the axes its state layout splits, and one all-reduce per
group completes all of them (``runtime.optim.sums``). ``clip_grad_norm_`` reduces the gradients
before ``step()`` does; :class:`Clipping` keeps that reduction (:class:`Reduced`) for the step
that follows, which then does not reduce them again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial

import attrs
import torch

from planner.legs import BEFORE
from runtime.errors import DistributedError
from runtime.execution.ranges import profiled
from runtime.optim.commit import Finite
from runtime.optim.compiler import CompiledStep
from runtime.optim.errors import OptimizerStepError
from runtime.optim.flat import as_flat
from runtime.optim.slots import Slot, grad_versions
from runtime.optim.sums import SumReducer, SumSpec
from shardlang.layout import Layout

# The phase of the sums of the gradient norm (runtime.optim.sums.SumReducer keeps its buffers).
NORM_PHASE = "the gradient norm"


@attrs.frozen(eq=False)
class Reduced:
    """The gradients brought into their state layout and their norm by ``clip_grad_norm_``,
    for the ``step()`` that follows: valid while the gradients are the same tensors, unchanged
    (``grads``: their data pointers and versions)."""

    compiled: CompiledStep
    slots: list[Slot]
    grads: tuple[tuple[int, int], ...]
    arrived: Mapping[int, torch.Tensor]
    waited: float
    norm: torch.Tensor
    norm_traffic: tuple[int, int]
    max_norm: float


@attrs.frozen(eq=False)
class Clipped:
    """The reduced gradients a step's math takes (scaled when clipped), their norm (``None``
    when nothing asked for it), the bytes and all-reduces the norm took, and whether the step
    is skipped for a NaN or inf in them."""

    grads: list[torch.Tensor]
    norm: torch.Tensor | None
    traffic: tuple[int, int]
    skip: bool = False


class Clipping:
    """The norm, clipping and non-finite test of every step (``max_grad_norm``,
    ``skip_nonfinite``), and the reduction ``clip_grad_norm_`` keeps for the next step."""

    def __init__(self, reducer: SumReducer, *, max_grad_norm: float | None, skip_nonfinite: bool) -> None:
        self._reducer = reducer
        self.max_grad_norm, self.skip_nonfinite = max_grad_norm, skip_nonfinite
        self._kept: Reduced | None = None

    @property
    def norm_taken(self) -> bool:
        """Whether a norm has been taken (its all-reduces' buffers are kept since)."""
        return self._reducer.reduced(NORM_PHASE)

    @property
    def every_step(self) -> bool:
        """Whether every step takes the norm (not only those ``clip_grad_norm_`` precedes)."""
        return self.max_grad_norm is not None or self.skip_nonfinite

    def keep(self, reduced: Reduced) -> None:
        self._kept = reduced

    def take(
        self, compiled: CompiledStep, slots: Sequence[Slot], grads: Sequence[tuple[torch.Tensor, Layout]]
    ) -> Reduced | None:
        """The kept reduction, if it is of these slots and gradients as they are now (it is
        dropped either way: a step uses it once)."""
        kept, self._kept = self._kept, None
        if kept is None or kept.compiled is not compiled or kept.slots != list(slots):
            return None
        return kept if kept.grads == grad_versions(grads) else None

    def norm_specs(self, slots: Sequence[Slot]) -> list[SumSpec]:
        """Each slot's sum of squared gradient elements, partial over the axes its state layout
        splits (as CAME's RMS), so that one all-reduce per group completes all of them."""
        specs = []
        for slot in slots:
            assert slot.shard is not None
            shard = slot.shard
            specs.append(
                SumSpec(
                    mesh=shard.layout.mesh,
                    axes=shard.sum_axes,
                    numel=1,
                    dtype=slot.dtype,
                    owner=slot.name,
                    replicated=shard.replicated,
                )
            )
        return specs

    def grad_norm(
        self, slots: Sequence[Slot], grads: Sequence[torch.Tensor], step_number: int
    ) -> tuple[torch.Tensor, int, int]:
        """The 2-norm of all the reduced gradients (every rank gets the same), and the bytes and
        all-reduces it took."""
        with profiled(BEFORE, "gradient norm"):
            squares = [g.to(slot.dtype).square().sum().reshape(1) for slot, g in zip(slots, grads, strict=True)]
            try:
                completed, collectives = self._reducer.reduce(self.norm_specs(slots), squares, NORM_PHASE)
            except DistributedError as e:
                raise OptimizerStepError(
                    f"step {step_number} failed reducing the gradient norm: {e.message}; "
                    "parameters and optimizer states are unchanged"
                ) from e
            total = torch.stack([c.reshape(()).to(torch.float64) for c in completed]).sum().sqrt()
        return total.to(slots[0].dtype), sum(c.bytes for c in collectives), len(collectives)

    def clip(
        self, slots: Sequence[Slot], reduced: list[torch.Tensor], kept: Reduced | None, step_number: int
    ) -> Clipped:
        """The step's reduced gradients after the norm, clipping and the non-finite test
        (``kept``: what ``clip_grad_norm_`` reduced, with its norm and its ``max_norm``)."""
        if kept is None and not self.every_step:
            return Clipped(reduced, None, (0, 0))
        if kept is None:
            norm, norm_bytes, norm_collectives = self.grad_norm(slots, reduced, step_number)
            max_norm = self.max_grad_norm
        else:
            norm, (norm_bytes, norm_collectives), max_norm = kept.norm, kept.norm_traffic, kept.max_norm
        if self.skip_nonfinite and not bool(torch.isfinite(norm)):
            return Clipped(reduced, norm, (norm_bytes, norm_collectives), skip=True)
        if max_norm is not None:
            coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            # As torch.nn.utils.clip_grad_norm_ scales them. On the CPU, asking whether to
            # saves a copy; on CUDA the question would be a host sync, and a product with
            # 1.0 leaves the bits as they are (docs/gpu.md).
            if coefficient.is_cuda or bool(coefficient < 1):
                reduced = [g * coefficient.to(g.dtype) for g in reduced]
        return Clipped(reduced, norm, (norm_bytes, norm_collectives))


def gradients_finite(slots: Sequence[Slot], reduced: Sequence[torch.Tensor], norm: torch.Tensor | None) -> Finite:
    """Whether the reduced gradients a step takes are finite, on their device (no host sync):
    the test of their norm where the step took it (a NaN or inf makes it one), else of their
    sum where they are one range of memory (the buckets' results: one reduction, not one per
    tensor), else of their absolute sums, one ``_foreach_norm`` per dtype and device (so does
    any NaN or inf in a tensor; a sum that overflows where no element is, is named as such)."""
    if norm is not None:
        ok = torch.isfinite(norm)
    elif (whole := as_flat(reduced)) is not None:
        ok = torch.sum(whole).isfinite()
    else:
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for grad in reduced:
            if grad.numel():
                groups.setdefault((grad.dtype, grad.device), []).append(grad)
        tests = [torch.stack(torch._foreach_norm(grads, 1)).isfinite().all() for grads in groups.values()]
        if not tests:
            ok = torch.ones((), dtype=torch.bool)
        else:
            ok = tests[0] if len(tests) == 1 else torch.stack([t.to(tests[0].device) for t in tests]).all()
    return Finite(ok, partial(_nonfinite, list(slots), list(reduced)))


def _nonfinite(slots: Sequence[Slot], reduced: Sequence[torch.Tensor]) -> list[tuple[str, str, str]]:
    """What :class:`Finite` names on this rank: each reduced gradient with a NaN or inf, and
    each of the rank's own gradients before the reduction (those it still holds)."""
    found = []
    own = [None if slot.taken is not None else slot.local_grad()[0] for slot in slots]  # taken: freed
    for where, grads in (("reduced", reduced), ("own", own)):
        for slot, grad in zip(slots, grads, strict=True):
            if grad is None:
                continue
            try:  # what cannot be read (a gradient freed under overlap) names nothing
                kind = "NaN" if bool(torch.isnan(grad).any()) else "inf" if bool(torch.isinf(grad).any()) else None
            except Exception:  # (called while the other ranks wait to hear from this one)
                kind = None
            if kind is not None:
                found.append((where, slot.name, kind))
    return found
