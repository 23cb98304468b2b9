"""Search speed against a naive exact search: the planner's A* (``planner.search``) and a plain
uniform-cost search (Dijkstra, no bound, no pruning) on the same pairs, under a calibrated model.

    .venv/bin/python bench/bench_search_speed.py [--pairs 80] [--repeat 5] [--seed 0]

The naive search, :class:`Naive`, is written here from the cost and copy tables alone
(``planner.cost``'s and ``planner.copies``' docstrings) and shares no code with ``planner/``: its
own states (a layout's raw fields, ``(dims, partial)``), its own moves (the full baseline move
set), its own sizes, and exact times as integers on its own common scale of the model's figures.
It pops states cheapest (time, steps) first and ends at the target, so it returns the optimum;
every pair's plan from the planner is replayed in it (each step a legal move with the table's
bytes) and its exact (time, steps) must equal the naive optimum, or the script stops.

Pairs: random layouts on [4,8], [4,4,4] and [2,2,2,8], tensors of 1-3 dims with uneven lengths;
"partial-heavy" sources (each axis pending a reduction with probability 0.6, any reduce op,
so the order of reductions matters), mostly split or replicated targets. The model,
:func:`calibrated_model`, is the gloo figures ``shardlang calibrate`` measured on a 2-core machine
(docs/examples/hints_2x2.json: per-kind latency and bandwidth, the step overhead, the copy
bandwidth), slower on outer axes, with the choice margin of the stored calibration run and a
large-message regime for all_reduce: every executor term the search prices.

Each pair is planned cold (:func:`cold`: the plan memo and the memos searches share cleared)
and searched naively, ``--repeat`` times each, alternating, timed in this process's CPU time
(``time.process_time``: on a shared machine the time other processes hold the cores is not
counted); the best run of each counts. Tables that depend only on the mesh and the model stay
cached between pairs on both sides, as in a process that plans many pairs. The ratio per pair
is ours / naive; the table gives its median per mesh, and the states each search generated.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import results as bench_results

import planner
from planner import search, space
from shardlang import Layout, Mesh

MESHES = ((4, 8), (4, 4, 4), (2, 2, 2, 8))
LENGTHS = (1, 3, 7, 16, 37, 64, 100, 1000, 4096, 50304)
OPS = ("sum", "avg", "max", "min")
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
# Reductions over two axes commute when their ops are both linear, or the same op.
_CLASS = {"sum": "linear", "avg": "linear", "max": "max", "min": "min"}
ITEMSIZE = {"f32": 4, "bf16": 2, "f64": 8}

# State: (dims, partial) as a Layout holds them: per tensor dim the splitting mesh axes,
# outermost first; the pending (axis, op) in ascending axis order.
State = tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, str], ...]]
# A move: (op, axis, dim, to_dim, reduce_op, next state, bytes sent per rank, rounds, bytes copied).
Move = tuple[str, int, "int | None", "int | None", "str | None", State, int, int, int]


def _values(value: float | tuple[float, ...], naxes: int) -> tuple[float, ...]:
    return tuple(value) if isinstance(value, tuple) else (value,) * naxes


class Naive:
    """Uniform-cost search over the full baseline move set of one mesh, tensor and model."""

    def __init__(self, mesh_shape: tuple[int, ...], cost: planner.CostModel) -> None:
        self.mesh_shape = mesh_shape
        naxes = len(mesh_shape)
        # Per kind and axis, the regimes as (from bytes, seconds per round, seconds per byte).
        regimes: dict[str, list[list[tuple[int, Fraction, Fraction]]]] = {}
        for kind in KINDS:
            own = next((c for c in cost.ops if c.op == kind), None)
            alpha, bandwidth = (cost.alpha, cost.bandwidth) if own is None else (own.alpha, own.bandwidth)
            figures = zip(_values(alpha, naxes), _values(bandwidth, naxes), strict=True)
            rows = [[(0, Fraction(a), 1 / Fraction(b))] for a, b in figures]
            if own is not None and own.large is not None:
                starts = own.large.from_bytes
                starts = starts if isinstance(starts, tuple) else (starts,) * naxes
                large = zip(starts, _values(own.large.alpha, naxes), _values(own.large.bandwidth, naxes), strict=True)
                for row, (start, a, b) in zip(rows, large, strict=True):
                    row.append((start, Fraction(a), 1 / Fraction(b)))
            regimes[kind] = rows
        step = Fraction(cost.overhead) + Fraction(cost.margin)
        copy = 0 if cost.copy_bandwidth is None else 1 / Fraction(cost.copy_bandwidth)
        figures = [step, Fraction(copy)] + [f for rows in regimes.values() for row in rows for r in row for f in r[1:]]
        self.scale = math.lcm(*(f.denominator for f in figures))
        self.step_units = int(step * self.scale)
        self.copy_units = int(copy * self.scale)
        # kind -> per axis [(from bytes, units per round, units per byte), ...], largest start first
        self.units = {
            kind: [sorted(((s, int(a * self.scale), int(b * self.scale)) for s, a, b in row), reverse=True)
                   for row in rows]
            for kind, rows in regimes.items()
        }  # fmt: skip

    # --- sizes and moves -----------------------------------------------------------------
    def local_shape(self, shape: tuple[int, ...], dims: tuple[tuple[int, ...], ...]) -> list[int]:
        out = []
        for length, axes in zip(shape, dims, strict=True):
            for a in axes:
                length = -(-length // self.mesh_shape[a])
            out.append(length)
        return out

    def moves(self, state: State, shape: tuple[int, ...], itemsize: int, goal_partial: dict[int, str]) -> list[Move]:
        dims, partial = state
        pending = dict(partial)
        here = self.local_shape(shape, dims)
        elements = math.prod(here)
        used = {a for axes in dims for a in axes} | set(pending)
        out: list[Move] = []
        for a, n in enumerate(self.mesh_shape):
            if a in pending:
                op = pending[a]
                if any(b < a and _CLASS[o] != _CLASS[op] for b, o in partial):
                    continue  # reductions go in ascending axis order unless the ops commute
                left = tuple((b, o) for b, o in partial if b != a)
                out.append(("all_reduce", a, None, None, op, (dims, left), 2 * (n - 1) * -(-elements // n) * itemsize,
                            2 * (n - 1), 0))  # fmt: skip
                for d in range(len(dims)):
                    nxt_dims = _put(dims, d, (*dims[d], a))
                    after = self.local_shape(shape, nxt_dims)
                    copied = self.copied("reduce_scatter", n, d, None, here, after) * itemsize
                    out.append(("reduce_scatter", a, d, None, op, (nxt_dims, left),
                                (n - 1) * math.prod(after) * itemsize, n - 1, copied))  # fmt: skip
            elif a not in used:
                for d in range(len(dims)):
                    out.append(("slice", a, d, None, None, (_put(dims, d, (*dims[d], a)), partial), 0, 0, 0))
                if a in goal_partial:
                    made = tuple(sorted((*partial, (a, goal_partial[a]))))
                    out.append(("partial", a, None, None, goal_partial[a], (dims, made), 0, 0, 0))
        for d, axes in enumerate(dims):
            if not axes:
                continue
            a = axes[-1]  # only the innermost split of a dim can leave it
            n = self.mesh_shape[a]
            gathered = _put(dims, d, axes[:-1])
            after = self.local_shape(shape, gathered)
            copied = self.copied("all_gather", n, d, None, here, after) * itemsize
            out.append(("all_gather", a, d, None, None, (gathered, partial), (n - 1) * elements * itemsize, n - 1,
                        copied))  # fmt: skip
            for j in range(len(dims)):
                if j == d:
                    continue
                moved = _put(gathered, j, (*dims[j], a))
                after = self.local_shape(shape, moved)
                block = [-(-x // n) if k == j else x for k, x in enumerate(here)]
                copied = self.copied("all_to_all", n, d, j, here, after) * itemsize
                out.append(("all_to_all", a, d, j, None, (moved, partial), (n - 1) * math.prod(block) * itemsize, n - 1,
                            copied))  # fmt: skip
        return out

    @staticmethod
    def copied(op: str, n: int, d: int, j: int | None, before: list[int], after: list[int]) -> int:
        """Elements copied to pack and unpack, by the copy table of ``planner.copies``."""
        if n == 1:
            return 0

        def leads(k: int, shape: list[int]) -> bool:  # blocks along k are runs of memory
            return math.prod(shape[:k]) == 1

        if op == "all_gather":
            pack = math.prod(before) if after[d] != n * before[d] else 0
            return pack + (0 if leads(d, before) else math.prod(after))
        if op == "reduce_scatter":
            return 0 if before[d] == n * after[d] and leads(d, before) else n * math.prod(after)
        block = [after[k] if k == j else x for k, x in enumerate(before)]
        fits = before[j] == n * after[j] and after[d] == n * before[d] and leads(j, before)
        return (0 if fits else n * math.prod(block)) + (0 if leads(d, block) else math.prod(after))

    def price(self, op: str, axis: int, nbytes: int, rounds: int, copied: int) -> int:
        """A move's exact units: its kind's regime for its bytes, the step's overhead and margin, its copies."""
        units = self.step_units + copied * self.copy_units
        if op in ("slice", "partial"):
            return units
        _, per_round, per_byte = next(r for r in self.units[op][axis] if nbytes >= r[0])
        return units + rounds * per_round + nbytes * per_byte

    # --- search --------------------------------------------------------------------------
    def solve(self, src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int) -> tuple[int, int, int]:
        """(least units, fewest steps at that time, states generated) from ``src`` to ``dst``."""
        start, goal = _state(src), _state(dst)
        goal_partial = dict(dst.partial)
        best = {start: (0, 0)}
        heap = [(0, 0, 0, start)]
        tie = 0
        while heap:
            t, steps, _, state = heapq.heappop(heap)
            if best[state] < (t, steps):
                continue
            if state == goal:
                return t, steps, tie
            for op, a, _d, _j, _r, nxt, nbytes, rounds, copied in self.moves(state, shape, itemsize, goal_partial):
                key = (t + self.price(op, a, nbytes, rounds, copied), steps + 1)
                if key < best.get(nxt, (math.inf, 0)):
                    best[nxt] = key
                    tie += 1
                    heapq.heappush(heap, (*key, tie, nxt))
        raise AssertionError(f"no plan takes {src} to {dst}")

    def replay(self, plan: planner.Plan, itemsize: int) -> tuple[int, int]:
        """(exact units, steps) of ``plan``, each step checked to be a legal move with the table's bytes."""
        state = _state(plan.src)
        goal_partial = dict(plan.dst.partial)
        total = 0
        for step in plan.steps:
            want = (step.op, step.axis, step.dim, step.to_dim, step.reduce_op, _state(step.layout))
            found = [m for m in self.moves(state, plan.shape, itemsize, goal_partial) if m[:6] == want]
            assert len(found) == 1, f"{step.describe()} is not a legal move from {state}"
            op, a, _, _, _, state, nbytes, rounds, copied = found[0]
            assert step.bytes == nbytes, f"{step.describe()}: {step.bytes} bytes, the table gives {nbytes}"
            total += self.price(op, a, nbytes, rounds, copied)
        assert state == _state(plan.dst), f"the plan ends in {state}, not at {plan.dst}"
        return total, len(plan.steps)


