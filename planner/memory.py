"""What a rank will hold for a spec's tensors, by kind, predicted before any optimizer exists:
the same kinds and the same accounting as the optimizers' ``memory_report()``
(``runtime.optim.memory``), so that ``shardlang suggest`` and the runtime agree (docs/memory.md).

Parameters and gradients are the rank's pieces in the tensor's dtype (gradients as backward
leaves them, the parameters' shapes; none where the optimizer frees them, ``free_grads``, as it
does by default); states in f32 (f64 for f64 tensors) over the state layout, or with a flat axis
the rank's equal chunk of its base block; an f32 master for a lower-precision parameter; the
step plan's bucket buffers (:func:`planner.buffers.step_buffer_bytes`, with the optimizers'
bucket cap); the spare states of a transactional step; and AdamW's in-place scratch
(:func:`denom_groups`). Not predicted: the scratch of CAME, of a transactional step and of
``fused`` AdamW (none), and what an FSDP2 wrapper keeps (``memory_report()``'s ``wrapper``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import attrs

from planner.buffers import shares_after, step_buffer_bytes
from planner.legs import without_axis
from planner.spec_plan import plan_spec
from shardlang.dtypes import itemsize
from shardlang.layout import Layout
from shardlang.spec import Spec, TensorSpec

MiB = 2**20
# Elements of the square-root scratch an update in place takes at once (4 MiB of f32): the
# update runs over groups of tensors of at most this many elements (a larger tensor alone), so
# its scratch is bounded by this, not by the states.
DENOM_CHUNK = 1 << 20


def denom_groups(numels: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """The groups AdamW's update in place runs its square roots over: ``(start, end, elements)``
    of consecutive tensors of at most :data:`DENOM_CHUNK` elements together, a larger one alone.

    >>> list(denom_groups([DENOM_CHUNK // 2, DENOM_CHUNK // 2, 1, 3 * DENOM_CHUNK]))
    [(0, 2, 1048576), (2, 3, 1), (3, 4, 3145728)]
    """
    start = 0
    while start < len(numels):
        end, numel = start + 1, numels[start]
        while end < len(numels) and numel + numels[end] <= DENOM_CHUNK:
            numel += numels[end]
            end += 1
        yield start, end, numel
        start = end


@attrs.frozen
class MemoryPrediction:
    """Bytes a rank will hold, by the kinds of ``memory_report()``.

    >>> print(MemoryPrediction(params=8 * MiB, grads=0, states=4 * MiB, masters=0, buffers=3 * MiB, spare=0,
    ...                        scratch=MiB))
    params 8.00 MiB + states 4.00 MiB + buffers 3.00 MiB + scratch 1.00 MiB = 16.00 MiB
    """

    params: int
    grads: int
    states: int
    masters: int
    buffers: int
    spare: int
    scratch: int

    @property
    def total_bytes(self) -> int:
        return sum(attrs.astuple(self))

    def __str__(self) -> str:
        parts = [(k, v) for k, v in attrs.asdict(self).items() if v]
        text = " + ".join(f"{k} {v / MiB:.2f} MiB" for k, v in parts)
        return f"{text} = {self.total_bytes / MiB:.2f} MiB"

    def to_json(self) -> dict[str, int]:
        return attrs.asdict(self) | {"total": self.total_bytes}


def predict_memory(
    spec: Spec,
    optimizer: str = "adamw",
    *,
    tensors: Sequence[TensorSpec] | None = None,
    rank: int | None = None,
    flat_axis: str | int | None = None,
    bucket_bytes: int | str | None = None,
    overlap: bool = False,
    transactional: bool = False,
    free_grads: bool = True,
) -> MemoryPrediction:
    """What ``rank`` (default: the first rank of the first tensor's state mesh, which holds the
    largest pieces) will hold for ``tensors`` (default: the spec's declared ones) stepped by
    ``optimizer`` with the optimizers' options (module doc)."""
    chosen = tuple(spec.tensors if tensors is None else tensors)
    if rank is None:
        rank = chosen[0].state().mesh.ranks[0] if chosen else 0
    params = grads = states = masters = 0
    shards: dict[str, list[int]] = {}  # per state dtype, the rank's state shards' elements
    flat = None
    for t in chosen:
        param = t.param.rank_piece(t.shape, rank).numel if rank in t.param.mesh.ranks else 0
        params += param * itemsize(t.dtype)
        grads += 0 if free_grads else param * itemsize(t.dtype)
        mesh = t.state().mesh
        if rank not in mesh.ranks:
            continue
        flat = None if flat_axis is None else mesh.axis_index(flat_axis)
        elements = _state_elements(t, rank, flat)
        dtype = "f64" if t.dtype == "f64" else "f32"
        master = elements * itemsize(dtype) if t.dtype not in ("f32", "f64") else 0
        states += (
            2 * elements * itemsize(dtype)
            if optimizer == "adamw"
            else state_bytes(t, t.state(), optimizer, flat) - master
        )
        masters += master
        shards.setdefault(dtype, []).append(elements)
    plan = plan_spec(spec, tensors=chosen, flat_axis=flat_axis, bucket_bytes=bucket_bytes, overlap=overlap, rank=rank)
    buffers = step_buffer_bytes(plan.step, shared_after=not transactional and shares_after(plan.step))
    spare = states + masters if transactional or optimizer != "adamw" else 0
    scratch = 0
    if optimizer == "adamw" and not transactional:
        for dtype, numels in shards.items():
            scratch += max((n for *_, n in denom_groups([n for n in numels if n])), default=0) * itemsize(dtype)
    return MemoryPrediction(params, grads, states, masters, buffers, spare, scratch)


def state_bytes(tensor: TensorSpec, state: Layout, optimizer: str, flat: int | None = None) -> int:
    """The optimizer states and master of ``tensor`` on the largest rank, states in ``state``
    (``planner.suggest``'s module doc); with ``flat``, in equal chunks over that axis of the
    base block (``state`` without it)."""
    dtype = "f64" if tensor.dtype == "f64" else "f32"
    if flat is not None:
        state = without_axis(state, flat)
    local = state.local_shape(tensor.shape)
    elements = math.prod(local) if flat is None else -(-math.prod(local) // state.mesh.shape[flat])
    full = elements * itemsize(dtype)
    master = full if tensor.dtype not in ("f32", "f64") else 0
    if optimizer == "adamw" or len(local) < 2:
        return 2 * full + master
    rows, cols = math.prod(local[:-1]), math.prod(local[:-2] + local[-1:])
    return full + 2 * (rows + cols) * itemsize(dtype) + master


def _state_elements(tensor: TensorSpec, rank: int, flat: int | None) -> int:
    """Elements of one state of ``tensor`` on ``rank``: its piece of the state layout, or with a
    flat axis its equal chunk of the base block (the state layout without that axis)."""
    state = tensor.state()
    if flat is None:
        return state.rank_piece(tensor.shape, rank).numel
    base = without_axis(state, flat)
    return -(-base.rank_piece(tensor.shape, rank).numel // state.mesh.shape[flat])
