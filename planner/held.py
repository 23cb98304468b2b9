"""What a candidate of ``planner.suggest`` adds to the memory a rank holds, as the integer
program of ``planner.knapsack`` counts it: the terms of :func:`planner.memory.rank_memory`
(the accounting of ``memory_report()`` and ``predict_memory``, docs/memory.md) split into
what is a sum over tensors and what is a largest one.

Sums over tensors (:attr:`HeldTerms.linear`): the rank's parameter piece, its states and
master, the spare states of a step whose math writes new ones (CAME), CAME's scratch (its
runs' flat buffers are sums of the shards, the copies' conditions properties of the tensors'
dtypes and shapes), and the results of the step's buckets before the update (all kept:
``planner.buffers.lay_out``). A largest one: per wire dtype, the region after those results
(the largest bucket after the update where the step writes each out as it lands, else their
sum; or a reduce-scatter's workspace) and the send buffer (the largest reduce-scatter's or
all-to-all's), each a bucket's, which the program bounds by its kind's sum of buffers (one
bucket) or, where a kind needs several buckets, by the cap (or the largest single buffer);
and AdamW's square roots in place, the shards of a group of at most
:data:`planner.memory.DENOM_CHUNK` elements: their sum where the rank's shards together fit
one group, else that chunk (or the largest shard). Fixed: the optimizer's Python objects
(:func:`planner.memory.host_bytes`, a constant per tensor). Where the program's bounds are
exact (every kind one bucket, the shards one group) its count is the prediction's; elsewhere
it is at least it, and ``planner.knapsack`` checks every answer against the prediction itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import attrs

from planner.buffers import bucket_use
from planner.legs import AFTER, STAGES, Bucket, Leg
from planner.memory import DENOM_CHUNK, MATH_BEFORE_COMMIT, RankTensor
from shardlang.dtypes import itemsize


@attrs.frozen
class BucketTerm:
    """One communicating step of a candidate's optimizer step as its own bucket: its kind (the
    program's number), stage, collective, wire dtype, ``result`` (bytes of its result kept)
    and ``buffer`` (bytes of the buffer it fills: its send buffer and workspace where it has
    them)."""

    kind: int
    stage: str
    op: str
    dtype: str
    result: int
    buffer: int

    @property
    def sends(self) -> bool:
        """Whether it takes send space (an all-gather or all-reduce works in place)."""
        return self.op in ("reduce_scatter", "all_to_all")


@attrs.frozen
class HeldTerms:
    """A candidate's terms (module doc): ``linear`` bytes; ``roots``, AdamW's square roots of
    its shard in place, ``(state dtype, bytes)`` (0 bytes for other optimizers); its steps'
    ``buckets``; ``unshared``: a leg after the update communicating in more than one step,
    which keeps every result after the update (``planner.buffers.shares_after``)."""

    linear: int
    roots: tuple[str, int]
    buckets: tuple[BucketTerm, ...]
    unshared: bool
    # The buckets by kind, stage, collective and dtype: the dominance test compares every pair
    # of a group's candidates (planner.knapsack), tens of thousands at scale.
    _keyed: dict[tuple[int, str, str, str], BucketTerm] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_keyed", {(b.kind, b.stage, b.op, b.dtype): b for b in self.buckets})

    def no_worse_than(self, other: HeldTerms) -> bool:
        """Whether every term is at most ``other``'s, in the same kinds (for dominance)."""
        if self.linear > other.linear or self.roots[1] > other.roots[1] or self.unshared > other.unshared:
            return False
        theirs = other._keyed
        return all(
            k in theirs and b.result <= theirs[k].result and b.buffer <= theirs[k].buffer
            for k, b in self._keyed.items()
        )


@attrs.frozen
class Copies:
    """Per state dtype, what of CAME's scratch the tensors' dtypes and shapes decide
    (``planner.memory.scratch_bytes``): a gradients' copy (some parameter converted), the
    parameters' copy (masters and plain tensors mixed), the flat chunks' indices."""

    copied: frozenset[str] = frozenset()
    mixed: frozenset[str] = frozenset()
    indexed: frozenset[str] = frozenset()

    @classmethod
    def of(cls, tensors: Sequence[RankTensor]) -> Copies:
        with_states = [t for t in tensors if t.states]
        dtypes = {t.dtype for t in with_states}
        return cls(
            frozenset(t.dtype for t in with_states if t.converted or t.short),
            frozenset(d for d in dtypes if len({bool(t.master) for t in with_states if t.dtype == d}) > 1),
            frozenset(t.dtype for t in with_states if t.flat_matrix),
        )


def held_terms(
    piece: RankTensor, optimizer: str, copies: Copies, buckets: Sequence[tuple[int, Bucket]], legs: Sequence[Leg]
) -> HeldTerms:
    """The terms of one tensor, ``piece`` on the program's rank, whose step legs ``legs`` run
    in ``buckets`` of their own (each with its kind's number)."""
    linear = piece.param + piece.states + piece.master
    if optimizer in MATH_BEFORE_COMMIT:
        linear += piece.states + piece.master
    size = itemsize(piece.dtype)
    roots = (piece.dtype, piece.shard * size if optimizer == "adamw" and piece.states else 0)
    if optimizer == "came" and piece.states:
        d = piece.dtype
        linear += (0 if piece.master else piece.shard * size) + 2 * piece.shard * size
        linear += piece.shard * size * ((d in copies.copied) + (d in copies.mixed))
        linear += 3 * piece.shard * 4 if d in copies.indexed else 0
    terms = []
    for kind, b in buckets:
        if b.stage not in STAGES or b.axis is None:
            continue
        use = bucket_use(0, b)
        whole = use.n * use.total if use.op in ("all_gather", "all_to_all") else use.total
        terms.append(BucketTerm(kind, b.stage, b.op, b.dtype, whole * itemsize(b.dtype), b.buffer_bytes))
        if b.stage != AFTER:
            linear += terms[-1].result
    unshared = any(len(leg.communicating) > 1 for leg in legs if leg.stage == AFTER)
    return HeldTerms(linear, roots, tuple(terms), unshared)