def _state(layout: Layout) -> State:
    return layout.dims, tuple(sorted(layout.partial))


def _put(dims: tuple[tuple[int, ...], ...], d: int, axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    return (*dims[:d], axes, *dims[d + 1 :])


def calibrated_model(naxes: int) -> planner.CostModel:
    """docs/examples/hints_2x2.json's measured figures, axis ``a`` (outermost first) ``1.5**(naxes-1-a)``
    times slower, with the choice margin of the stored calibration run on [2, 2] and an all_reduce
    regime for messages of 1 MiB and more at twice the bandwidth."""
    measured = {
        "all_gather": (2.39e-3, 0.342e9),
        "reduce_scatter": (1.93e-3, 0.296e9),
        "all_reduce": (1.43e-3, 0.411e9),
        "all_to_all": (2.15e-3, 0.267e9),
    }
    slower = [1.5 ** (naxes - 1 - a) for a in range(naxes)]

    def figures(alpha: float, bandwidth: float) -> dict[str, tuple[float, ...]]:
        return {
            "alpha": tuple(float(f"{alpha * s:.3g}") for s in slower),
            "bandwidth": tuple(float(f"{bandwidth / s:.3g}") for s in slower),
        }

    ops: dict[str, dict] = {kind: figures(*f) for kind, f in measured.items()}
    alpha, bandwidth = measured["all_reduce"]
    ops["all_reduce"]["large"] = {"from_bytes": 2**20, **figures(alpha, 2 * bandwidth)}
    return planner.CostModel(
        alpha=2.39e-3, bandwidth=0.342e9, ops=ops, overhead=170e-6, copy_bandwidth=3.55e9, margin=0.366e-3
    )


def random_layout(
    rng: random.Random,
    mesh: Mesh,
    ndim: int,
    partial: float,
    split: tuple[float, float],
    ops: Sequence[str] = OPS,
) -> Layout:
    """A random layout of an ``ndim``-d tensor over ``mesh``, its axes in any nesting order:
    each axis draws one uniform ``r``, and is partial (an op of ``ops``) where ``r < partial``,
    else split over a random dim where ``split[0] <= r < split[1]``, else replicated. (Also
    bench_planner_speed.py's pairs.)"""
    dims: list[list[int]] = [[] for _ in range(ndim)]
    pending = []
    axes = list(range(mesh.ndim))
    rng.shuffle(axes)  # any nesting order
    for axis in axes:
        r = rng.random()
        if r < partial:
            pending.append((axis, rng.choice(ops)))
        elif split[0] <= r < split[1]:
            dims[rng.randrange(ndim)].append(axis)
    return Layout(dims=dims, mesh=mesh, partial=pending)


def random_pairs(rng: random.Random, mesh: Mesh, count: int) -> list[tuple[Layout, Layout, tuple[int, ...], str]]:
    """Partial-heavy sources (module docstring), mostly split targets, distinct pairs."""
    pairs = []
    while len(pairs) < count:
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice(LENGTHS) for _ in range(ndim))
        src = random_layout(rng, mesh, ndim, partial=0.6, split=(0.6, 0.85))
        dst_partial = 0.1 if rng.random() < 0.3 else 0.0
        dst = random_layout(rng, mesh, ndim, partial=dst_partial, split=(dst_partial, dst_partial + 0.6))
        if src != dst:
            pairs.append((src, dst, shape, rng.choice(tuple(ITEMSIZE))))
    return pairs


