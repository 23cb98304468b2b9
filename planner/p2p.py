"""Point-to-point steps: each target rank receives exactly the elements it lacks, each from one holder.

Messages. For every target rank ``t`` and every source block (``planner.holdings``) that
overlaps ``t``'s target piece, one transfer carries the overlap: from ``t`` itself when it holds
that block (a local copy: a rank's own data never goes over the wire), else from one holder of
the block. The overlaps partition the target piece, so every element arrives exactly once, each
target rank receives exactly the receive lower bound's bytes, and it receives the fewest
messages possible: one per block it needs and does not hold (a sender holds one block).

Senders (Alpa's load-balancing problem). What each rank receives is fixed by the layouts; the
choice of holders only decides what each rank sends. Every source rank holds one block, so the
choice falls apart into one problem per block: put the block's messages (jobs, sized in bytes)
on its holders (identical machines) so that the largest volume sent is least (P||Cmax). Each is
solved by LPT (Graham 1969): messages by decreasing size, each to the holder that has sent the
least so far (ties: the faster link, then fewer messages, then mesh order). LPT is within a
factor ``4/3 - 1/(3m)`` of the optimum on ``m`` machines. The step's bytes, the largest per-rank
``max(sent, received)``, equal ``max(largest received, largest sent)``; the first is fixed and the
second is a maximum over independent blocks, so they are within ``4/3 - 1/(3m)`` of the best
sender choice with one holder per message, ``m`` the most holders any block has.

Cost model of a point-to-point step. Per rank ``r``, over its messages sent ``Ms`` and received
``Mr`` (local copies excluded)::

    time_r = max(sum of alpha_link over Ms, sum of alpha_link over Mr)
           + max(sum of bytes / beta_link over Ms, sum of bytes / beta_link over Mr)

and the step's time is the largest ``time_r``, plus the model's per-step overhead
(``planner.cost``). Links are full duplex, so sending and receiving overlap; with one alpha and
beta on every link this is ``messages * alpha + max(sent, received) / beta`` with messages = the
larger of the counts sent and received, which prices a ring all_gather done by messages (n-1
sent and n-1 received per rank) exactly as the all_gather (n-1 rounds). Links: two ranks of one
mesh that differ on several mesh axes are joined by the slowest of those axes (least bandwidth,
largest alpha); between two different meshes (another shape or rank set) every message is priced
at the slowest bandwidth and largest alpha of all axes of both meshes, as nothing says which
axis joins them.

Local copies. Where the model prices them (``copy_bandwidth``), ``time_r`` also pays the bytes
rank ``r`` copies (``planner.copies.exchange_copy_elements``: the boxes it keeps, the messages it
packs or places), added: the executor packs before posting and places after waiting (its kept
boxes, copied while the messages travel, are counted the same way).
"""

from __future__ import annotations

import attrs

from planner.copies import exchange_copy_elements
from planner.cost import COPY, STEP, CostModel
from planner.errors import PlanError
from planner.holdings import VECTORIZE_FROM, blocks_of, holder_count
from planner.pattern import ExchangePattern
from planner.plans import Plan, Step, Transfer
from planner.search import DEFAULT_MAX_STATES, budget_error, checked
from planner.units import integer_op_rates
from shardlang.box import Box
from shardlang.dtypes import itemsize as dtype_itemsize
from shardlang.layout import Layout
from shardlang.mesh import Mesh

__all__ = [
    "Links",
    "PlannedExchange",
    "exchange_states",
    "message_count",
    "point_to_point_plan",
    "pricing_states",
    "time_lower_bound",
]


@attrs.frozen
class Link:
    """The price of one message: per message and per byte, in integer units and in seconds."""

    units_per_message: int
    units_per_byte: int
    alpha: float
    bandwidth: float