def program_rows(
    cells: Sequence[tuple[int, int, HeldTerms]],
    buckets: Mapping[int, tuple[int, int]],
    cap: int,
    unit: float,
    row: Callable[[dict[int, float], float, float], None],
    var: Callable[..., int],
) -> dict[int, float]:
    """Add the program's rows of the held memory (module doc): ``cells``, per cell its group,
    the group's tensors and its terms (the cell's count is variable ``i``, its binary "used"
    ``len(cells) + i``); ``buckets``, per kind its buckets' variable and the most buckets it
    can need; ``row(entries, low, high)`` and ``var(upper, integer, low=0.0)`` add to the
    program, in bytes over ``unit``. Returns the memory's coefficients by variable."""
    memory: dict[int, float] = {i: t.linear / unit for i, (_, _, t) in enumerate(cells)}
    used = len(cells)

    def most_per_group(value: Callable[[HeldTerms], int]) -> int:  # every tensor at its largest
        largest: dict[int, tuple[int, int]] = {}
        for g, count, t in cells:
            largest[g] = (count, max(largest.get(g, (0, 0))[1], value(t)))
        return sum(count * v for count, v in largest.values())

    for dtype in sorted({t.roots[0] for _, _, t in cells if t.roots[1]}):
        full = most_per_group(lambda t, d=dtype: t.roots[1] if t.roots[0] == d else 0)
        chunk = DENOM_CHUNK * itemsize(dtype)
        mine = [(i, t.roots[1]) for i, (_, _, t) in enumerate(cells) if t.roots[0] == dtype and t.roots[1]]
        if full <= chunk:  # one group of square roots: their sum
            for i, v in mine:
                memory[i] += v / unit
            continue
        # Their sum where it fits one group; else ``over``, and at most the chunk or one shard.
        roots, over = var(math.inf, False), var(1, True)
        memory[roots] = 1.0
        total = {i: -v / unit for i, v in mine}
        row({roots: 1.0, **total, over: full / unit}, 0.0, math.inf)
        row({**total, over: (full - chunk) / unit}, -chunk / unit, math.inf)
        row({roots: 1.0, over: -chunk / unit}, 0.0, math.inf)
        for i, v in mine:
            if v > chunk:
                row({roots: 1.0, used + i: -v / unit}, 0.0, math.inf)
    kinds: dict[int, list[tuple[int, BucketTerm]]] = {}
    for i, (_, _, t) in enumerate(cells):
        for b in t.buckets:
            kinds.setdefault(b.kind, []).append((i, b))
    largest: dict[int, int] = {}  # kind -> the variable of its largest bucket's buffer
    for k, members in kinds.items():
        first = members[0][1]
        if first.stage != AFTER and not first.sends:
            continue  # its results are a sum (linear); no send space or workspace
        largest[k] = var(math.inf, False)
        per_cell: dict[int, int] = {}
        for i, b in members:
            per_cell[i] = per_cell.get(i, 0) + b.buffer
        full = most_per_group(lambda t, k=k: sum(b.buffer for b in t.buckets if b.kind == k))
        entries = {largest[k]: 1.0, **{i: -v / unit for i, v in per_cell.items()}}
        column, most = buckets[k]
        if most > 1:  # several buckets: each at most the cap, or one tensor's larger buffer
            several = var(1, True)
            row({several: most - 1.0, column: -1.0}, -1.0, math.inf)
            row({**entries, several: full / unit}, 0.0, math.inf)
            row({largest[k]: 1.0, several: -cap / unit}, 0.0, math.inf)
            for i, v in per_cell.items():
                if v > cap:
                    row({largest[k]: 1.0, used + i: -v / unit}, 0.0, math.inf)
        else:
            row(entries, 0.0, math.inf)
    unshared = [i for i, (_, _, t) in enumerate(cells) if t.unshared]
    every_after = most_per_group(lambda t: sum(b.result for b in t.buckets if b.stage == AFTER))
    apart = None
    if unshared:  # some leg after the update in two steps: every result after it kept
        apart = var(1, True)
        for i in unshared:
            row({apart: 1.0, used + i: -1.0}, 0.0, math.inf)
    for dtype in sorted({kinds[k][0][1].dtype for k in largest}):
        region, send = var(math.inf, False), var(math.inf, False)
        memory[region] = memory[send] = 1.0
        after: dict[int, float] = {}  # the results after the update, summed
        for i, (_, _, t) in enumerate(cells):
            for b in t.buckets:
                if b.stage == AFTER and b.dtype == dtype:
                    after[i] = after.get(i, 0.0) - b.result / unit
        if apart is not None:
            row({region: 1.0, **after, apart: -every_after / unit}, -every_after / unit, math.inf)
        for k, column in largest.items():
            b = kinds[k][0][1]
            if b.dtype != dtype:
                continue
            if b.stage == AFTER:  # one bucket's result: a share of its buffer (a reduce-scatter's)
                share = b.result / b.buffer if b.buffer else 1.0
                row({region: 1.0, column: -share, **({apart: every_after / unit} if apart else {})}, 0.0, math.inf)
            if b.op == "reduce_scatter":  # its workspace, after the results before the update
                row({region: 1.0, column: -1.0, **(after if b.stage == AFTER else {})}, 0.0, math.inf)
            if b.sends:
                row({send: 1.0, column: -1.0}, 0.0, math.inf)
    return memory
