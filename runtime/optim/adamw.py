"""AdamW on local shards: the arithmetic of ``torch.optim.AdamW``, op for op.

AdamW is elementwise, so on any shard it equals the single-device optimizer bit for bit when
it performs the same floating-point operations in the same order: decoupled weight decay
``p *= 1 - lr*wd``, ``m.lerp_(g, 1-beta1)``, ``v = v*beta2 + (1-beta2) g*g``, and
``p += -lr/(1-beta1^t) * m / (sqrt(v)/sqrt(1-beta2^t) + eps)`` (``_single_tensor_adam``).
The same elementwise operations run on a flat buffer holding many tensors give the same bits,
so the optimizer steps all tensors of one param group at once. Results go to new buffers, so
that a failed step can be dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Unpack

import torch

from planner.memory import denom_groups
from runtime.memory.buffers import KeptViews, Scratch
from runtime.memory.dtypes import as_dtype
from runtime.optim.base import ShardedOptimizer, StepOptions
from runtime.optim.errors import OptimizerError
from runtime.optim.flat import as_flat, flat_or_copy, pieces_of, scatter_back
from runtime.optim.phases import StepWork, Update, done
from runtime.optim.slots import Slot, SpecLike

ADAMW_STATES = ("exp_avg", "exp_avg_sq")


def adamw_update(
    param: torch.Tensor | None,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    step: int,
    denom: torch.Tensor | None = None,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One step (``step``: 1 on the first) of tensors of one shape, usually the flat buffers
    of many tensors at once: the new parameter, ``exp_avg`` and ``exp_avg_sq`` are written to
    ``out`` (``denom``, when given, is scratch space of the same shape). ``param`` ``None``: the
    caller has written the decayed parameter (:func:`decay`) into ``out[0]``. Nothing passed in
    is modified."""
    beta1, beta2 = betas
    new_param, new_exp_avg, new_exp_avg_sq = out
    if param is not None:
        decay(param, new_param, lr=lr, weight_decay=weight_decay)
    torch.lerp(exp_avg, grad, 1 - beta1, out=new_exp_avg)
    torch.mul(exp_avg_sq, beta2, out=new_exp_avg_sq)
    new_exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)
    denom = torch.sqrt(new_exp_avg_sq, out=denom) if denom is not None else new_exp_avg_sq.sqrt()
    denom.div_((1 - beta2**step) ** 0.5)
    denom.add_(eps)
    new_param.addcdiv_(new_exp_avg, denom, value=-(lr / (1 - beta1**step)))


