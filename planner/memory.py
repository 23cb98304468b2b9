"""What a rank holds for the tensors it steps, by kind: the one accounting of it
(:func:`rank_memory`), fed either a spec's tensors before any optimizer exists
(:func:`predict_memory`, for ``shardlang suggest``) or a live optimizer's slots
(``runtime.optim.accounting``, its ``memory_report()``), so that the two cannot differ
(docs/memory.md, "Predicting it").

Parameters and gradients are the rank's pieces in the tensor's dtype (gradients as backward
leaves them, the parameters' shapes; none where the optimizer frees them, ``free_grads``, as it
does by default); states in f32 (f64 for f64 tensors) over the state layout, or with a flat axis
the rank's equal chunk of its base block; an f32 master for a lower-precision parameter; the
step plan's bucket buffers (:func:`planner.buffers.step_buffer_bytes`, with the optimizers'
bucket cap); the spare states of a step whose math writes new ones (a transactional step; CAME,
Adafactor and Muon always); and the math's scratch (:func:`scratch_bytes`), with CAME's and
Adafactor's statistics and the buffers of their sums' all-reduces (:func:`statistics_bytes`,
docs/memory.md, "Statistics"). Known only to a live optimizer, and passed in by it: CAME's
copies of states that lie in no one range (``kept``), Muon's wave buffers, and what an FSDP2
wrapper keeps (``wrapper``). Muon's Newton-Schulz iterations leave torch's bf16 product caches in host
memory on a CPU rank (``kernels``, :mod:`planner.matmul_caches`), and the optimizer's Python
objects take about :data:`HOST_BYTES_PER_TENSOR` per tensor (``host``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from itertools import groupby
from typing import Any

import attrs

from planner.bucket_cap import AUTO, step_with_model_cap
from planner.buffers import rounds_buffer_bytes, shares_after, step_buffer_bytes
from planner.cost import CostModel
from planner.legs import DEFAULT_BUCKET_BYTES, Leg, Merged, without_axis
from planner.matmul_caches import kernel_bytes
from planner.matrices import plan_matrices
from planner.spec_plan import cost_for, plan_spec, step_tensor
from planner.statistics import FactoredAxes, StatisticsShard, came_statistics_bytes, sum_buffer_bytes
from planner.step import StepPlan, bucketed_step, step_legs
from shardlang.dtypes import itemsize
from shardlang.layout import chunk_bounds
from shardlang.spec import Spec, TensorSpec

MiB = 2**20
# Elements of the square-root scratch an update in place takes at once (4 MiB of f32): the
# update runs over groups of tensors of at most this many elements (a larger tensor alone), so
# its scratch is bounded by this, not by the states.
DENOM_CHUNK = 1 << 20
# The optimizers whose math writes a second set of states before the commit point
# (docs/memory.md, "The commit point"); AdamW does only when transactional.
MATH_BEFORE_COMMIT = frozenset({"came", "adafactor", "muon"})
# Bytes of Python objects an optimizer keeps per tensor it steps (its slot and state shard, the
# legs, hops and buckets of its step program, kept views, sums, records): what ``tracemalloc``
# counts as alive after three steps, per tensor, on 4 gloo ranks under ZeRO-2: the mean of 80
# small tensors (10.7, 15.8, 14.2, 14.3 KiB) and tests/test_memory_dist.py's 26 larger ones in
# more buckets (12.4, 20.5, 17.8, 18.5 KiB), so within 15% of either (docs/memory.md,
# "Predicting it"); bench/bench_fake_world.py's rank of 4,096 measures 10.7 KiB for AdamW.
HOST_BYTES_PER_TENSOR = {"adamw": 11_776, "came": 18_432, "adafactor": 16_384, "muon": 16_896}


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
class MemoryReport:
    """Bytes a rank holds for the parameters it steps, by kind.

    >>> report = MemoryReport(params=8 * MiB, grads=8 * MiB, states=4 * MiB, masters=0, buffers=3 * MiB, spare=0,
    ...                       scratch=MiB)
    >>> report.total_bytes == 24 * MiB
    True
    >>> print(report)
    params 8.00 MiB + grads 8.00 MiB + states 4.00 MiB + buffers 3.00 MiB + scratch 1.00 MiB = 24.00 MiB
    """

    params: int  # the rank's pieces of the parameters
    grads: int  # their gradients (as backward leaves them: the parameters' shapes and dtypes)
    states: int  # optimizer states (exp_avg, ...), fp32 masters excluded
    masters: int  # fp32 master shards of lower-precision parameters
    buffers: int  # the step program's bucket buffers (kept and send)
    spare: int  # the second set of state buffers a step writes before it commits
    scratch: int  # the math's working buffers
    # What the model's wrapper keeps besides the parameters' shards: over FSDP2's parameters, the
    # unsharded parameters of its largest fully_shard group (measured held between steps).
    wrapper: int = 0
    # What torch's bf16 matrix products keep in host memory once Muon iterated its matrices on a
    # CPU rank (oneDNN's code and primitive caches: planner.matmul_caches).
    kernels: int = 0
    # Python objects the optimizer keeps for its tensors (HOST_BYTES_PER_TENSOR each).
    host: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(attrs.astuple(self))

    @property
    def tensor_bytes(self) -> int:
        """What the rank's tensors hold: every kind but torch's product caches (``kernels``) and
        the Python objects (``host``)."""
        return self.total_bytes - self.kernels - self.host

    def __str__(self) -> str:
        parts = [(k, v) for k, v in attrs.asdict(self).items() if v]
        text = " + ".join(f"{k} {v / MiB:.2f} MiB" for k, v in parts)
        return f"{text} = {self.total_bytes / MiB:.2f} MiB"

    def to_json(self) -> dict[str, int]:
        return attrs.asdict(self) | {"total": self.total_bytes}


# The planner's name of the report (``planner.suggest``, ``cli.suggest``): the same kinds.
MemoryPrediction = MemoryReport


@attrs.frozen
class RankTensor:
    """One tensor as :func:`rank_memory` sizes it on one rank: bytes of the rank's piece of the
    parameter and of its gradient (0: none), of its states (master excluded; 0 where the rank
    steps none of it) and f32 master, the elements and dtype of its state shard (the math's),
    whether that shard is shorter than the chunk its bucket pads it to (the last rank's piece
    of uneven rows) and whether its gradient comes in another dtype than the math's (a bf16
    parameter's): either makes the math copy its run's gradients; ``strided``: its shard is
    not one contiguous range of the rank's parameter (columns of it), which ``fused`` AdamW's
    kernel cannot take."""

    param: int
    grad: int
    states: int
    master: int
    shard: int
    dtype: str
    short: bool = False
    converted: bool = False
    strided: bool = False
    flat_matrix: bool = False  # a flat chunk of a matrix (CAME keeps its statistics' indices)
    # Where a stepped tensor's statistics' sums lie (planner.statistics; None: the rank steps none
    # of it), and its run: the math runs over consecutive stepped tensors of one run and dtype.
    statistics: FactoredAxes | None = None
    run: int = 0


def scratch_bytes(tensors: Sequence[RankTensor], optimizer: str, *, transactional: bool, fused: bool) -> int:
    """The math's working buffers a step keeps (``runtime.memory.buffers.Scratch``), per dtype
    of the math:

    - AdamW in place: the square roots of the largest :func:`denom_groups` group; ``fused``:
      none, unless a shard is converted or strided (then the run updates as in place);
    - a transactional AdamW step: its run's new parameters and square roots as flat buffers,
      the gradients' copy (where a shard is short or converted, :class:`RankTensor`), and the
      new shards of short pieces (which have no place in their gather's buffer);
    - CAME, Adafactor, Muon: one buffer of new parameter shards (those without a master); CAME
      also its run's second moment and update, the gradients' copy (as above), the parameters'
      copy where masters and plain tensors mix, and with flat chunks of matrices a row, column
      and matrix index (int32) per element; Adafactor, with flat chunks of matrices, their row,
      column and matrix index (int64) per element (``runtime.optim.shards.StateShard``'s).
    """
    total = 0
    for dtype in dict.fromkeys(t.dtype for t in tensors if t.states):
        mine = [t for t in tensors if t.dtype == dtype and t.states]
        size = itemsize(dtype)
        numel = sum(t.shard for t in mine)
        copied = any(t.short or t.converted for t in mine)
        if optimizer == "adamw" and fused and not any(t.converted or t.strided for t in mine):
            continue  # the kernel needs no scratch; else the run falls back to the update in place
        if optimizer == "adamw" and not transactional:
            total += max((n for *_, n in denom_groups([t.shard for t in mine if t.shard])), default=0) * size
        elif optimizer == "adamw":
            short = sum(t.shard for t in mine if t.short and not t.master)
            total += (2 * numel + (numel if copied else 0) + short) * size
        else:
            total += sum(t.shard for t in mine if not t.master) * size
            if optimizer == "came":  # parameters copied where masters' views break the range
                mixed = any(t.master for t in mine) and not all(t.master for t in mine)
                total += (2 * numel + (numel if copied else 0) + (numel if mixed else 0)) * size
                # With flat chunks of matrices: a row, column and matrix index (int32) per element.
                total += 3 * numel * 4 if any(t.flat_matrix for t in mine) else 0
            elif optimizer == "adafactor":  # its flat chunks' row, column and matrix index (int64)
                total += 3 * 8 * sum(t.shard for t in mine if t.flat_matrix)
    return total


def statistics_bytes(tensors: Sequence[RankTensor], optimizer: str, *, clip: bool) -> int:
    """CAME's statistics of its runs (:func:`planner.statistics.came_statistics_bytes`) and the
    buffers of the all-reduces of the step's sums (:func:`planner.statistics.sum_buffer_bytes`),
    of the ``tensors`` the rank steps (those with ``statistics``)."""
    stepped = [(t.statistics, t.dtype, t.run) for t in tensors if t.statistics is not None]
    total = sum_buffer_bytes([(shard, dtype) for shard, dtype, _ in stepped], optimizer, clip=clip)
    if optimizer == "came":
        runs = [(key[0], [shard for shard, *_ in group]) for key, group in groupby(stepped, key=lambda s: s[1:])]
        total += came_statistics_bytes(runs)
    return total


def host_bytes(optimizer: str, tensors: int) -> int:
    """The optimizer's Python objects for ``tensors`` tensors: what a rank holds whatever the
    layouts (``host``; an optimizer not measured counts as AdamW)."""
    return HOST_BYTES_PER_TENSOR.get(optimizer, HOST_BYTES_PER_TENSOR["adamw"]) * tensors


def rank_memory(
    tensors: Sequence[RankTensor],
    optimizer: str,
    *,
    buffers: int,
    transactional: bool = False,
    fused: bool = False,
    free_grads: bool = True,
    kept: int = 0,
    wrapper: int = 0,
    iterated: Sequence[tuple[int, int]] = (),
    cpu: bool = True,
    clip: bool = False,
) -> MemoryReport:
    """What a rank holds for ``tensors`` stepped by ``optimizer`` (module doc): ``buffers``, the
    step program's bucket buffers; ``kept``, the working buffers only a live optimizer knows
    (module doc), counted as scratch, as are CAME's and Adafactor's statistics and the buffers of
    the all-reduces of their sums (:func:`statistics_bytes`; ``clip``: and of the gradient
    norm's); ``iterated``, the shapes of the matrices whose
    Newton-Schulz iterations the rank runs (Muon), whose bf16 products' caches a ``cpu`` rank
    keeps (:func:`planner.matmul_caches.kernel_bytes`); and the optimizer's Python objects,
    :data:`HOST_BYTES_PER_TENSOR` per tensor (``host``)."""
    params = sum(t.param for t in tensors)
    grads = 0 if free_grads else sum(t.grad for t in tensors)
    states = sum(t.states for t in tensors)
    masters = sum(t.master for t in tensors)
    spare = states + masters if transactional or optimizer in MATH_BEFORE_COMMIT else 0
    scratch = scratch_bytes(tensors, optimizer, transactional=transactional, fused=fused) + kept
    scratch += statistics_bytes(tensors, optimizer, clip=clip)
    kernels = kernel_bytes(iterated) if cpu else 0
    host = host_bytes(optimizer, len(tensors))
    return MemoryReport(params, grads, states, masters, buffers, spare, scratch, wrapper, kernels, host)


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
    fused: bool = False,
    free_grads: bool = True,
    cpu: bool = True,
    max_grad_norm: float | None = None,
    skip_nonfinite: bool = False,
) -> MemoryReport:
    """What ``rank`` (default: the first rank of the first tensor's state mesh, which holds the
    largest pieces) will hold for ``tensors`` (default: the spec's declared ones) stepped by
    ``optimizer`` (``adamw``, ``came``, ``adafactor``, ``muon``) with the optimizers' options:
    :func:`rank_memory` of the spec's tensors (module doc); ``cpu``: the ranks run on CPU, where
    Muon's matrix products keep caches (``kernels``); ``max_grad_norm`` or ``skip_nonfinite``:
    every step takes the gradient norm, whose all-reduces keep buffers."""
    chosen = tuple(spec.tensors if tensors is None else tensors)
    if rank is None:
        rank = chosen[0].state().mesh.ranks[0] if chosen else 0
    pieces = [rank_tensor(t, rank, optimizer, flat_axis) for t in chosen]
    plan = plan_spec(spec, tensors=chosen, flat_axis=flat_axis, bucket_bytes=bucket_bytes, overlap=overlap, rank=rank)
    buffers = step_buffer_bytes(plan.step, shared_after=not transactional and shares_after(plan.step))
    iterated: list[tuple[int, int]] = []
    if optimizer == "muon":  # the matrices this rank iterates, as ShardedMuon places them
        matrices = [
            step_tensor(p.tensor, p.cost, flat_axis)
            for p in plan.tensors
            if len(p.tensor.shape) == 2 and rank in p.tensor.state().mesh.ranks
        ]
        cap = bucket_bytes if isinstance(bucket_bytes, int) else DEFAULT_BUCKET_BYTES
        placed = plan_matrices(matrices, rank, bucket_bytes=cap).matrices if matrices else ()
        iterated = [m.shape for m in placed if m.owner is None or m.owner == rank]
    return rank_memory(
        pieces,
        optimizer,
        buffers=buffers,
        transactional=transactional,
        fused=fused,
        free_grads=free_grads,
        iterated=iterated,
        cpu=cpu,
        clip=max_grad_norm is not None or skip_nonfinite,
    )


class ChoiceMemory:
    """:func:`predict_memory`, with its defaults, of the choices of a ``planner.suggest.Problem``
    (its spec, optimizer, flat axis, bucket cap and tensors, in groups of one shape, dtype and
    layouts, each group with its candidate layouts; a choice picks a candidate per tensor of
    each group): what a tensor holds and the legs of its step are derived once per group,
    candidate and rank, not once per tensor and choice."""

    def __init__(self, problem: Any) -> None:
        self.problem = problem
        # Where each of the problem's tensors, in the spec's order, is: (group, index in it).
        at = {t.name: (g, i) for g, group in enumerate(problem.groups) for i, t in enumerate(group.tensors)}
        self._places = [at[t.name] for t in problem.tensors]
        self._known: dict[tuple[int, int, int], tuple[RankTensor, str, CostModel, tuple[Leg, ...]]] = {}

    def report(self, picks: Sequence[Sequence[int]], merged: Merged | None = None) -> MemoryReport:
        """What the choice ``picks`` (a candidate per tensor of each group) holds, as
        :func:`predict_memory` of the problem's spec with the chosen layouts; ``merged``: the
        choice's stages as pricing it merged them, taken where they are over the same legs."""
        p = self.problem
        first = self._places[0]
        rank = self._tensor(first[0], picks[first[0]][first[1]]).state().mesh.ranks[0]
        known = [self._of(g, picks[g][i], rank) for g, i in self._places]
        distinct = {id(k): k for k in known}.values()
        costs = {name: cost for _, name, cost, _ in distinct}
        if p.optimizer == "muon" or any(costs[name] != cost for _, name, cost, _ in distinct):
            # Muon's matrices, which take every tensor by its name, or legs that name one tensor
            # under two cost models: the spec's own plan.
            chosen = [
                attrs.evolve(t, layouts=p.groups[g].candidates[picks[g][i]].layouts)
                for t, (g, i) in zip(p.tensors, self._places, strict=True)
            ]
            return predict_memory(
                p.spec, p.optimizer, tensors=chosen, flat_axis=p.flat_axis, bucket_bytes=p.bucket_bytes
            )
        legs = [leg for *_, tensor_legs in known for leg in tensor_legs]
        rounds = merged.rounds if merged is not None and merged.over(legs, costs) else None
        if rounds is not None and p.bucket_bytes != AUTO:  # sized from the merge, no buckets built
            buffers = rounds_buffer_bytes(legs, rounds, int(p.bucket_bytes))
        else:
            step = self._step(legs, tuple(costs), costs, rank)
            buffers = step_buffer_bytes(step, shared_after=shares_after(step))
        return rank_memory([piece for piece, *_ in known], p.optimizer, buffers=buffers)

    def _tensor(self, group: int, candidate: int) -> TensorSpec:
        """The group's first tensor in the candidate's layouts."""
        g = self.problem.groups[group]
        return attrs.evolve(g.first, layouts=g.candidates[candidate].layouts)

    def _of(self, group: int, candidate: int, rank: int) -> tuple[RankTensor, str, CostModel, tuple[Leg, ...]]:
        found = self._known.get((group, candidate, rank))
        if found is None:
            p, tensor = self.problem, self._tensor(group, candidate)
            cost = cost_for(p.spec, tensor)  # as plan_spec's: the hints of the state mesh
            legs = tuple(step_legs([step_tensor(tensor, cost, p.flat_axis)], rank))
            priced = p.groups[group].candidates[candidate].legs
            legs = priced if legs == priced else legs  # the candidate's own: their merge can be shared
            found = (rank_tensor(tensor, rank, p.optimizer, p.flat_axis), tensor.name, cost, legs)
            self._known[(group, candidate, rank)] = found
        return found

    def _step(self, legs: list[Leg], names: tuple[str, ...], costs: dict[str, CostModel], rank: int) -> StepPlan:
        """:func:`planner.step.plan_step` of these legs (under AUTO with the cost model's cap),
        no overlap, no prefetch."""
        cap = self.problem.bucket_bytes
        if cap == AUTO:
            return step_with_model_cap(legs, names, costs, rank)
        return bucketed_step(legs, names, costs, rank, int(cap))


def rank_tensor(tensor: TensorSpec, rank: int, optimizer: str, flat_axis: str | int | None = None) -> RankTensor:
    """``tensor`` on ``rank`` as :func:`rank_memory` sizes it, from its layouts."""
    size = itemsize(tensor.dtype)
    param = tensor.param.rank_piece(tensor.shape, rank).numel * size if rank in tensor.param.mesh.ranks else 0
    state = tensor.state()
    if rank not in state.mesh.ranks:
        return RankTensor(param, param, 0, 0, 0, "f32")
    dtype = "f64" if tensor.dtype == "f64" else "f32"
    flat = None if flat_axis is None else state.mesh.axis_index(flat_axis)
    base = state if flat is None else without_axis(state, flat)
    block = base.rank_piece(tensor.shape, rank).shape
    padded = base.local_shape(tensor.shape)
    if flat is None:
        elements, chunk = math.prod(block), math.prod(padded)
    else:
        n = state.mesh.shape[flat]
        chunk = -(-math.prod(block) // n)
        lo, hi = chunk_bounds(math.prod(block), n, state.mesh.coordinate(rank)[flat])
        elements = hi - lo
    master = elements * itemsize(dtype) if tensor.dtype not in ("f32", "f64") else 0
    states = state_elements(tuple(block), elements, optimizer) * itemsize(dtype)
    short, converted = elements < chunk, tensor.dtype != dtype
    strided = flat is None and not contiguous_in(block, tensor.param.rank_piece(tensor.shape, rank).shape)
    flat_matrix = flat is not None and len(tensor.shape) >= 2
    statistics = StatisticsShard(base, tuple(block), flat)
    return RankTensor(param, param, states, master, elements, dtype, short, converted, strided, flat_matrix, statistics)


def contiguous_in(block: Sequence[int], whole: Sequence[int]) -> bool:
    """Whether a block of shape ``block`` cut from a contiguous tensor of shape ``whole`` is one
    range of it: past its leading dims of one element, every dim after the first is whole.

    >>> contiguous_in((16, 128), (64, 128)), contiguous_in((64, 32), (64, 128)), contiguous_in((1, 32), (64, 128))
    (True, False, True)
    """
    first = next((d for d, b in enumerate(block) if b != 1), len(block))
    return all(block[d] == whole[d] for d in range(first + 1, len(whole)))


def state_elements(block: tuple[int, ...], elements: int, optimizer: str) -> int:
    """Elements of a tensor's optimizer states (master excluded) on a rank whose state shard has
    ``elements`` of the block ``block`` (its piece of the state layout, or the base block its
    flat chunk is cut from): AdamW two moments; CAME the first moment and, for a matrix, the row
    and column statistics of its second moment and of its residual (else a second moment);
    Adafactor a matrix's row and column statistics (else a second moment); Muon a matrix's
    momentum (else AdamW's two moments) (``runtime.optim``'s ``_state_shapes``)."""
    rows = math.prod(block[:-1])
    cols = math.prod(block[:-2] + block[-1:])
    matrix = len(block) >= 2
    if optimizer == "came" and matrix:
        return elements + 2 * (rows + cols)
    if optimizer == "adafactor":
        return rows + cols if matrix else elements
    if optimizer == "muon" and len(block) == 2:
        return elements
    return 2 * elements