class Links:
    """Message prices between the ranks of a step from ``src_mesh`` to ``dst_mesh`` (the
    point-to-point figures), and the per-op, per-axis collective rates of both meshes, all in
    one integer scale (``integer_op_rates``), so that collective and point-to-point steps of one
    plan compare exactly."""

    def __init__(self, cost: CostModel, src_mesh: Mesh, dst_mesh: Mesh) -> None:
        src_figures, dst_figures = cost.figures(src_mesh), cost.figures(dst_mesh)
        self.src_rates, self.dst_rates = integer_op_rates(src_figures, dst_figures)
        # What every step pays (planner.cost): in units the overhead and the margin, in seconds the overhead.
        self.step_units, self.overhead = self.src_rates[0][STEP][0], cost.overhead
        # A byte copied locally, in units (0: copies are free, and not counted).
        self.copy_units = self.src_rates[1][COPY][0] if COPY in self.src_rates[1] else 0
        self.copy_seconds = cost.copy_seconds
        # Messages are priced with the point-to-point figures of both meshes.
        src_alpha, src_bandwidth = src_figures["point_to_point"]
        dst_alpha, dst_bandwidth = dst_figures["point_to_point"]
        alpha, bandwidth = src_alpha + dst_alpha, src_bandwidth + dst_bandwidth
        per_round = self.src_rates[0]["point_to_point"] + self.dst_rates[0]["point_to_point"]
        per_byte = self.src_rates[1]["point_to_point"] + self.dst_rates[1]["point_to_point"]
        n = src_mesh.ndim
        self._mesh = dst_mesh if src_mesh.same_geometry(dst_mesh) else None
        self._axes = tuple(zip(per_round[n:], per_byte[n:], dst_alpha, dst_bandwidth, strict=True))
        self._slowest = Link(max(per_round), max(per_byte), max(alpha), min(bandwidth))
        # No message is cheaper than this, per message and per byte (a lower-bound price).
        self.fastest = (
            Link(min(per_round[n:]), min(per_byte[n:]), min(dst_alpha), max(dst_bandwidth))
            if self._mesh is not None
            else self._slowest
        )
        self._links: dict[tuple[int, int], Link] = {}

    def between(self, sender: int, receiver: int) -> Link:
        """The link a message from global rank ``sender`` to ``receiver`` takes (two distinct ranks)."""
        if self._mesh is None:
            return self._slowest
        key = (sender, receiver)
        if key not in self._links:
            a, b = self._mesh.coordinate(sender), self._mesh.coordinate(receiver)
            self._links[key] = self.over(tuple(axis for axis, (i, j) in enumerate(zip(a, b, strict=True)) if i != j))
        return self._links[key]

    def over(self, axes: tuple[int, ...]) -> Link:
        """The link between two ranks of one mesh that differ on ``axes`` (at least one): the slowest of them."""
        if self._mesh is None:
            return self._slowest
        rates = [self._axes[a] for a in axes]
        return Link(
            max(r[0] for r in rates), max(r[1] for r in rates), max(r[2] for r in rates), min(r[3] for r in rates)
        )


@attrs.define
class _Traffic:
    """What one rank sends and receives in a step (local copies excluded)."""

    sent: int = 0
    received: int = 0
    units: list[int] = attrs.Factory(lambda: [0, 0, 0, 0])  # latency sent, received; bytes sent, received
    seconds: list[float] = attrs.Factory(lambda: [0.0, 0.0, 0.0, 0.0])

    def add(self, link: Link, nbytes: int, receiving: bool) -> None:
        if receiving:
            self.received += nbytes
        else:
            self.sent += nbytes
        self.units[receiving] += link.units_per_message
        self.units[2 + receiving] += nbytes * link.units_per_byte
        self.seconds[receiving] += link.alpha
        self.seconds[2 + receiving] += nbytes / link.bandwidth

    def time_units(self) -> int:
        u = self.units
        return max(u[0], u[1]) + max(u[2], u[3])

    def time_seconds(self) -> float:
        s = self.seconds
        return max(s[0], s[1]) + max(s[2], s[3])