def adamw_in_place(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    step: int,
    scratch: Scratch,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    views: KeptViews | None = None,
    key: tuple = (),
) -> None:
    """:func:`adamw_update` in place: the same operations in the same order on every element,
    so the same bits. ``grads`` and the states are either per-tensor lists matching ``params``
    or one flat tensor each covering all of them in order (views of flat buffers: a few
    whole-range ops instead of one per tensor); ``params`` are the tensors written (shards of
    the parameters, possibly views into them, of any strides). ``scratch``'s ``"denom"`` takes
    at most :data:`DENOM_CHUNK` elements, or the largest tensor's. ``views`` keeps the
    per-tensor views of the flat ranges between steps, under ``key`` (one per run of tensors)."""
    beta1, beta2 = betas
    if weight_decay != 0:
        torch._foreach_mul_(list(params), 1 - lr * weight_decay)
    flat = len(grads) == 1 and len(params) != 1  # whole ranges of flat states
    shapes = tuple(p.shape for p in params)

    def pieces(name: str, buffer: torch.Tensor, start: int, end: int) -> list[torch.Tensor]:
        if views is None:
            return pieces_of(buffer, shapes[start:end])
        held = (buffer.data_ptr(), buffer.numel(), shapes)
        return views.get((name, start, *key), held, pieces_of, buffer, shapes[start:end])
    # Whole ranges go through the _foreach_ kernels too (lists of one), and the division and the
    # step take lists of numbers, as ``torch.optim.AdamW(foreach=True)`` passes them: on CUDA a
    # division by one number multiplies by its reciprocal, which differs in the last bit from the
    # division that a list of numbers runs (docs/gpu.md).
    torch._foreach_lerp_(list(exp_avgs), list(grads), 1 - beta1)
    torch._foreach_mul_(list(exp_avg_sqs), beta2)
    torch._foreach_addcmul_(list(exp_avg_sqs), list(grads), list(grads), value=1 - beta2)
    if flat:
        averages = pieces("averages", exp_avgs[0], 0, len(params))
    else:
        averages = [a.view(p.shape) for a, p in zip(exp_avgs, params, strict=True)]
    correction = (1 - beta2**step) ** 0.5
    step_size = -(lr / (1 - beta1**step))
    at = 0  # where the group starts in the flat states
    for start, end, numel in denom_groups([p.numel() for p in params]):
        buffer = scratch.take("denom", numel, params[start].dtype, params[start].device)
        denoms = pieces("denoms", buffer, start, end)
        if flat:  # three whole-range ops for the group
            torch.sqrt(exp_avg_sqs[0][at : at + numel], out=buffer)
            torch._foreach_div_([buffer], [correction])
            torch._foreach_add_([buffer], eps)
        else:
            for denom, square in zip(denoms, exp_avg_sqs[start:end], strict=True):
                torch.sqrt(square.view(denom.shape), out=denom)
            torch._foreach_div_(denoms, [correction] * len(denoms))
            torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(list(params[start:end]), averages[start:end], denoms, [step_size] * len(denoms))
        at += numel