def cold() -> None:
    """Forget every search planned before: the plan memo, and the memos that searches share
    (``planner.space``'s moves, the bytes bounds that ``planner.bound`` keeps with the tables),
    which a repeat of the same pair would otherwise find warm. The tables stay."""
    search._plan_cached.cache_clear()
    space._SHARED.clear()
    space._MOVES.clear()
    space._PLACED.clear()
    for tables in search._TABLES.values():
        tables.rates._bytes_bounds.clear()


def check_pair(naive: Naive, src: Layout, dst: Layout, shape: tuple[int, ...], dtype: str, cost: planner.CostModel):
    """The planner's plan and the naive optimum: (planner plan, states the planner generated,
    naive (units, steps, states)); an AssertionError naming the pair when they differ."""
    request = search.checked(src, dst, shape, dtype, cost, None)
    found, states = search.collective_outcome(request)
    assert isinstance(found, planner.Plan), f"{src} -> {dst} {shape}: {found}"
    units, steps, generated = naive.solve(src, dst, shape, ITEMSIZE[dtype])
    got = naive.replay(found, ITEMSIZE[dtype])
    assert got == (units, steps), f"{src} -> {dst} {shape} {dtype}: planner (units, steps) {got}, naive {units, steps}"
    return found, states, generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=80, help="pairs per mesh")
    parser.add_argument("--repeat", type=int, default=5, help="runs per pair and search (the best counts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--meshes", default=";".join(",".join(map(str, m)) for m in MESHES), help="';'-separated")
    bench_results.add_json_option(parser)
    args = parser.parse_args()
    meshes = [tuple(int(n) for n in text.split(",")) for text in args.meshes.split(";")]
    rows, raw = [], {}
    print(f"{args.pairs} partial-heavy pairs per mesh, seed {args.seed}, best of {args.repeat} runs per pair")
    for mesh_shape in meshes:
        mesh, cost = Mesh(mesh_shape), calibrated_model(len(mesh_shape))
        naive = Naive(mesh_shape, cost)
        pairs = random_pairs(random.Random(f"{args.seed}-{mesh_shape}"), mesh, args.pairs)
        ours_t, naive_t, ours_states, naive_states = [], [], [], []
        for src, dst, shape, dtype in pairs:
            _, states, generated = check_pair(naive, src, dst, shape, dtype, cost)
            ours_states.append(states)
            naive_states.append(generated)
            mine, theirs = [], []
            for _ in range(args.repeat):
                cold()
                begin = time.process_time()
                planner.plan(src, dst, shape, dtype, cost)
                mine.append(time.process_time() - begin)
                begin = time.process_time()
                naive.solve(src, dst, shape, ITEMSIZE[dtype])
                theirs.append(time.process_time() - begin)
            ours_t.append(min(mine))
            naive_t.append(min(theirs))
        ratios = [o / n for o, n in zip(ours_t, naive_t, strict=True)]
        row = [
            f"{list(mesh_shape)}",
            len(pairs),
            f"{statistics.median(ours_t) * 1e3:.3f}",
            f"{statistics.median(naive_t) * 1e3:.3f}",
            f"{statistics.median(ratios):.3f}",
            f"{sum(ours_t) / sum(naive_t):.3f}",
            f"{statistics.median(ours_states):.0f}",
            f"{statistics.median(naive_states):.0f}",
        ]
        rows.append(row)
        raw[str(list(mesh_shape))] = {"ours_s": ours_t, "naive_s": naive_t, "ours_states": ours_states,
                                      "naive_states": naive_states}  # fmt: skip
        print(f"mesh{list(mesh_shape)}: ours {row[2]} ms, naive {row[3]} ms, median ours/naive {row[4]}, "
              f"total {row[5]}, states {row[6]} / {row[7]}")  # fmt: skip
    columns = [
        "mesh",
        "pairs",
        "ours median CPU ms",
        "naive median CPU ms",
        "median ours / naive",
        "total ours / naive",
        "ours median states",
        "naive median states",
    ]
    note = (
        f"Partial-heavy random pairs (seed {args.seed}) under bench_search_speed.calibrated_model; CPU time of "
        f"this process, best of {args.repeat} runs per pair and search; every plan's exact (time, steps) equal to "
        "the naive uniform-cost search's. "
        "Goal: median ours / naive <= 0.3 on [4, 4, 4]."
    )
    tables = [bench_results.table("Search speed against a naive exact search", columns, rows, note)]
    bench_results.write(args.json, "Search speed", tables, data=raw)


if __name__ == "__main__":
    main()