class PlannedExchange:
    """The messages of a point-to-point step from ``before`` to ``after`` (neither partial; on
    the meshes ``links`` was made for), senders chosen; ``units`` is its time in the integer
    units of ``links``. :meth:`step` makes the step record: its transfers a list, or where
    :func:`patterned` a :class:`~planner.pattern.ExchangePattern`, priced from its table in
    numpy (the same transfers, the same figures)."""

    def __init__(self, before: Layout, after: Layout, shape: tuple[int, ...], itemsize: int, links: Links) -> None:
        self.after = after
        self._overhead = links.overhead
        if patterned(before, after, shape):
            self._price_pattern(ExchangePattern(before, after, shape), itemsize, links)
        else:
            self._price_list(before, after, shape, itemsize, links)

    def _price_list(self, before: Layout, after: Layout, shape: tuple[int, ...], itemsize: int, links: Links) -> None:
        blocks = blocks_of(before, shape)
        # One slot per (target rank, overlapping block), in target mesh order then block
        # order: [sender (None until chosen), receiver, part]; per block, its messages.
        slots: list[list] = []
        jobs: dict[Box, list[tuple[int, int, int]]] = {}
        # Only target ranks with a nonempty piece receive (in mesh order): the work follows the
        # ranks that hold data, not the meshes' sizes.
        for position, (receiver, piece) in enumerate(blocks_of(after, shape).of_rank.items()):
            own = blocks.of_rank.get(receiver)
            for block, part in blocks.overlapping(piece):
                if block == own:
                    slots.append([receiver, receiver, part])
                else:
                    jobs.setdefault(block, []).append((-part.numel, position, len(slots)))
                    slots.append([None, receiver, part])
        traffic: dict[int, _Traffic] = {}
        for block, messages in jobs.items():
            holders = blocks.holders[block]
            load = dict.fromkeys(holders, 0)
            count = dict.fromkeys(holders, 0)
            for negative_size, _, slot in sorted(messages):  # LPT: largest first
                receiver = slots[slot][1]
                sender = min(
                    holders,
                    key=lambda h, r=receiver: (  # type: ignore[misc]
                        load[h],
                        links.between(h, r).units_per_byte,
                        links.between(h, r).units_per_message,
                        count[h],
                    ),
                )
                load[sender] -= negative_size
                count[sender] += 1
                slots[slot][0] = sender
                link = links.between(sender, receiver)
                nbytes = -negative_size * itemsize
                traffic.setdefault(sender, _Traffic()).add(link, nbytes, receiving=False)
                traffic.setdefault(receiver, _Traffic()).add(link, nbytes, receiving=True)
        copied = {}
        if links.copy_units:  # priced: every rank's local copies (planner.copies.exchange_copy_elements)
            elements = exchange_copy_elements(
                slots, lambda r: before.rank_piece(shape, r), lambda r: after.rank_piece(shape, r)
            )
            copied = {rank: count * itemsize for rank, count in elements.items()}
        idle = _Traffic()
        ranks = traffic.keys() | copied.keys()
        self.transfers: tuple[Transfer, ...] | ExchangePattern = tuple(
            Transfer(sender, receiver, part) for sender, receiver, part in slots
        )
        self.bytes = max((max(t.sent, t.received) for t in traffic.values()), default=0)
        self.units = (
            max(
                (traffic.get(r, idle).time_units() + copied.get(r, 0) * links.copy_units for r in ranks),
                default=0,
            )
            + links.step_units
        )
        self._seconds = max(
            (traffic.get(r, idle).time_seconds() + links.copy_seconds(copied.get(r, 0)) for r in ranks), default=0.0
        )

    def _price_pattern(self, pattern: ExchangePattern, itemsize: int, links: Links) -> None:
        """The figures of :meth:`_price_list` from the pattern's table: per rank and link, the
        messages and bytes it sends and receives (numpy), then the time of each distinct row of
        those counts in exact integers."""
        import numpy as np

        from planner.pattern import table_of
        from planner.pieces import copied_elements, distinct_rows, near_largest, pieces_of

        table = table_of(pattern)
        remote = np.flatnonzero(table.sender != table.receiver)
        sender, receiver = table.sender[remote], table.receiver[remote]
        nbytes = table.numel[remote] * itemsize
        kind = np.zeros(len(remote), dtype=np.int64)
        classes = [links.fastest]  # one mesh and no message: unused; two meshes: every link is alike
        if links._mesh is None:
            classes = [links.over(())]
        elif len(remote):  # one mesh: a message takes the slowest axis its ranks differ on
            target = pieces_of(pattern.target, pattern.shape)
            a, b = target.position_of(sender), table.receiver_position[remote]
            mask = np.zeros(len(remote), dtype=np.int64)
            for axis, (n, stride) in enumerate(zip(target.sizes, target.strides, strict=True)):
                mask |= (((a // stride) % n) != ((b // stride) % n)).astype(np.int64) << axis
            masks, kind = np.unique(mask, return_inverse=True)
            classes = [links.over(tuple(x for x in range(len(target.sizes)) if m >> x & 1)) for m in masks.tolist()]
        copy_ranks, copy_elements = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        if links.copy_units:
            copy_ranks, copy_elements = copied_elements(pattern.source, pattern.target, pattern.shape, table)
        ranks = np.unique(np.concatenate([sender, receiver, copy_ranks]))
        sends, receives = np.searchsorted(ranks, sender), np.searchsorted(ranks, receiver)
        # Per rank: per link class, messages sent and received and bytes sent and received; then bytes copied.
        counts = np.zeros((len(ranks), 4 * len(classes) + 1), dtype=np.int64)
        for c in range(len(classes)):
            chosen = kind == c
            for i, (at, weights) in enumerate(((sends, None), (receives, None), (sends, nbytes), (receives, nbytes))):
                # float sums of integer bytes: exact below 2**53 bytes per rank
                w = None if weights is None else weights[chosen]
                counts[:, 4 * c + i] = np.bincount(at[chosen], weights=w, minlength=len(ranks))
        counts[np.searchsorted(ranks, copy_ranks), -1] = copy_elements * itemsize
        sent, received = counts[:, 2:-1:4].sum(axis=1), counts[:, 3:-1:4].sum(axis=1)
        self.transfers = pattern
        self.bytes = int(np.maximum(sent, received).max()) if len(ranks) else 0
        # The slowest rank, exactly: the rows near the largest time in floats, then each in integers.
        estimate = np.zeros((len(ranks), 4))
        for c, link in enumerate(classes):
            for i in range(4):
                estimate[:, i] += counts[:, 4 * c + i] * float(link.units_per_message if i < 2 else link.units_per_byte)
        total = np.maximum(estimate[:, 0], estimate[:, 1]) + np.maximum(estimate[:, 2], estimate[:, 3])
        total += counts[:, -1] * float(links.copy_units)
        rows = set(distinct_rows(counts[near_largest(total)]))
        for c, link in enumerate(classes):  # and the longest in seconds (the same rows unless copies are priced)
            for i in range(4):
                estimate[:, i] = counts[:, 4 * c + i] * (link.alpha if i < 2 else 1 / link.bandwidth)
        total = np.maximum(estimate[:, 0], estimate[:, 1]) + np.maximum(estimate[:, 2], estimate[:, 3])
        total += np.array([links.copy_seconds(1)]) * counts[:, -1]
        rows |= set(distinct_rows(counts[near_largest(total)]))
        units, seconds = 0, 0.0
        for row in rows:
            per_class = [row[4 * c : 4 * c + 4] for c in range(len(classes))]
            u = [sum(x[i] * (link.units_per_message if i < 2 else link.units_per_byte) for x, link in
                     zip(per_class, classes, strict=True)) for i in range(4)]  # fmt: skip
            s = [sum(x[i] * link.alpha if i < 2 else x[i] / link.bandwidth for x, link in
                     zip(per_class, classes, strict=True)) for i in range(4)]  # fmt: skip
            units = max(units, max(u[0], u[1]) + max(u[2], u[3]) + row[-1] * links.copy_units)
            seconds = max(seconds, max(s[0], s[1]) + max(s[2], s[3]) + links.copy_seconds(row[-1]))
        self.units = units + links.step_units
        self._seconds = seconds

    def step(self) -> Step:
        return Step(
            op="point_to_point",
            axis=None,
            dim=None,
            to_dim=None,
            reduce_op=None,
            layout=self.after,
            bytes=self.bytes,
            seconds=self._seconds + self._overhead,
            transfers=self.transfers,
        )


# A step of more transfers than this is pattern-valued where its senders take turns
# (planner.pattern) and more than VECTORIZE_FROM ranks hold its pieces; smaller steps keep their
# list, as before patterns.
PATTERN_FROM = 1024
# The budget charges numpy work, row by row of its arrays, at this many rows per state.
ROWS_PER_STATE = 32


def _holders(before: Layout, after: Layout, shape: tuple[int, ...]) -> int:
    return holder_count(before, shape) + holder_count(after, shape)


def vectorized(before: Layout, after: Layout, shape: tuple[int, ...]) -> bool:
    """Whether the step ``before -> after`` is priced in numpy (``planner.pieces``): more than
    ``planner.holdings.VECTORIZE_FROM`` ranks hold its pieces (:data:`PATTERN_FROM` while it is
    lower: the tests turn patterns on for every step). Smaller steps walk their blocks."""
    return _holders(before, after, shape) > min(VECTORIZE_FROM, PATTERN_FROM)


def patterned(before: Layout, after: Layout, shape: tuple[int, ...]) -> bool:
    """Whether the step ``before -> after`` is pattern-valued: priced in numpy, more than
    :data:`PATTERN_FROM` transfers, and the senders the planner chooses are the pattern's turns
    (one holder per block, or on two meshes, where every link is alike, messages of one size per
    block)."""
    if not vectorized(before, after, shape):
        return False
    from planner.pieces import cyclic_senders_hold, exchange_rows, pieces_of

    if pieces_of(before, shape).holders_per_block > 1 and before.mesh.same_geometry(after.mesh):
        return False
    return exchange_rows(before, after, shape) > PATTERN_FROM and cyclic_senders_hold(before, after, shape)


def time_lower_bound(before: Layout, after: Layout, shape: tuple[int, ...], itemsize: int, links: Links) -> int:
    """A lower bound on ``PlannedExchange(before, after, ...).units`` without choosing senders: the
    largest, over target ranks, of what receiving alone costs on the fastest link (every block
    overlapping its piece but the one it holds, and the bytes it lacks), plus the step's overhead
    and margin (``Links.step_units``). Over the target blocks, or where :func:`vectorized` in
    numpy over the ranks holding a target piece."""
    fastest = links.fastest
    if vectorized(before, after, shape):
        import numpy as np

        from planner.pieces import distinct_rows, near_largest, target_needs

        messages, elements, held = target_needs(before, after, shape)
        messages, missing = messages - (held > 0), (elements - held) * itemsize
        near = near_largest(messages * float(fastest.units_per_message) + missing * float(fastest.units_per_byte))
        pairs = distinct_rows(np.stack([messages[near], missing[near]], axis=1))
        bound = max((m * fastest.units_per_message + b * fastest.units_per_byte for m, b in pairs), default=0)
        return bound + links.step_units
    source = blocks_of(before, shape)
    bound = 0
    for target, receivers in blocks_of(after, shape).holders.items():
        messages, elements = source.count_overlapping(target), target.numel
        least_held = 0 if any(r not in source.of_rank for r in receivers) else elements
        for receiver in receivers:
            if least_held:
                held = source.of_rank[receiver].intersect(target)
                least_held = min(least_held, held.numel if held else 0)
        # The receiver that holds least needs the most bytes; it lacks all blocks but (maybe) one.
        missing = (elements - least_held) * itemsize
        bound = max(bound, (messages - (least_held > 0)) * fastest.units_per_message + missing * fastest.units_per_byte)
    return bound + links.step_units


def message_count(before: Layout, after: Layout, shape: tuple[int, ...]) -> int:
    """How many transfers ``PlannedExchange(before, after, ...)`` makes (local copies included), counted
    from the blocks (or where :func:`vectorized` the cuts) without making them."""
    if vectorized(before, after, shape):
        from planner.pieces import exchange_rows

        return exchange_rows(before, after, shape)
    source = blocks_of(before, shape)
    return sum(source.count_overlapping(t) * len(r) for t, r in blocks_of(after, shape).holders.items())


def pricing_states(before: Layout, after: Layout, shape: tuple[int, ...]) -> int:
    """What pricing the step ``before -> after`` charges to the budget (``planner.cheapest``), counted
    before anything is built: one state per rank holding a piece on either side
    (``planner.holdings.holder_count``); where :func:`vectorized`, one per :data:`ROWS_PER_STATE`
    of them, and for a pattern-valued step one per :data:`ROWS_PER_STATE` transfers (its table)."""
    holders = _holders(before, after, shape)
    if not vectorized(before, after, shape):
        return holders
    rows = message_count(before, after, shape) if patterned(before, after, shape) else 0
    return -(-holders // ROWS_PER_STATE) + -(-rows // ROWS_PER_STATE)


def exchange_states(before: Layout, after: Layout, shape: tuple[int, ...]) -> int:
    """What making the step's list charges besides :func:`pricing_states`: one state per transfer,
    none for a pattern-valued step (charged by :func:`pricing_states`)."""
    return 0 if patterned(before, after, shape) else message_count(before, after, shape)


def point_to_point_plan(
    src: Layout,
    dst: Layout,
    shape: tuple[int, ...] | list[int],
    dtype: str = "f32",
    cost: CostModel | None = None,
    *,
    max_states: int = DEFAULT_MAX_STATES,
) -> Plan:
    """The plan of one point-to-point step from ``src`` to ``dst`` (same mesh or not, neither
    partial): every target rank receives exactly the elements it lacks (the receive lower
    bound), each from one holder, senders balanced as the module docstring says.

    ``planner.plan`` chooses between this, collectives and mixes; this is the plain step. Its
    budget (``planner.cheapest``): :func:`pricing_states` (ranks holding nothing cost nothing), then
    :func:`exchange_states`; a :class:`PlanBudgetError` past ``max_states``. A large step whose
    senders take turns is pattern-valued (:func:`patterned`, ``planner.pattern``)."""
    request = checked(src, dst, shape, dtype, cost, None, max_states)
    shape, cost = request.shape, request.cost
    pricing = pricing_states(src, dst, shape)
    if pricing > max_states:
        raise budget_error(src, dst, shape, max_states, "listing the blocks of both meshes' ranks")
    for name, layout in (("source", src), ("target", dst)):
        if layout.is_partial:
            raise PlanError(
                f"cannot plan {src} -> {dst} by one point-to-point step: the {name} is partial "
                f"(planner.plan(..., point_to_point=True) resolves partials with collectives)"
            )
    if pricing + exchange_states(src, dst, shape) > max_states:
        raise budget_error(src, dst, shape, max_states, "the messages of the point-to-point step")
    step = PlannedExchange(src, dst, shape, dtype_itemsize(dtype), Links(cost, src.mesh, dst.mesh)).step()
    return Plan(src=src, dst=dst, shape=shape, dtype=dtype, steps=(step,), cost=cost)