def fused_adamw(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """:func:`adamw_in_place` as one fused kernel (``torch._fused_adamw_``, the kernel of
    ``torch.optim.AdamW(fused=True)``, on CUDA and on the CPU), so the same bits as that
    optimizer: every list is per tensor (views of flat buffers are fine), all on one device, of
    one dtype. The step count goes in as a tensor on that device, as torch keeps it, so that the
    kernel reads no host value."""
    steps = torch.full((), step, dtype=torch.float32, device=params[0].device)
    torch._fused_adamw_(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        [],
        [steps] * len(params),
        amsgrad=False,
        lr=lr,
        beta1=betas[0],
        beta2=betas[1],
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
        grad_scale=None,
        found_inf=None,
    )


def _per_tensor(
    flat: torch.Tensor | None,
    shapes: Sequence[torch.Size],
    run: Sequence[int],
    tensor: Callable[[int], torch.Tensor],
) -> list[torch.Tensor]:
    """One view per tensor of ``shapes``: pieces of ``flat``, or else ``tensor(i)`` for each slot
    ``i`` of ``run``."""
    if flat is not None:
        return pieces_of(flat, shapes)
    return [tensor(i).view(shape) for i, shape in zip(run, shapes, strict=True)]


def decay(param: torch.Tensor, out: torch.Tensor, *, lr: float, weight_decay: float) -> None:
    """The decoupled weight decay ``p * (1 - lr * wd)`` of ``param``, written to ``out``."""
    if weight_decay != 0:
        torch.mul(param, 1 - lr * weight_decay, out=out)
    else:
        out.copy_(param)


class ShardedAdamW(ShardedOptimizer):
    """AdamW with every state in its tensor's state layout; equals ``torch.optim.AdamW``
    (decoupled weight decay, bias correction) bit for bit.

    ``named_params``: ``model.named_parameters()`` (or torch-style groups of named
    parameters). ``spec``: a parsed spec file (rules included) or a mapping from tensor name
    to :class:`~shardlang.spec.Layouts`; DTensor parameters may be left out of it.
    ``flat_axis``: keep every state as flat equal chunks over this mesh axis (flat ZeRO).
    ``state_dtype``: of states and math (default fp32, fp64 for fp64 parameters); lower
    precision parameters keep a master shard. ``timeout``: how long any collective may wait
    (seconds or a timedelta; default the runtime's, 5 minutes). ``bucket_bytes``: the most
    buffer one bucket's collective may hold per rank (default
    :data:`planner.legs.DEFAULT_BUCKET_BYTES`). ``verify``: check once per step plan that the
    ranks of every group hold the same buckets (a :class:`~runtime.PlanMismatchError`
    otherwise, instead of a hang or a wrong result). ``max_grad_norm``: clip the gradients to
    this global 2-norm, computed on the reduced gradients in their state layout with one small
    all-reduce, as ``torch.nn.utils.clip_grad_norm_`` would on one device (``last_grad_norm``
    holds the norm). ``skip_nonfinite``: skip a step whose gradients hold a NaN or inf, on every
    rank alike (``last_step_skipped``; a warning says so), as ``GradScaler`` does; without it
    such a step raises ``OptimizerStepError`` on every rank, naming the tensors and ranks, and
    commits nothing. ``verify_replicas``: check that ranks a layout declares replicas hold equal
    values (the parameters when given and after ``load_state_dict``, the gradients at the first
    step; N: every N-th step too; ``False``: never), a ``ReplicaMismatchError`` on every rank
    otherwise (docs/design/failures.md, "Replicas"). ``idle_ranks``: let a rank hold
    parameters whose state mesh leaves it out (it never steps them: a pipeline stage);
    otherwise such a parameter is an error, since the replicas would drift apart.
    ``add_param_group`` places new named parameters from the same spec.
    ``all_ranks_commit``: a step commits only when every rank of the stepped tensors' meshes
    finished it (one all-reduce of a flag); otherwise every rank raises and nothing changes.
    ``overlap``: start the buckets before the update during backward (README, "Overlap"; with
    ``no_sync()`` and ``prefetch_params``). ``reduce_dtype``: reduce lower-precision gradients
    in this dtype (``torch.float32`` for bf16 ones). ``cost``: the cost model the step is planned
    under (``planner.CostModel.from_file`` of ``shardlang calibrate``'s hints), instead of the
    spec's hints. ``transactional``: keep the whole step on spare buffers, committed when every
    rank finished it (by default states and parameter shards are updated in place once every
    rank has agreed: docs/memory.md). ``free_grads``: free each gradient once its bucket has
    packed it, so that no rank keeps whole gradients past the step (ZeRO-2), on by default:
    ``step()`` frees them, and ``.grad`` is ``None`` after it, as after ``zero_grad()``. With
    ``overlap`` they are freed during backward, and until ``step()`` or ``zero_grad()`` ``.grad``
    is a placeholder without memory that raises ``FreedGradError`` if anything reads or writes
    it: only the optimizer's ``clip_grad_norm_`` and ``max_grad_norm`` see the gradients then
    (docs/memory.md, "Gradients"); ``free_grads=False`` keeps them.
    ``fused``: run torch's fused AdamW kernel (CUDA or CPU) on the shards, equal bit for bit to
    ``torch.optim.AdamW(fused=True)``; it updates in place, so not with ``transactional``
    (docs/gpu.md).
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]] | Iterable[dict[str, Any]],
        spec: SpecLike = None,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        fused: bool = False,
        **options: Unpack[StepOptions],
    ) -> None:
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0 or not all(0 <= b < 1 for b in betas):
            raise OptimizerError(
                f"invalid AdamW hyperparameters: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}"
            )
        if fused and options.get("transactional", False):
            raise OptimizerError(
                "fused=True updates the states in place; it cannot run a transactional step "
                "(drop transactional=True or fused=True)"
            )
        self.fused = fused
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(named_params, spec, defaults, **options)

    def _state_shapes(self, slot: Slot) -> dict[str, tuple[int, ...]]:
        assert slot.shard is not None
        return dict.fromkeys(ADAMW_STATES, slot.shard.local_shape)

    def _memory_extras(self) -> dict[str, Any]:
        """The fused kernel's scratch differs (``planner.memory.scratch_bytes``)."""
        return {**super()._memory_extras(), "fused": self.fused}

    updates_in_place = True

    def _updates(self, work: StepWork) -> list[Update]:
        """The math of every run of consecutive slots with one param group and step count, on
        their flat buffers at once (ranges of the buffers where they already are flat, else
        copies); in place where ``work`` says so."""
        if work.in_place:
            self._update_in_place(work)
            return [done()]
        for run in work.runs():
            slot = work.slots[run[0]]
            group, dtype = slot.group, slot.dtype
            scratch = self._scratch
            new_params = [work.new_params[i] for i in run]
            outputs = [flat_or_copy(new_params, dtype, scratch, "params out")]
            for name in ADAMW_STATES:
                target = work.states_of(run, name, new=True)
                outputs.append(
                    target if target is not None else flat_or_copy([work.new_state(i, name) for i in run], dtype)
                )
            states = [work.states_of(run, name) for name in ADAMW_STATES]
            grads = flat_or_copy([work.grads[i] for i in run], dtype, scratch, "grads")
            params = as_flat([work.params[i] for i in run])
            if params is None or params.dtype != dtype:
                # Pieces of other tensors (a slice of each parameter): copied into the new
                # parameters in one call and decayed there as one range (the same product).
                pieces = [work.params[i] for i in run]
                shapes = tuple(piece.shape for piece in pieces)
                held = (outputs[0].data_ptr(), outputs[0].numel(), shapes)
                key = ("pieces", tuple(work.slots[i].index for i in run))
                torch._foreach_copy_(self._views.get(key, held, pieces_of, outputs[0], shapes), pieces)
                decay(outputs[0], outputs[0], lr=group["lr"], weight_decay=group["weight_decay"])
                params = None
            adamw_update(
                params,
                grads,
                *(
                    s if s is not None else flat_or_copy([work.state(i, name) for i in run], dtype, scratch, name)
                    for s, name in zip(states, ADAMW_STATES, strict=True)
                ),
                (outputs[0], outputs[1], outputs[2]),
                slot.step + 1,
                scratch.take("denom", grads.numel(), dtype, grads.device),
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
            )
            scatter_back(outputs[0], new_params)
            for output, name in zip(outputs[1:], ADAMW_STATES, strict=True):
                if work.states_of(run, name, new=True) is None:
                    scatter_back(output, [work.new_state(i, name) for i in run])
        return [done()]

    def _update_in_place(self, work: StepWork) -> None:
        """The math in place (:func:`adamw_in_place`), per run of slots: their states as one range
        of the flat buffers where they lie so and the gradients are one range too (the buckets'
        results, unpadded), else tensor by tensor."""
        for run in work.runs():
            slot = work.slots[run[0]]
            group = slot.group
            params = [work.params[i] for i in run]
            states = [work.states_of(run, name) for name in ADAMW_STATES]
            grads = as_flat([work.grads[i] for i in run])
            hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}
            if self.fused and all(p.dtype == slot.dtype and p.is_contiguous() for p in params):
                shapes = [p.shape for p in params]
                fused_adamw(
                    params,
                    [as_dtype(g, slot.dtype) for g in _per_tensor(grads, shapes, run, lambda i: work.grads[i])],
                    *(
                        _per_tensor(flat, shapes, run, lambda i, name=name: work.state(i, name))
                        for flat, name in zip(states, ADAMW_STATES, strict=True)
                    ),
                    slot.step + 1,
                    **hyper,
                )
                continue
            if grads is not None and grads.dtype == slot.dtype and all(s is not None for s in states):
                flat_grads, flat_states = [grads], [[s] for s in states]
            else:
                flat_grads = [as_dtype(work.grads[i], slot.dtype) for i in run]
                flat_states = [[work.state(i, name) for i in run] for name in ADAMW_STATES]
            adamw_in_place(
                params,
                flat_grads,
                flat_states[0],
                flat_states[1],
                slot.step + 1,
                self._scratch,
                **hyper,
                views=self._views,
                key=tuple(work.slots[i].index for i in run),
            )
