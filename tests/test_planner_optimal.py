"""The planner is optimal: an independent exhaustive search agrees on thousands of random cases.

``Reference`` is written from the cost tables (``planner.cost``'s docstring) alone, shares no code with
``planner/``: its own state form (per mesh axis: replicated, partial with an op, or split on a
dim at a nesting depth), its own move rules (the full baseline move set, no pruning), its own
sizes and costs, and exact times (integers on a common scale of the model's rationals).
``Reference.solve`` enumerates every step sequence up to a length bound, deduplicated by
(length, state), and returns the least (time, steps). With a copy bandwidth it also prices the
bytes each collective copies locally, by its own reading of the copy table (``planner.cost``).
The planner's plan is replayed step by step in the reference (each step must be a legal move
with the bytes the table gives) and its exact time and length must equal the optimum.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

import planner
from planner.bound import LowerBound, kind_rates
from planner.space import Space, roles_of
from planner.units import integer_op_rates
from shardlang import Layout, Mesh

OPS = ("sum", "avg", "max", "min")
# sum and avg are linear and commute with each other; max and min commute only with themselves.
_COMMUTES = {("sum", "avg"), ("avg", "sum")} | {(o, o) for o in OPS}
ITEMSIZE = {"f32": 4, "bf16": 2, "f64": 8, "i8": 1}
ROUNDS_OF = ("all_gather", "all_to_all", "reduce_scatter", "all_reduce")


class Reference:
    """The move graph of one problem: mesh, tensor shape, element size, costs, target."""

    def __init__(self, mesh_shape, shape, itemsize, alpha, bandwidth, target_partial, ops=None, copy_bandwidth=None):
        """``ops``: collective kind -> its own per-axis (alpha, bandwidth); others use ``alpha``,
        ``bandwidth``; ``copy_bandwidth``: bytes/s of local copies (``None``: free)."""
        self.mesh_shape = tuple(mesh_shape)
        self.shape = tuple(shape)
        self.itemsize = itemsize
        self.target_partial = dict(target_partial)
        figures = {op: (alpha, bandwidth) for op in ROUNDS_OF} | dict(ops or {})
        per_round = {op: [Fraction(a) for a in f[0]] for op, f in figures.items()}
        per_byte = {op: [1 / Fraction(b) for b in f[1]] for op, f in figures.items()}
        per_copied = 0 if copy_bandwidth is None else 1 / Fraction(copy_bandwidth)
        scale = Fraction(per_copied).denominator
        for f in [x for v in (*per_round.values(), *per_byte.values()) for x in v]:
            scale = scale * f.denominator // math.gcd(scale, f.denominator)
        self.scale = scale
        self.copy_units = int(per_copied * scale)
        self.op_units = {
            op: ([int(f * scale) for f in per_round[op]], [int(f * scale) for f in per_byte[op]]) for op in figures
        }
        self.round_units, self.byte_units = self.op_units["all_gather"] if ops is None else (None, None)

    # state: tuple over mesh axes of ("R",), ("P", op) or ("S", dim, depth)
    @staticmethod
    def state_of(layout: Layout):
        where = [("R",)] * layout.mesh.ndim
        for d, axes in enumerate(layout.dims):
            for depth, a in enumerate(axes):
                where[a] = ("S", d, depth)
        for a, op in layout.partial:
            where[a] = ("P", op)
        return tuple(where)

    def split_lists(self, state):
        lists = [[] for _ in self.shape]
        for a, w in enumerate(state):
            if w[0] == "S":
                lists[w[1]].append((w[2], a))
        return [[a for _, a in sorted(lst)] for lst in lists]

    def local_length(self, dim, axes):
        length = self.shape[dim]
        for a in axes:
            length = math.ceil(length / self.mesh_shape[a])
        return length

    def local_elements(self, state):
        return math.prod(self.local_shape(state))

    def local_shape(self, state):
        return [self.local_length(d, axes) for d, axes in enumerate(self.split_lists(state))]

    def copied(self, op, a, d, j, state, nxt):
        """Bytes the move copies locally, by the copy table: pack the blocks unless they are
        unpadded runs of the piece's memory, unpack unless the result's blocks are."""
        n = self.mesh_shape[a]
        if n == 1 or op not in ("all_gather", "reduce_scatter", "all_to_all"):
            return 0
        old, new = self.local_shape(state), self.local_shape(nxt)

        def runs(k, shape):  # blocks along k lie in memory one after another
            return all(x == 1 for x in shape[:k])

        if op == "all_gather":
            pack = 0 if new[d] == n * old[d] else math.prod(old)
            unpack = 0 if runs(d, old) else math.prod(new)
        elif op == "reduce_scatter":
            pack = 0 if old[d] == n * new[d] and runs(d, old) else n * math.prod(new)
            unpack = 0
        else:
            block = [new[j] if k == j else x for k, x in enumerate(old)]
            fits = old[j] == n * new[j] and new[d] == n * old[d] and runs(j, old)
            pack = 0 if fits else n * math.prod(block)
            unpack = 0 if runs(d, block) else math.prod(new)
        return (pack + unpack) * self.itemsize

    def moves(self, state):
        """(op, axis, dim, to_dim, reduce_op, next state, bytes, rounds, copied) for every legal move."""
        lists = self.split_lists(state)
        elements = self.local_elements(state)
        out = []
        for a, w in enumerate(state):
            n = self.mesh_shape[a]

            def put(new, state=state, a=a):
                return tuple(new if i == a else x for i, x in enumerate(state))

            if w[0] == "R":
                for d in range(len(self.shape)):
                    out.append(("slice", a, d, None, None, put(("S", d, len(lists[d]))), 0, 0))
                if a in self.target_partial:
                    op = self.target_partial[a]
                    out.append(("partial", a, None, None, op, put(("P", op)), 0, 0))
            elif w[0] == "S":
                d = w[1]
                if lists[d][-1] != a:
                    continue
                out.append(("all_gather", a, d, None, None, put(("R",)), (n - 1) * elements * self.itemsize, n - 1))
                for j in range(len(self.shape)):
                    if j != d:
                        lj = self.local_length(j, lists[j])
                        cut = elements // lj * math.ceil(lj / n) if lj else 0
                        nxt = put(("S", j, len(lists[j])))
                        out.append(("all_to_all", a, d, j, None, nxt, (n - 1) * cut * self.itemsize, n - 1))
            else:
                op = w[1]
                if any(b < a and x[0] == "P" and (x[1], op) not in _COMMUTES for b, x in enumerate(state)):
                    continue
                ar_bytes = 2 * (n - 1) * math.ceil(elements / n) * self.itemsize
                out.append(("all_reduce", a, None, None, op, put(("R",)), ar_bytes, 2 * (n - 1)))
                for d in range(len(self.shape)):
                    nxt = put(("S", d, len(lists[d])))
                    rs_bytes = (n - 1) * self.local_elements(nxt) * self.itemsize
                    out.append(("reduce_scatter", a, d, None, op, nxt, rs_bytes, n - 1))
        if self.copy_units:
            return [(*m, self.copied(m[0], m[1], m[2], m[3], state, m[5])) for m in out]
        return [(*m, 0) for m in out]

    def units(self, axis, nbytes, rounds, op="all_gather", copied=0):
        if op in ("slice", "partial"):
            return 0
        round_units, byte_units = self.op_units[op]
        return rounds * round_units[axis] + nbytes * byte_units[axis] + copied * self.copy_units

    def solve(self, start, goal, max_steps, max_local_bytes=None):
        """(least time units, fewest steps at that time) over all sequences of at most
        ``max_steps`` steps, or ``None`` when none reaches the goal."""

        def fits(state):
            return max_local_bytes is None or self.local_elements(state) * self.itemsize <= max_local_bytes

        if not (fits(start) and fits(goal)):
            return None
        best = (0, 0) if start == goal else None
        layer = {start: 0}
        for k in range(1, max_steps + 1):
            following = {}
            for state, t in layer.items():
                if best is not None and t >= best[0]:
                    continue  # costs are never negative: nothing longer from here can win
                for op, a, _d, _j, _r, nxt, nbytes, rounds, copied in self.moves(state):
                    if not fits(nxt):
                        continue
                    nt = t + self.units(a, nbytes, rounds, op, copied)
                    if nt < following.get(nxt, nt + 1):
                        following[nxt] = nt
            if goal in following and (best is None or following[goal] < best[0]):
                best = (following[goal], k)
            layer = following
            if not layer:
                break
        return best

    def replay(self, plan_, check_seconds=True):
        """Exact time units of ``plan_``, checking every step is a legal move with the right bytes
        (and, with ``check_seconds``, that its seconds are those units)."""
        state = self.state_of(plan_.src)
        total = 0
        for step in plan_.steps:
            matches = [
                m
                for m in self.moves(state)
                if m[:5] == (step.op, step.axis, step.dim, step.to_dim, step.reduce_op)
                and m[5] == self.state_of(step.layout)
            ]
            assert len(matches) == 1, f"step {step.describe()} is not a legal move from {state}"
            op, a, _, _, _, state, nbytes, rounds, copied = matches[0]
            assert step.bytes == nbytes, f"{step.describe()}: {step.bytes} bytes, the table gives {nbytes}"
            units = self.units(a, nbytes, rounds, op, copied)
            if check_seconds:
                assert step.seconds == pytest.approx(float(Fraction(units, self.scale)), rel=1e-12)
            total += units
        assert state == self.state_of(plan_.dst)
        return total


def random_layout(
    rng: random.Random, mesh: Mesh, ndim: int, partial_ops: tuple[str, ...], partial_share: float = 0.3
) -> Layout:
    dims: list[list[int]] = [[] for _ in range(ndim)]
    partial = []
    axes = list(range(mesh.ndim))
    rng.shuffle(axes)
    for a in axes:
        r = rng.random()
        if partial_ops and r < partial_share:
            partial.append((a, rng.choice(partial_ops)))
        elif r < partial_share + 0.25 or ndim == 0:
            continue
        else:
            dims[rng.randrange(ndim)].append(a)
    return Layout(dims=dims, mesh=mesh, partial=partial)


def random_case(rng: random.Random, naxes: int, sizes=(1, 2, 2, 2, 3, 4)):
    mesh = Mesh(tuple(rng.choice(sizes) for _ in range(naxes)))
    ndim = rng.choice((1, 2, 2, 3))
    shape = tuple(rng.choice((0, 1, 2, 3, 5, 7, 8, 12, 37, 64, 1000, 4096)) for _ in range(ndim))
    src = random_layout(rng, mesh, ndim, OPS if rng.random() < 0.7 else ())
    dst = random_layout(rng, mesh, ndim, OPS if rng.random() < 0.3 else ())
    alpha = rng.choice((0.0, 5e-6, 1e-5))
    if rng.random() < 0.5:
        bandwidth = tuple(rng.choice((25e9, 1e11, 3e11)) for _ in range(mesh.ndim))
    else:
        bandwidth = (1e11,) * mesh.ndim
    dtype = rng.choice(tuple(ITEMSIZE))
    return src, dst, shape, dtype, planner.CostModel(alpha=(alpha,) * mesh.ndim, bandwidth=bandwidth)


def per_axis(value, naxes):
    return tuple(value) if isinstance(value, tuple) else (value,) * naxes


def reference_for(src, dst, shape, dtype, cost):
    naxes = src.mesh.ndim
    return Reference(
        src.mesh.shape,
        shape,
        ITEMSIZE[dtype],
        per_axis(cost.alpha, naxes),
        per_axis(cost.bandwidth, naxes),
        dst.partial,
        {c.op: (per_axis(c.alpha, naxes), per_axis(c.bandwidth, naxes)) for c in cost.ops} or None,
        cost.copy_bandwidth,
    )


def check_optimal(src, dst, shape, dtype, cost, max_local_bytes=None, slack=3):
    ref = reference_for(src, dst, shape, dtype, cost)
    start, goal = ref.state_of(src), ref.state_of(dst)
    try:
        got = planner.plan(src, dst, shape, dtype, cost, max_local_bytes=max_local_bytes)
    except planner.PlanError:
        got = None
    bound = 2 * src.mesh.ndim + 2 if got is None else len(got.steps) + slack
    want = ref.solve(start, goal, bound, max_local_bytes)
    case = f"{src} -> {dst}, shape {shape}, {dtype}, {cost}, max_local_bytes={max_local_bytes}"
    if got is None:
        assert want is None, f"{case}: the planner found no plan, the reference found {want}"
        return None
    assert want is not None, f"{case}: the reference finds no plan of at most {bound} steps"
    assert (ref.replay(got), len(got.steps)) == want, f"{case}: planner {got.steps}, reference (units, steps) {want}"
    return got


@pytest.mark.parametrize("seed", range(8))
def test_plans_are_optimal_on_random_small_cases(seed):
    rng = random.Random(seed)
    for _ in range(400):
        check_optimal(*random_case(rng, naxes=rng.choice((1, 2, 2, 3, 3, 3))))


@pytest.mark.parametrize("seed", range(2))
def test_plans_are_optimal_on_four_axis_meshes(seed):
    rng = random.Random(50 + seed)
    for _ in range(100):
        check_optimal(*random_case(rng, naxes=4, sizes=(1, 2, 2, 3)))


@pytest.mark.parametrize("seed", range(2))
def test_plans_are_optimal_under_a_memory_bound(seed):
    rng = random.Random(100 + seed)
    found = refused = 0
    for _ in range(150):
        src, dst, shape, dtype, cost = random_case(rng, naxes=rng.randint(1, 3))
        full = math.prod(shape) * ITEMSIZE[dtype]
        # Bounds between a fully sharded and a replicated tensor: some plans detour, some are refused.
        limit = rng.randint(full // max(1, src.mesh.size), max(1, full))
        if check_optimal(src, dst, shape, dtype, cost, max_local_bytes=limit) is None:
            refused += 1
        else:
            found += 1
    assert found and refused


def test_twin_and_size_one_axes_are_optimal():
    """Pruning rules 2 and 3 (interchangeable idle axes, no-op splits) on meshes full of them:
    repeated axis sizes with equal or different bandwidths, size-1 axes, short dims, and
    mostly replicated targets, where slicing an idle axis first can pay (a fast axis sliced
    before a slow gather or reduction)."""
    rng = random.Random(7)
    for _ in range(400):
        mesh = Mesh(rng.choice(((2, 2, 2), (2, 2, 4), (4, 2, 4), (1, 2, 1), (2, 1, 2), (1, 1, 3), (3, 3, 1))))
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice((0, 1, 2, 6, 9, 40, 4096)) for _ in range(ndim))
        src = random_layout(rng, mesh, ndim, OPS if rng.random() < 0.5 else ())
        dst = random_layout(rng, mesh, ndim, ()) if rng.random() < 0.5 else Layout(((),) * ndim, mesh)
        if rng.random() < 0.7:
            bandwidth = tuple(rng.choice((25e9, 3e11)) for _ in range(mesh.ndim))
        else:
            bandwidth = 1e11
        check_optimal(src, dst, shape, "f32", planner.CostModel(alpha=rng.choice((0.0, 5e-6)), bandwidth=bandwidth))


def test_the_bound_never_overestimates_along_optimal_plans():
    """The A* bound at each state of an optimal plan is at most what that plan still costs
    (sources with several partial axes on axes of different speeds, where the order of the
    reductions matters)."""
    rng = random.Random(11)
    checked = 0
    for _ in range(400):
        mesh = Mesh(tuple(rng.choice((2, 3, 4)) for _ in range(rng.randint(2, 3))))
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice((1, 5, 64, 1000, 4096)) for _ in range(ndim))
        src = random_layout(rng, mesh, ndim, ("sum", "avg"), partial_share=0.7)
        dst = random_layout(rng, mesh, ndim, ())
        dtype = "f32"
        cost = planner.CostModel(alpha=0.0, bandwidth=tuple(rng.choice((25e9, 1e11, 3e11)) for _ in mesh.shape))
        got = planner.plan(src, dst, shape, dtype, cost)
        ref = reference_for(src, dst, shape, dtype, cost)
        remaining = ref.replay(got)
        ((per_round, per_byte),) = integer_op_rates(cost.figures(src.mesh))
        # The planner's units and the reference's differ by a constant factor.
        ratio = Fraction(ref.round_units[0] + ref.byte_units[0], per_round["all_gather"][0] + per_byte["all_gather"][0])
        goal = (dst.dims, dst.partial)
        space = Space(src.mesh.shape, shape, ITEMSIZE[dtype], goal, (0,) * src.mesh.ndim)
        bound = LowerBound(
            ITEMSIZE[dtype],
            ndim,
            kind_rates(src.mesh.shape, per_round, per_byte),
            space.target_roles,
            space.local_elements(dst.dims),
            math.prod(shape),
        )
        for index, (layout, step) in enumerate(zip(got.layouts(), (*got.steps, None), strict=True)):
            roles = roles_of((layout.dims, layout.partial), mesh.ndim, dst.dims)
            rounds, steps, reduce_mask, move_mask = bound.state_terms(roles)
            elements = space.local_elements(layout.dims)
            estimate = rounds + bound.bytes_bound(elements, reduce_mask, move_mask)
            assert estimate * ratio <= remaining, f"bound too high at {layout} on the way {src} -> {dst}"
            assert bound.quick_bytes_bound(elements, reduce_mask) <= bound.bytes_bound(elements, reduce_mask, move_mask)
            assert steps <= len(got.steps) - index
            checked += 1
            if step is not None:
                n = src.mesh.shape[step.axis]
                rounds_of = {
                    "all_gather": n - 1,
                    "all_to_all": n - 1,
                    "reduce_scatter": n - 1,
                    "all_reduce": 2 * (n - 1),
                }
                remaining -= ref.units(step.axis, step.bytes, rounds_of.get(step.op, 0), step.op)
    assert checked > 600


def calibrated_looking(rng: random.Random, naxes: int) -> planner.CostModel:
    """A model as ``shardlang calibrate`` writes: per-collective figures of three significant
    digits, latencies of 10-300 us and bandwidths of 0.1-10 GB/s, a kind often cheaper per byte
    than another that the pruning rules prefer (e.g. all_reduce dearer than reduce_scatter and
    all_gather together)."""

    def figure(low: float, high: float) -> float:
        return float(f"{math.exp(rng.uniform(math.log(low), math.log(high))):.2e}")

    ops = {
        op: {
            "alpha": tuple(figure(1e-5, 3e-4) for _ in range(naxes)),
            "bandwidth": tuple(figure(1e8, 1e10) for _ in range(naxes)),
        }
        for op in planner.PRICED_OPS
        if rng.random() < 0.8
    }
    return planner.CostModel(alpha=figure(1e-5, 3e-4), bandwidth=figure(1e8, 1e10), ops=ops)


@pytest.mark.parametrize("seed", range(3))
def test_plans_are_optimal_under_per_collective_figures(seed):
    """The brute force prices each kind with its own figures; the planner (its bound, its
    pruning rules where the figures allow them) must still find the optimum."""
    rng = random.Random(300 + seed)
    for _ in range(250):
        src, dst, shape, dtype, _ = random_case(rng, naxes=rng.choice((1, 2, 2, 3)))
        check_optimal(src, dst, shape, dtype, calibrated_looking(rng, src.mesh.ndim))


def test_pruning_rules_lapse_where_per_collective_figures_break_them():
    """``R,R | P01 -> R,R`` on [2,2] where gloo's all_reduce is dear: two reduce_scatters
    and two all_gathers (rule 4 off) beat the all_reduces; with a cheap all_to_all, a gather
    then a slice (rule 4's other case) loses to it, and with a dear one, wins."""
    mesh = Mesh((2, 2))
    src, dst = Layout(((), ()), mesh, ((0, "sum"), (1, "sum"))), Layout(((), ()), mesh)
    dear = planner.CostModel(ops={"all_reduce": {"alpha": 1e-4, "bandwidth": 1e9}})
    got = check_optimal(src, dst, (1024, 64), "f32", dear)
    assert "all_reduce" not in [s.op for s in got.steps]
    cheap = planner.CostModel(ops={"all_reduce": {"alpha": 1e-6, "bandwidth": 1e12}})
    assert [s.op for s in check_optimal(src, dst, (1024, 64), "f32", cheap).steps] == ["all_reduce"] * 2
    moved = Layout(((0,), ()), mesh), Layout(((), (0,)), mesh)
    for a2a_bandwidth in (1e9, 1e12):
        cost = planner.CostModel(bandwidth=1e11, ops={"all_to_all": {"alpha": 5e-6, "bandwidth": a2a_bandwidth}})
        ops = [s.op for s in check_optimal(*moved, (1024, 64), "f32", cost).steps]
        assert ops == (["all_gather", "slice"] if a2a_bandwidth < 1e11 else ["all_to_all"])
