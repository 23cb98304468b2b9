"""The planner's move graph: layouts as states, one-axis steps as edges, with their costs.

A state is a layout packed into one integer: a small code per mesh axis (replicated, partial
with an op, or split on a dim at a nesting position), so that states hash and compare as
integers and a move changes one code. :meth:`Space.encode` and :meth:`Space.decode` convert
from and to the raw fields of :class:`Layout`, ``(dims, partial)``. The moves are the
baseline move set (docs/reference/planner.md), costed by the tables of ``planner.cost``; local
lengths are ``ceil(L / product of the splitting axes' sizes)``, which equals the nested
ceilings of the language for any nesting order.

:meth:`Space.moves` leaves out moves that no cheapest plan needs, by four rules. Each maps
any plan breaking it to one that keeps it, with no more time, no more steps and no larger
intermediate state, so the search stays exact (the brute-force test enumerates the full move
set to check):

1. Partial steps last. A ``partial`` step is free and changes no local size; a partial axis
   only ever blocks reductions of other axes, and reducing an axis after making it partial
   is never cheaper than leaving it replicated (or slicing it). So partial steps are taken
   only once the dims equal the target's and nothing is left to reduce, lowest axis first.
2. Idle twins. Two axes replicated now, with the same role in the target (replicated, or
   partial with the same op), the same size and the same cost rates are interchangeable:
   swapping them maps the state, the target and every cost onto themselves. Only the lower
   one is sliced.
3. No-op splits. Splitting a dim whose local length is at most 1, or splitting with an axis
   of size 1, changes no local length; the axis then only waits to leave again (an
   all_to_all that a later slice replaces, or an all_gather that can be dropped). So a
   ``slice`` or ``all_to_all`` that changes nothing is taken only when it puts the axis at
   its place in the target.
4. Dominated successions. Given the move that reached a state, some next moves only reach,
   at no less cost and in more steps, a state that a move from the previous state reaches
   directly (and the search took that move first): after ``slice(a)``, gathering ``a``
   (back where it was) or moving it (``slice`` it there directly), or slicing a lower axis
   onto another dim (the same two slices in ascending axis order); after
   ``all_gather(a)``, slicing ``a`` (``all_to_all`` sends no more, or it is back where it
   was); after ``reduce_scatter(a)``, ``all_gather(a)`` (``all_reduce``: the same rounds,
   no more bytes); after ``all_to_all(a)``, moving ``a`` straight back.

Rules 3 and 4 compare collectives of different kinds at no more bytes: rule 4's ``all_reduce``
for ``reduce_scatter`` then ``all_gather`` and ``all_to_all`` for ``all_gather`` then ``slice``,
rule 3's ``all_gather`` (then a free ``slice`` or nothing) for a no-op ``all_to_all`` (which sends
what the gather would). With one latency and bandwidth per axis these always hold; with
per-collective figures (``planner.cost``) each holds on an axis only where the kinds' rates say
so (:func:`pruning`), and the search does not apply it elsewhere.

Local copies. A model with a copy bandwidth prices the bytes each collective copies to pack
its blocks and unpack its result (``planner.cost``, :func:`~planner.copies.copy_elements`),
which depend on the move's op, dims and the local lengths around it, all fixed by the state
and the move. Rules 1-3 and three cases of rule 4 still hold: the plans they map to pass
through states of the same local lengths (partial steps and no-op splits change none), so
their other steps copy the same; they drop steps (which copy nothing or more) or trade a
reduce_scatter then an all_gather for an all_reduce (which copies nothing), a slice for an
all_to_all or all_gather (slices copy nothing), or a no-op all_to_all for an all_gather of the
same dim (the same result shape, so the same unpack; its pack copies a padded piece at most
where the all_to_all's copies ``n`` blocks of it). Rule 4's all_to_all for an all_gather then
a slice does not: an all_to_all may pack where the gather does neither, so :func:`pruning`
turns that case off.

Memo: the moves from a state depend on the target only through a little of it (how the
state's dims are split against the target's, rule 2's idle twins, rule 1's partial step), so
every space of one mesh, tensor, element size and rules shares them (:meth:`Space.moves`):
a process plans many pairs whose searches pass through the same states towards different
targets. The moves, and so every search, are the same with the memo warm or cold.

Roles: each move also gives the role of its axis before and after it as a small integer
(:func:`role_code`): replicated, partial with an op, or split on a dim, in place or not (in
place: the axis and every axis outside it on that dim are as in the target). The lower
bound (``planner.bound``) prices roles.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import NamedTuple

from planner.copies import copy_elements
from planner.cost import COPY, large_key
from shardlang.layout import REDUCE_OPS, padded_length, reduce_ops_commute

Dims = tuple[tuple[int, ...], ...]
Partial = tuple[tuple[int, str], ...]
Fields = tuple[Dims, Partial]  # a layout's raw fields
_Length = tuple[int, int]  # a dim and its new local length
# op, axis, dim, to_dim, reduce_op, next state, bytes sent per rank, rounds, role before, role
# after, local elements of the next state, bytes copied locally (``planner.cost``; 0 unless priced)
PackedMove = tuple[str, int, "int | None", "int | None", "str | None", int, int, int, int, int, int, int]


class MoveFields(NamedTuple):
    """A named view of a packed :data:`PackedMove`, ``MoveFields(*move)``: the search generates
    moves as plain tuples (a named record per generated move would cost it time), and code
    that reads one outside the hot loop names its fields through this view.

    Example: ``S0,R over mesh[4]`` to ``R,R``, shape 8x8, f32. The one move of the plan is
    ``("all_gather", 0, 0, None, None, 0, 192, 3, 5, 0, 64, 0)``: an all_gather on axis 0 that
    takes dim 0 out of the split, to state 0 (every axis replicated: the goal); each rank sends
    its 2x8 piece (64 bytes) to the 3 others, 192 bytes in 3 rounds; axis 0's role goes from
    ``role_code("S", 0)`` = 5 to ``REPLICATED`` = 0; the new state holds 64 elements per rank;
    it copies nothing locally (dim 0's blocks are runs of memory, and the pieces are even).
    """

    op: str
    axis: int
    dim: int | None
    to_dim: int | None
    reduce_op: str | None
    state: int  # the state the move reaches
    bytes: int  # sent per rank
    rounds: int
    role_before: int  # the axis' role code before and after the move
    role_after: int
    elements: int  # local elements of the state reached
    copied: int  # bytes copied locally to pack and unpack (planner.cost), 0 when copies are free


# Role codes (shared with the state codes for replicated and partial axes).
REPLICATED = 0
_PARTIAL = {op: 1 + i for i, op in enumerate(REDUCE_OPS)}
_SPLIT = 1 + len(REDUCE_OPS)
# Per partial state code, a bit of its op's commuting class (ops commute iff they share one).
_CLASS_BIT = [0] + [1 << next(i for i, o in enumerate(REDUCE_OPS) if reduce_ops_commute(o, op)) for op in REDUCE_OPS]


def role_code(role: str, dim_or_op: int | str | None = None, in_place: bool = False) -> int:
    """``role_code("R")``, ``role_code("P", op)`` or ``role_code("S", dim, in_place)``."""
    if role == "R":
        return REPLICATED
    if role == "P":
        return _PARTIAL[dim_or_op]  # type: ignore[index]
    return _SPLIT + 2 * dim_or_op + in_place  # type: ignore[operator]


def roles_of(fields: Fields, naxes: int, goal_dims: Dims) -> tuple[int, ...]:
    """The role code of every mesh axis in the layout ``fields`` (in place: as in a target
    whose dims are ``goal_dims``)."""
    dims, partial = fields
    roles = [REPLICATED] * naxes
    for a, op in partial:
        roles[a] = _PARTIAL[op]
    for d, axes in enumerate(dims):
        for i, a in enumerate(axes):
            roles[a] = _SPLIT + 2 * d + (goal_dims[d][: i + 1] == axes[: i + 1])
    return tuple(roles)


def pruning(
    per_round: dict[str, tuple[int, ...]], per_byte: dict[str, tuple[int, ...]]
) -> tuple[tuple[bool, bool, bool], ...]:
    """Per axis, whether (an all_reduce is no dearer than a reduce_scatter and an all_gather
    together, an all_to_all no dearer than an all_gather, an all_gather no dearer than an
    all_to_all), per round and per byte: where rules 4 and 3 hold (module docstring). Equal
    bytes are the worst case: the preferred kind never sends more. Where the model prices
    local copies (rates of :data:`~planner.cost.COPY`), the second is never taken: an
    all_to_all may copy what an all_gather and a slice do not. A kind with a large-message
    regime (``planner.cost``) is priced by one regime or the other by its own bytes, so the
    preferred kinds are taken at their dearest regime and the others at their cheapest."""

    def regimes(rate: dict[str, tuple[int, ...]], op: str, a: int) -> list[int]:
        return [rate[k][a] for k in (op, large_key(op)) if k in rate]

    def no_dearer(a: int, cheap: tuple[str, ...], dear: tuple[str, ...]) -> bool:
        return all(
            len(dear) * sum(max(regimes(rate, op, a)) for op in cheap)
            <= len(cheap) * sum(min(regimes(rate, op, a)) for op in dear)
            for rate in (per_round, per_byte)
        )

    return tuple(
        (
            no_dearer(a, ("all_reduce",), ("reduce_scatter", "all_gather")),
            COPY not in per_byte and no_dearer(a, ("all_to_all",), ("all_gather",)),
            no_dearer(a, ("all_gather",), ("all_to_all",)),
        )
        for a in range(len(per_round["all_gather"]))
    )


# What the moves read of a state whatever the target (Space._decode_for_moves).
_Decoded = tuple[
    tuple[int, ...], tuple[tuple[int, ...], ...], tuple[int, ...], tuple[tuple[int, str], ...], int, tuple[int, ...]
]


# Per dim: how many of its outermost splits are as in the target (``in_place``), and the axis
# that, appended to it, is at its place in the target (``arriving``, or -1); and whether every
# dim is split as in the target.
_Placed = tuple[tuple[int, ...], tuple[int, ...], bool]
# (target dims, a state's splits) -> :data:`_Placed`, for every space; cleared when full.
_PLACED: dict[tuple[Dims, Dims], _Placed] = {}
_PLACED_SIZE = 65_536


def _placed(splits: Dims, goal_dims: Dims) -> _Placed:
    """The :data:`_Placed` of a state whose dims are split by ``splits``."""
    in_place = []
    arriving = []
    whole = True
    for axes, target in zip(splits, goal_dims, strict=True):
        k = 0
        for a, t in zip(axes, target, strict=False):  # their common prefix
            if a != t:
                break
            k += 1
        in_place.append(k)
        arriving.append(target[k] if k == len(axes) < len(target) else -1)
        whole = whole and k == len(axes) == len(target)
    return tuple(in_place), tuple(arriving), whole


class _Shared:
    """What every :class:`Space` of one mesh, tensor shape, element size, rules and copies
    shares, whatever the target: each state's :data:`_Decoded` and the memo of the bytes
    moves copy, and ``ident``, that space's part of the key of the moves memo (``_MOVES``)."""

    def __init__(self, ident: int) -> None:
        self.ident = ident
        self.decoded: dict[int, _Decoded] = {}
        self.copies: dict[tuple[object, ...], int] = {}


# (mesh shape, tensor shape, element size, rules, copies) -> what its spaces share; cleared when
# full (few recur in a process).
_SHARED: dict[tuple[object, ...], _Shared] = {}
_shared_count = itertools.count()
# The moves memo of every space (Space.moves): some 2 kB an entry, cleared when full.
_MOVES: dict[tuple[object, ...], tuple[PackedMove, ...]] = {}
_MOVES_SIZE = 16_384


def _shared(
    mesh_shape: tuple[int, ...], shape: tuple[int, ...], itemsize: int, rules: tuple[object, ...], copies: bool
) -> _Shared:
    key = (mesh_shape, shape, itemsize, rules, copies)
    found = _SHARED.get(key)
    if found is None:
        if len(_SHARED) >= 256:
            _SHARED.clear()
        found = _SHARED[key] = _Shared(next(_shared_count))
    return found


class Space:
    """The move graph for one mesh, tensor shape, element size and target ``(dims, partial)``.

    ``twin_key[a]`` tells which axes are interchangeable cost-wise (rule 2): axes with equal
    keys have the same size and cost rates.
    """

    def __init__(
        self,
        mesh_shape: tuple[int, ...],
        shape: tuple[int, ...],
        itemsize: int,
        goal: Fields,
        twin_key: tuple[object, ...],
        rules: tuple[tuple[bool, bool, bool], ...] | None = None,
        copies: bool = False,
    ) -> None:
        self.mesh_shape = mesh_shape
        # Whether moves count the bytes they copy locally (a model that prices them; else 0).
        self.copies = copies
        # Per axis: rule 4 after reduce_scatter, rule 4 after all_gather, rule 3 for all_to_all.
        self.rules = rules or ((True, True, True),) * len(mesh_shape)
        self._shared = _shared(mesh_shape, shape, itemsize, self.rules, copies)
        self.shape = shape
        self.itemsize = itemsize
        self.goal_dims, goal_partial = goal
        self.goal_ops = dict(goal_partial)
        self._goal_ops_sorted = tuple(sorted(self.goal_ops.items()))  # rule 1 makes the lowest partial first
        naxes = len(mesh_shape)
        # State code of an axis: 0 replicated, 1.. partial ops, _SPLIT + dim * naxes + position.
        self.bits = (_SPLIT + len(shape) * naxes).bit_length()
        self.mask = (1 << self.bits) - 1
        self.goal = self.encode(*goal)
        self.target_roles = roles = roles_of(goal, naxes, self.goal_dims)
        # Rule 2: for each axis not split in the target, the lower axes it is a twin of.
        self.idle_twins_below: tuple[tuple[int, ...] | None, ...] = tuple(
            None
            if roles[a] >= _SPLIT
            else tuple(c for c in range(a) if roles[c] == roles[a] and twin_key[c] == twin_key[a])
            for a in range(naxes)
        )
        self._twins = tuple((a, twins) for a, twins in enumerate(self.idle_twins_below) if twins)

    # --- states --------------------------------------------------------------------------
    def encode(self, dims: Dims, partial: Partial) -> int:
        naxes = len(self.mesh_shape)
        state = 0
        for d, axes in enumerate(dims):
            for position, a in enumerate(axes):
                state |= (_SPLIT + d * naxes + position) << (self.bits * a)
        for a, op in partial:
            state |= _PARTIAL[op] << (self.bits * a)
        return state

    def decode(self, state: int) -> Fields:
        naxes = len(self.mesh_shape)
        dims: list[list[tuple[int, int]]] = [[] for _ in self.shape]
        partial = []
        for a in range(naxes):
            code = state >> (self.bits * a) & self.mask
            if code >= _SPLIT:
                d, position = divmod(code - _SPLIT, naxes)
                dims[d].append((position, a))
            elif code:
                partial.append((a, REDUCE_OPS[code - 1]))
        return tuple(tuple(a for _, a in sorted(axes)) for axes in dims), tuple(partial)

    # --- sizes ---------------------------------------------------------------------------
    def local_elements(self, dims: Dims) -> int:
        return math.prod(
            padded_length(length, (self.mesh_shape[a] for a in axes))
            for length, axes in zip(self.shape, dims, strict=True)
        )

    # --- moves ---------------------------------------------------------------------------
    def moves(self, state: int, elements: int, last: PackedMove | None) -> tuple[PackedMove, ...]:
        """The moves from ``state``, which holds ``elements`` per rank and was reached by
        the move ``last`` (``None`` at the start), less the pruned ones, in a fixed order.

        They depend on the target only through what :meth:`_goal_view` reads of it, and on
        ``last`` only through its op, axis and dim (rule 4), so they are memoized by those
        in the memo that every space of this mesh, tensor, element size, rules and copies
        shares (:class:`_Shared`): a process plans many pairs that pass through the same
        states on their way to different targets. (``elements`` is the state's, the product
        of its dims' local lengths.)"""
        shared = self._shared
        decoded = shared.decoded.get(state)
        if decoded is None:
            if len(shared.decoded) >= _MOVES_SIZE:
                shared.decoded.clear()
            decoded = shared.decoded[state] = self._decode_for_moves(state)
        view = self._goal_view(decoded)
        key = (shared.ident, state, None if last is None else last[:3], *view)
        found = _MOVES.get(key)
        if found is None:
            if len(_MOVES) >= _MOVES_SIZE:
                _MOVES.clear()
            found = _MOVES[key] = tuple(self._moves(state, decoded, elements, last, *view))
        return found

    def _decode_for_moves(self, state: int) -> _Decoded:
        """What the moves need of ``state`` whatever the target: the code of each axis, the
        axes splitting each dim (outermost first) and the product of their sizes, the partial
        axes, those whose reduction may not go first (bits), and each dim's local length."""
        mesh_shape, shape, naxes, bits, mask = self.mesh_shape, self.shape, len(self.mesh_shape), self.bits, self.mask
        codes = []
        splitting = []  # (dim, position, axis) of every splitting axis
        product = [1] * len(shape)  # product of the sizes of the axes splitting each dim
        partial = []
        # Reductions apply in ascending axis order; an axis may go first only if its op
        # commutes with every partial axis before it: ``blocked`` has a bit for each that may not.
        blocked = 0
        classes = 0  # bits of the commuting classes of the partial axes seen so far
        for a in range(naxes):
            code = state >> (bits * a) & mask
            codes.append(code)
            if code >= _SPLIT:
                d, position = divmod(code - _SPLIT, naxes)
                splitting.append((d, position, a))
                product[d] *= mesh_shape[a]
            elif code:
                partial.append((a, REDUCE_OPS[code - 1]))
                own = _CLASS_BIT[code]
                if classes & ~own:
                    blocked |= 1 << a
                classes |= own
        splits: list[list[int]] = [[] for _ in shape]
        for d, _, a in sorted(splitting):
            splits[d].append(a)
        lengths = tuple(-(-length // p) for length, p in zip(shape, product, strict=True))
        return tuple(codes), tuple(map(tuple, splits)), tuple(product), tuple(partial), blocked, lengths

    def _goal_view(self, decoded: _Decoded) -> tuple[_Placed, int, tuple[int, str] | None]:
        """What the moves from a state read of the target: how its dims are split against the
        target's (:func:`_placed`); the axes that rule 2 keeps from slicing, as bits; and rule
        1's partial step (axis, op), or ``None``."""
        codes, splits, _, partial, _, _ = decoded
        key = (self.goal_dims, splits)
        placed = _PLACED.get(key)
        if placed is None:
            if len(_PLACED) >= _PLACED_SIZE:
                _PLACED.clear()
            placed = _PLACED[key] = _placed(splits, self.goal_dims)
        idle = 0
        for axis, twins in self._twins:
            if not codes[axis] and any(not codes[c] for c in twins):
                idle |= 1 << axis
        step = None
        goal_ops = self.goal_ops
        if placed[2] and all(goal_ops.get(a) == op for a, op in partial):
            step = next(((axis, op) for axis, op in self._goal_ops_sorted if not codes[axis]), None)
        return placed, idle, step

    def _moves(
        self,
        state: int,
        decoded: _Decoded,
        elements: int,
        last: PackedMove | None,
        placed: _Placed,
        idle: int,
        partial_step: tuple[int, str] | None,
    ) -> Iterator[PackedMove]:
        """The moves from ``state`` (``decoded``: :meth:`_decode_for_moves`), which holds
        ``elements`` and was reached by ``last``, with what they read of the target
        (:meth:`_goal_view`)."""
        mesh_shape, shape, itemsize = self.mesh_shape, self.shape, self.itemsize
        naxes, ndim, bits = len(mesh_shape), len(shape), self.bits
        codes, splits, product, _, blocked, lengths = decoded
        count = [len(axes) for axes in splits]
        in_place, arriving, _ = placed
        # Copies (0 when free) are memoized by the move and the local lengths.
        copies, memo = self.copies, self._shared.copies
        sized = lengths if copies else ()
        last_op, last_axis, last_dim = (None, None, None) if last is None else (last[0], last[1], last[2])
        all_rules = self.rules
        for axis in range(naxes):
            code = codes[axis]
            n = mesh_shape[axis]
            shift = bits * axis
            again = axis == last_axis
            if code >= _SPLIT:
                d, position = divmod(code - _SPLIT, naxes)
                if position != count[d] - 1 or (again and last_op == "slice"):
                    continue  # only the innermost split of a dim can move; rule 4
                before = _SPLIT + 2 * d + (position < in_place[d])
                length = lengths[d]
                whole = -(-shape[d] // (product[d] // n))  # d's local length once gathered
                gathered_elements = elements // length * whole if length else 0
                gathered = state - (code << shift)
                rules = all_rules[axis]
                if not (again and last_op == "reduce_scatter" and rules[0]):  # rule 4
                    copied = memo.get((0, n, d, sized, whole)) if copies else 0
                    if copied is None:
                        copied = memo[0, n, d, sized, whole] = self._copied("all_gather", n, d, None, sized, (d, whole))
                    yield ("all_gather", axis, d, None, None, gathered, (n - 1) * elements * itemsize, n - 1, before,
                           REPLICATED, gathered_elements, copied)  # fmt: skip
                for j in range(ndim):
                    if j == d or (again and j == last_dim):  # rule 4 (last_dim: where a2a took it from)
                        continue
                    placed = arriving[j] == axis
                    length = lengths[j]
                    if not placed and (n == 1 or (length <= 1 and rules[2])):
                        continue  # rule 3
                    cut = -(-length // n)
                    if length:
                        nbytes = (n - 1) * (elements // length * cut) * itemsize
                        moved_elements = gathered_elements // length * cut
                    else:
                        nbytes = moved_elements = 0
                    copied = memo.get((1, n, d, j, sized, whole, cut)) if copies else 0
                    if copied is None:
                        copied = memo[1, n, d, j, sized, whole, cut] = self._copied(
                            "all_to_all", n, d, j, sized, (d, whole), (j, cut)
                        )
                    yield ("all_to_all", axis, d, j, None, gathered + ((_SPLIT + j * naxes + count[j]) << shift),
                           nbytes, n - 1, before, _SPLIT + 2 * j + placed, moved_elements, copied)  # fmt: skip
            elif code:
                if blocked >> axis & 1:
                    continue
                op = REDUCE_OPS[code - 1]
                reduced = state - (code << shift)
                yield ("all_reduce", axis, None, None, op, reduced, 2 * (n - 1) * -(-elements // n) * itemsize,
                       2 * (n - 1), code, REPLICATED, elements, 0)  # fmt: skip
                for j in range(ndim):
                    length = lengths[j]
                    cut = -(-length // n)
                    scattered_elements = elements // length * cut if length else 0
                    copied = memo.get((2, n, j, sized, cut)) if copies else 0
                    if copied is None:
                        copied = memo[2, n, j, sized, cut] = self._copied("reduce_scatter", n, j, None, sized, (j, cut))
                    yield ("reduce_scatter", axis, j, None, op, reduced + ((_SPLIT + j * naxes + count[j]) << shift),
                           (n - 1) * scattered_elements * itemsize, n - 1, code,
                           _SPLIT + 2 * j + (arriving[j] == axis), scattered_elements, copied)  # fmt: skip
            else:
                if idle >> axis & 1:
                    continue  # rule 2
                if again and last_op == "all_gather" and all_rules[axis][1]:
                    continue  # rule 4
                after_slice = last_op == "slice" and axis < last_axis  # type: ignore[operator]
                for j in range(ndim):
                    placed = arriving[j] == axis
                    length = lengths[j]
                    if not placed and (n == 1 or length <= 1):
                        continue  # rule 3
                    if after_slice and j != last_dim:
                        continue  # rule 4
                    yield ("slice", axis, j, None, None, state + ((_SPLIT + j * naxes + count[j]) << shift), 0, 0,
                           REPLICATED, _SPLIT + 2 * j + placed, elements // length * -(-length // n) if length else 0,
                           0)  # fmt: skip
        # Rule 1: partial steps last, once nothing else is left to do.
        if partial_step is not None:
            axis, op = partial_step
            made_partial = state + (_PARTIAL[op] << (bits * axis))
            yield ("partial", axis, None, None, op, made_partial, 0, 0, REPLICATED, _PARTIAL[op], elements, 0)

    def _copied(
        self, op: str, n: int, dim: int, to_dim: int | None, lengths: tuple[int, ...], *changed: _Length
    ) -> int:
        """The bytes a move copies locally (``planner.copies.copy_elements``) from the local
        ``lengths``, whose dims ``changed`` take new lengths."""
        after = [*lengths]
        for d, length in changed:
            after[d] = length
        return copy_elements(op, n, dim, to_dim, lengths, after) * self.itemsize
