"""Layouts chosen under a per-rank memory budget: a multiple-choice knapsack, solved exactly.

For every tensor of a spec, the *candidates* are (param, grad, state) layout triples built from
its data-parallel axes ``D`` (the axes its gradient arrives pending a reduction over) and its
compute layout ``C`` (its param layout without ``D``; ``G0`` is its grad as the spec gives it):

- states: ``C`` with each axis of ``D`` splitting no dim or any one dim again (innermost,
  ascending): replicated, one dim over one or several axes, several dims;
- ``(C, G0, s)`` for every state layout ``s`` (DDP, ZeRO-2: the step reduces the gradient);
- ``(C, C, s)`` (ZeRO-1: backward all-reduces the gradient, as DDP's hooks do);
- ``(X, X, X)`` for every split ``X`` (ZeRO-3: parameter and gradient are the rank's shard).

The data-parallel axes ``D`` of a mesh (:func:`infer_data_parallel`): those some tensor's
gradient is pending a mean over, or some state splits beyond its parameter (ZeRO-1, whose
gradient the loop already reduced). A mesh with neither is read as FSDP (``init --strategy
zero3``): its axes that split every tensor's parameter, gradient and state alike, which tensor
parallelism does not do to a tensor that also has replicated parts (its norms). Where ``D`` is
more than the gradient's pending axes, ``G0`` is ``C`` pending a mean over ``D``: a sharded
parameter is gathered for forward and backward, its gradient reduce-scattered in backward (the
gathered parameter is the training loop's, not counted in the memory held). HSDP (a mean
pending over the replicate axis, every tensor split over the shard axis alike) reads both as
data parallel where its tensors include a 1-d one (a norm): without one, sharding every
declared tensor alike is what tensor parallelism of the weights looks like too, and the shard
axis is read as part of ``C``.

Flat sharding over a mesh axis ``a`` (the optimizers' ``flat_axis``, DeepSpeed's flat ZeRO)
is an option of the whole optimizer, not of a tensor: every tensor's state is then the rank's
equal chunk over ``a`` of its state layout without ``a`` (its *base*). So it is a problem of
its own (``build_problem(..., flat_axis=a)``), whose candidates are the ZeRO-1/2 forms above
with states of distinct bases (one that splits over ``a`` stands for each, so the file reads as
ZeRO without flat too), priced with the flat step plan; :func:`planner.knapsack.suggest_best`
solves it beside the plain one and keeps the faster. Its fixed strategies are ``zero1 flat``
and ``zero2 flat``.

Modeled time of a choice (README, "Choosing layouts"): the optimizer step's collectives as the
step plan runs them (``planner.step``: its buckets, capped at ``bucket_bytes`` as ``shardlang plan``
caps them, :data:`planner.legs.DEFAULT_BUCKET_BYTES` by default; with ``bucket_bytes=AUTO``
each choice under the cost model's cap for its step and loop, ``planner.bucket_cap``, the
integer program counting buckets of any size, which that cap keeps within 5%), plus the training loop's
collectives a choice implies, bucketed by the same rule: a parameter not in ``C`` is gathered
into ``C`` twice (forward and backward), a gradient not in ``G0`` is reduced from ``G0`` in
backward. A choice's time (:meth:`Problem.evaluate`) is that schedule's, exactly; the integer
program (``planner.knapsack``) sees it as sums over tensors (every step's bandwidth term) plus
per collective kind its latency times the number of its buckets, an integer at least the
kind's buffer over the cap (each step filling at most one bucket) and at least one when the
kind is used. Where no kind's buffers exceed the cap that is exact; where they do, the
bucket count is a lower bound of the step plan's in-order cutting, and the solution is
compared, exactly, with the spec's own layouts and the fixed strategies.

Memory per rank: what the rank holds as the runtime counts it (``planner.memory``'s
:func:`~planner.memory.predict_memory`, the kinds of ``memory_report()``: parameter pieces,
states and masters, spare states, bucket buffers, scratch, and the optimizer's Python objects,
a constant per tensor), on the first rank of the first tensor's state mesh, which holds the
largest pieces; gradients are freed by the step, as the optimizers free them by default. The
budget bounds that count, the one ``shardlang suggest`` prints: the integer program sees it as
sums over tensors plus a few largest buffers (``planner.held``), and every answer is checked
against the prediction itself (``planner.knapsack``).

Tensors of equal shape, dtype and layouts form a group with one integer count per candidate,
so a model of 226 tensors in 8 groups is a program of a few dozen variables.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence

import attrs

from planner.bucket_cap import AUTO, UNCAPPED, BucketCap, Priced, choose_cap
from planner.cheapest import plan as plan_pair
from planner.cost import CostModel, collective_rounds
from planner.errors import PlanError
from planner.held import Copies, HeldTerms, held_terms
from planner.legs import (
    AFTER,
    BEFORE,
    DEFAULT_BUCKET_BYTES,
    STAGES,
    Hop,
    Leg,
    Merged,
    bucket_stage,
    rounds_price,
    stage_rounds,
    without_axis,
)
from planner.loops import AUTO as AUTO_LOOP
from planner.loops import LOOPS, infer_loop, runs_in
from planner.memory import ChoiceMemory, MemoryPrediction, RankTensor, rank_tensor
from planner.spec_plan import cost_for, step_tensor
from planner.step import step_legs
from shardlang.errors import ShardlangError
from shardlang.generate import split_dim
from shardlang.layout import Layout
from shardlang.mesh import Mesh
from shardlang.spec import STATE_DEFAULT, Layouts, Spec, TensorSpec

OPTIMIZERS = ("adamw", "came")
STRATEGY_NAMES = ("ddp", "zero1", "zero2", "zero3")
FLAT_STRATEGY_NAMES = ("zero1 flat", "zero2 flat")  # of a problem with a flat axis
# The training loop's stages (module doc): parameters gathered (twice: forward and backward),
# gradients reduced in backward.
FORWARD, BACKWARD = "forward", "backward"


class SuggestError(ShardlangError):
    """No choice fits the budget (names the smallest budget that does), or bad options."""


@attrs.frozen
class Candidate:
    """One (param, grad, state) triple of a group, priced: ``held``, its terms of the memory
    per rank (``planner.held``), ``seconds`` its additive time (bandwidth terms of its step
    collectives and the whole time of its training-loop collectives), and ``kinds`` the
    collectives it takes part in (the step's and the loop's), each with its latency and the
    bucket buffer it fills."""

    layouts: Layouts
    held: HeldTerms
    seconds: float
    loop_seconds: float
    # (kind, latency, bytes of the kind's bucket buffers it fills): kinds are numbered per problem
    kinds: tuple[tuple[int, float, int], ...]
    # The optimizer step's legs and the training loop's (stages FORWARD, run twice, and
    # BACKWARD), named after the group's first tensor: what the exact time is bucketed from.
    legs: tuple[Leg, ...] = ()
    loop: tuple[Leg, ...] = ()
    strategies: tuple[str, ...] = ()  # the fixed strategies it is


@attrs.frozen
class Group:
    tensors: tuple[TensorSpec, ...]
    candidates: tuple[Candidate, ...]
    original: int  # index of the spec's own triple
    cost: CostModel = attrs.field(factory=CostModel)

    @property
    def first(self) -> TensorSpec:
        return self.tensors[0]


@attrs.frozen
class Choice:
    """A choice of candidate per tensor (``picks[g]``: per tensor of group ``g``, in order), the
    memory its rank holds (``planner.memory``: what ``shardlang suggest`` prints and the budget
    bounds) and its modeled time."""

    picks: tuple[tuple[int, ...], ...]
    memory: int
    seconds: float


@attrs.frozen
class Suggestion:
    problem: Problem
    budget: int
    best: Choice
    optimal: bool
    gap: float  # relative optimality gap when a time limit stopped the solver, else 0
    solve_seconds: float
    # Per problem looked at, its fixed choices (``planner.knapsack.fixed_choices``), so that a
    # report need not price them again.
    fixed: tuple[tuple[Problem, tuple[tuple[str | None, Choice | None], ...]], ...] = ()
    # Where a solve's answer was not taken (planner.knapsack.suggest; docs/reference/suggest.md):
    # whether ``best`` is the solver's, and why not, or why a tie-break stopped, said in output.
    solved: bool = True
    fallback: tuple[str, ...] = ()

    def spec(self) -> Spec:
        return self.problem.spec_of(self.best)


@attrs.frozen(eq=False)  # one problem is one value: hashed by identity (its integer program is cached by it)
class Problem:
    """``tensors`` are those chosen for (the spec's declared ones, then any that its rules
    give layouts), in order; ``flat_axis`` the optimizers' flat axis (a mesh axis name or
    number) every candidate is priced with, or ``None``."""

    spec: Spec
    optimizer: str
    tensors: tuple[TensorSpec, ...]
    groups: tuple[Group, ...]
    price_seconds: float
    flat_axis: str | int | None = None
    # A cap in bytes, or AUTO: each choice under the cost model's cap for it (module doc).
    bucket_bytes: int | str = DEFAULT_BUCKET_BYTES
    # The training loop the candidates run in (planner.loops), and why (inferred or given).
    loop: str = "any"
    loop_reason: str = ""
    # What predicting a choice's memory derives per tensor, kept over the choices evaluated.
    _memory: ChoiceMemory = attrs.field(init=False, repr=False, default=attrs.Factory(ChoiceMemory, takes_self=True))

    @property
    def solver_cap(self) -> int:
        """The cap the integer program counts buckets under: under AUTO, buckets of any size,
        whose time the model's cap keeps within ``planner.bucket_cap.SLACK``."""
        return solver_cap(self.bucket_bytes)

    # --- evaluating a choice ---------------------------------------------------------------
    def evaluate(self, picks: Sequence[Sequence[int]]) -> Choice:
        """Memory as the runtime holds it (:meth:`prediction`); time as the step plan buckets the
        chosen legs (module doc): what ``shardlang plan`` models for the chosen spec, plus the loop."""
        price, merged = self._priced(picks)
        seconds = self.model_cap(picks).seconds if self.bucket_bytes == AUTO else price(int(self.bucket_bytes))[0]
        memory = self._memory.report(picks, merged).total_bytes  # the prediction, of the merge priced
        return Choice(picks=tuple(tuple(p) for p in picks), memory=memory, seconds=seconds)

    def prediction(self, picks: Sequence[Sequence[int]]) -> MemoryPrediction:
        """What the first rank holds for a choice as the runtime counts it (``planner.memory``:
        the kinds of ``memory_report()``, bucket buffers included, under the bucket cap the
        optimizers run with): the memory a choice is counted and bounded by, each group's
        candidates derived once (``planner.memory.ChoiceMemory``)."""
        return self._memory.report(picks)

    def model_cap(self, picks: Sequence[Sequence[int]]) -> BucketCap:
        """The cost model's bucket cap for a choice's step and loop (``planner.bucket_cap``)."""
        return choose_cap(self.priced(picks))

    def cap_of(self, picks: Sequence[Sequence[int]]) -> int:
        """The cap a choice runs under: the one given, or under AUTO the model's for it."""
        return self.model_cap(picks).bytes if self.bucket_bytes == AUTO else int(self.bucket_bytes)

    def priced(self, picks: Sequence[Sequence[int]]) -> Priced:
        """A choice's step and loop under a bucket cap: (modeled seconds, largest bucket
        buffer), for ``planner.bucket_cap``'s rule (``_priced``: and the stages it merged)."""
        return self._priced(picks)[0]

    def _priced(self, picks: Sequence[Sequence[int]]) -> tuple[Priced, Merged]:
        chosen: dict[str, Candidate] = {}
        costs: dict[str, CostModel] = {}  # by the name the legs carry: their group's first tensor's
        for group, picked in zip(self.groups, picks, strict=True):
            costs[group.first.name] = group.cost
            for t, c in zip(group.tensors, picked, strict=True):
                chosen[t.name] = group.candidates[c]
        legs: list[Leg] = []
        loop: list[Leg] = []
        for t in self.tensors:  # in the spec's order, as the step plan takes them
            legs += chosen[t.name].legs
            loop += chosen[t.name].loop

        # The merge does not depend on the cap (planner.legs.Round): once per stage.
        stages = [
            (times, stage_legs, stage_rounds(stage_legs, stage, costs, reverse=False))
            for stage, times in ((BEFORE, 1), (AFTER, 1), (FORWARD, 2), (BACKWARD, 1))
            for stage_legs in [legs if stage in STAGES else loop]
        ]

        def price(cap: int) -> tuple[float, int]:
            seconds, buffer = 0.0, 0
            for times, stage_legs, rounds in stages:
                stage_seconds, largest = rounds_price(stage_legs, rounds, costs, cap)
                seconds += times * stage_seconds
                buffer = max(buffer, largest)
            return seconds, buffer

        return price, Merged(legs, costs, {BEFORE: stages[0][2], AFTER: stages[1][2]})

    def uniform(self, pick: Sequence[int]) -> Choice:
        """Every tensor of group ``g`` takes candidate ``pick[g]``."""
        return self.evaluate([(c,) * len(g.tensors) for g, c in zip(self.groups, pick, strict=True)])

    def strategy(self, name: str) -> Choice | None:
        """The fixed strategy ``name`` on every tensor (``None`` where a tensor lacks it)."""
        pick = []
        for g in self.groups:
            found = [i for i, c in enumerate(g.candidates) if name in c.strategies]
            if not found:
                return None
            pick.append(found[0])
        return self.uniform(pick)

    def original(self) -> Choice:
        return self.uniform([g.original for g in self.groups])

    def strategy_names(self) -> tuple[str, ...]:
        return STRATEGY_NAMES if self.flat_axis is None else FLAT_STRATEGY_NAMES

    def spec_of(self, choice: Choice) -> Spec:
        """The spec with every chosen tensor declared in its chosen layouts (a tensor a rule
        matched is declared too: a declaration comes before the rules); the rules stay."""
        chosen = {}
        for group, picks in zip(self.groups, choice.picks, strict=True):
            for t, c in zip(group.tensors, picks, strict=True):
                chosen[t.name] = attrs.evolve(t, layouts=group.candidates[c].layouts)
        return attrs.evolve(self.spec, tensors=tuple(chosen[t.name] for t in self.tensors))

    def changed(self, choice: Choice) -> int:
        """How many tensors ``choice`` gives other layouts than the spec does."""
        return sum(
            sum(group.candidates[c].layouts != group.candidates[group.original].layouts for c in picks)
            for group, picks in zip(self.groups, choice.picks, strict=True)
        )


# --- candidates and their prices ---------------------------------------------------------------
def data_parallel_axes(tensor: TensorSpec, inferred: Sequence[int] = ()) -> tuple[int, ...]:
    """The tensor's data-parallel axes: those its gradient arrives pending a reduction over,
    then those of ``inferred`` (:func:`infer_data_parallel`) it does not."""
    pending = tuple(a for a, _ in tensor.grad.partial)
    return pending + tuple(a for a in inferred if a not in pending)


def infer_data_parallel(tensors: Sequence[TensorSpec]) -> dict[tuple, tuple[int, ...]]:
    """Per mesh (by :attr:`Mesh.geometry`), the axes its tensors are data parallel over:
    those some gradient is pending a mean over, or some state splits that its parameter does
    not (ZeRO-1, whose gradient the loop has reduced). A mesh with neither is read as FSDP:
    its axes that split every tensor's parameter, gradient and state alike (all three the
    same layout, as ``shardlang init --strategy zero3`` writes them). With pending axes, the
    axes that split every tensor's parameter, gradient and state alike are added where the
    tensors include a 1-d one (HSDP: sharded over one axis, a pending mean over another);
    tensor parallelism leaves some tensors replicated (norms), or shows none of 1 dim."""
    by_mesh: dict[tuple, list[TensorSpec]] = {}
    for t in tensors:
        by_mesh.setdefault(t.param.mesh.geometry, []).append(t)
    out = {}
    for geometry, members in by_mesh.items():
        found: list[int] = []
        for t in members:
            split = {a for dim in t.param.dims for a in dim}
            found += [a for a, _ in t.grad.partial]
            found += [a for dim in t.state().dims for a in dim if a not in split]
        if not found and all(t.param == t.grad == t.state() for t in members):
            axes = [{a for dim in t.param.dims for a in dim} for t in members]
            found = sorted(set.intersection(*axes)) if axes else []
        elif any(len(t.shape) == 1 for t in members):  # HSDP: sharded alike beside the pending axes
            alike = [t for t in members if t.grad.dims == t.param.dims == t.state().dims]
            if len(alike) == len(members):
                axes = [{a for dim in t.param.dims for a in dim} for t in members]
                found += sorted(set.intersection(*axes) - set(found))
        out[geometry] = tuple(sorted(set(found)))
    return out


def _roles(tensor: TensorSpec, inferred: Sequence[int]) -> tuple[tuple[int, ...], Layout, Layout]:
    """The tensor's data-parallel axes ``D``, its compute layout ``C`` (its parameter gathered
    over ``D``) and ``G0``, its gradient as backward makes it: the spec's where it is pending
    over every axis of ``D``, else ``C`` pending a mean over ``D`` (the spec's reduce ops kept)."""
    axes = data_parallel_axes(tensor, inferred)
    compute = _without(tensor.param, axes)
    if {a for a, _ in tensor.grad.partial} == set(axes):
        return axes, compute, tensor.grad
    ops = dict(tensor.grad.partial)
    g0 = Layout(dims=compute.dims, mesh=compute.mesh, partial=tuple((a, ops.get(a, "avg")) for a in axes))
    return axes, compute, g0


def _without(layout: Layout, axes: Sequence[int]) -> Layout:
    return Layout(dims=tuple(tuple(a for a in dim if a not in axes) for dim in layout.dims), mesh=layout.mesh)


def state_layouts(compute: Layout, axes: Sequence[int]) -> list[Layout]:
    """``compute`` split again over ``axes``: each axis on no dim or on any one dim (innermost,
    axes of one dim in ascending order), ``compute`` itself first."""
    out = []
    for where in itertools.product(range(-1, compute.ndim), repeat=len(axes)):
        added = [tuple(a for a, d in zip(axes, where, strict=True) if d == i) for i in range(compute.ndim)]
        dims = tuple(dim + extra for dim, extra in zip(compute.dims, added, strict=True))
        out.append(Layout(dims=dims, mesh=compute.mesh))
    return out


def _triples(
    tensor: TensorSpec, states_only: bool, flat: int | None, inferred: Sequence[int] = (), loop: str = "any"
) -> list[tuple[Layouts, tuple[str, ...]]]:
    axes, compute, g0 = _roles(tensor, inferred)
    d = split_dim(tensor.shape, math.prod(compute.mesh.shape[a] for a in axes))
    full = compute
    if axes and d is not None:
        dims = tuple(dim + axes if i == d else dim for i, dim in enumerate(compute.dims))
        full = Layout(dims=dims, mesh=compute.mesh)
    states = state_layouts(compute, axes)
    if flat is None:
        strategies = [
            ((compute, g0, compute), "ddp"),
            ((compute, compute, full), "zero1"),
            ((compute, g0, full), "zero2"),
            ((full, full, full), "zero3"),
        ]
    else:  # one state per base, one splitting over the flat axis where there is one (module doc)
        bases: dict[Layout, Layout] = {}
        for state in sorted([full, *states], key=lambda lay: lay.dim_of_axis(flat) is None):
            bases.setdefault(without_axis(state, flat), state)
        states = list(bases.values())
        own = bases.get(without_axis(compute, flat), compute)
        strategies = [((compute, compute, own), "zero1 flat"), ((compute, g0, own), "zero2 flat")]
    names: dict[tuple[Layout, Layout, Layout], tuple[str, ...]] = {}
    for key, name in strategies:
        names[key] = (*names.get(key, ()), name)
    triples = [(compute, g0, s) for s in states]
    if axes and not states_only:
        triples += [(compute, compute, s) for s in states]
        if flat is None:  # a ZeRO-3 parameter is no flat chunk
            triples += [(x, x, x) for x in states[1:]]
    out = [(Layouts(param=p, grad=g, states=((STATE_DEFAULT, s),)), names.get((p, g, s), ())) for p, g, s in triples]
    out = [(lay, name) for lay, name in out if runs_in(loop, lay, compute, g0, axes)]
    own_index = _find(tensor.layouts, [lay for lay, _ in out], flat)
    if own_index is None:
        out.insert(0, (tensor.layouts, ()))
    else:  # flat: the spec's own state stands for its base (an unchanged tensor keeps its text)
        out[own_index] = (tensor.layouts, out[own_index][1])
    return out


def _find(layouts: Layouts, among: Sequence[Layouts], flat: int | None) -> int | None:
    """The index of the candidate that runs as ``layouts`` do (flat: the same base)."""

    def key(lay: Layouts) -> tuple:
        states = tuple((k, v if flat is None else without_axis(v, flat)) for k, v in lay.states)
        return lay.param, lay.grad, states

    return next((i for i, lay in enumerate(among) if key(lay) == key(layouts)), None)


def _price(
    tensor: TensorSpec,
    layouts: Layouts,
    optimizer: str,
    cost: CostModel,
    flat: int | None,
    kind_ids: dict[tuple, int],
    cap: int,
    held: tuple[RankTensor, Copies],
    inferred: Sequence[int] = (),
) -> Candidate:
    """``held``: the tensor on the program's rank and the CAME copies of the problem (``planner.held``)."""
    for name, _ in layouts.states:
        if name != STATE_DEFAULT:
            raise SuggestError(f"tensor '{tensor.name}': suggest prices one state layout per tensor, not state.{name}")
    entry = attrs.evolve(tensor, layouts=layouts)
    rank = tensor.state().mesh.ranks[0]  # the plan of the mesh's first rank (flat: its block)
    in_step = tuple(step_legs([step_tensor(entry, cost, flat)], rank))
    _, compute, g0 = _roles(tensor, inferred)
    loop_legs = []
    if layouts.param != compute:
        gather = plan_pair(layouts.param, compute, tensor.shape, tensor.dtype, cost)
        loop_legs.append(Leg(tensor.name, "param -> compute", FORWARD, tensor.dtype, (Hop(gather),)))
    if layouts.grad != g0:
        reduce = plan_pair(g0, layouts.grad, tensor.shape, tensor.dtype, cost)
        loop_legs.append(Leg(tensor.name, "grad -> grad", BACKWARD, tensor.dtype, (Hop(reduce),)))
    # Every communicating step as a bucket of its own: its latency goes to its kind (paid per
    # bucket), the rest is the tensor's own.
    costs = {tensor.name: cost}
    seconds, loop_seconds, kinds, steps = 0.0, 0.0, [], []
    for stage, times in ((BEFORE, 1), (AFTER, 1), (FORWARD, 2), (BACKWARD, 1)):
        legs = in_step if stage in STAGES else tuple(loop_legs)
        for b in bucket_stage(legs, stage, costs, 1, reverse=False):
            if stage not in STAGES:
                loop_seconds += times * b.seconds
            if b.axis is None:  # point to point: a collective of its own
                seconds += times * b.seconds
                continue
            alpha, _ = cost.figures_at(b.op, b.mesh, b.axis, b.bytes)
            latency = collective_rounds(b.op, b.mesh.shape[b.axis]) * alpha + cost.overhead
            kind = (stage, b.op, b.mesh.geometry, b.axis, b.reduce_op or "", b.dtype, cost)
            kinds.append((kind_ids.setdefault(kind, len(kind_ids)), times * latency, min(b.buffer_bytes, cap)))
            steps.append((kinds[-1][0], b))
            seconds += times * (b.seconds - latency)
    terms = held_terms(held[0], optimizer, held[1], steps, in_step)
    return Candidate(layouts, terms, seconds, loop_seconds, tuple(kinds), legs=in_step, loop=tuple(loop_legs))


def flat_axes(tensors: Sequence[TensorSpec]) -> tuple[str | int, ...]:
    """The axes a flat problem may use: the data-parallel axes of the tensors (by name, or by
    number on a mesh without names) that every tensor's state mesh has."""
    out: list[str | int] = []
    inferred = infer_data_parallel(tensors)
    for t in tensors:
        mesh = t.state().mesh
        for a in data_parallel_axes(t, inferred[t.param.mesh.geometry]):
            label = a if mesh.axis_names is None else mesh.axis_names[a]
            if label not in out and all(_has_axis(u.state().mesh, label) for u in tensors):
                out.append(label)
    return tuple(out)


def _has_axis(mesh: Mesh, label: str | int) -> bool:
    try:
        mesh.axis_index(label)
    except ShardlangError:
        return False
    return True


def solver_cap(bucket_bytes: int | str) -> int:
    """The cap the integer program counts buckets under (:attr:`Problem.solver_cap`)."""
    return UNCAPPED if bucket_bytes == AUTO else int(bucket_bytes)


def build_problem(
    spec: Spec,
    optimizer: str = "adamw",
    *,
    states_only: bool = False,
    tensors: Sequence[TensorSpec] | None = None,
    flat_axis: str | int | None = None,
    bucket_bytes: int | str | None = None,
    loop: str = "any",
) -> Problem:
    """The candidates of ``tensors`` (default: the declared ones), priced (module doc); with
    ``flat_axis``, as the optimizers run them with flat sharding over that axis; buckets capped
    at ``bucket_bytes`` (default :data:`planner.legs.DEFAULT_BUCKET_BYTES`, as ``plan`` does;
    :data:`planner.bucket_cap.AUTO`: each choice under the cost model's cap for it); only
    the candidates that ``loop`` runs (``planner.loops``; ``"auto"``: inferred from the spec)."""
    if optimizer not in OPTIMIZERS:
        raise SuggestError(f"unknown optimizer '{optimizer}' (expected one of {', '.join(OPTIMIZERS)})")
    chosen = tuple(spec.tensors if tensors is None else tensors)
    if not chosen:
        hint = " (a tensor its rules match needs its shape: --shapes, --model or --tensor)" if spec.rules else ""
        raise SuggestError(f"{spec.filename or 'the spec'} declares no tensors to choose layouts for{hint}")
    started = time.perf_counter()
    grouped: dict[tuple, list[TensorSpec]] = {}
    for t in chosen:
        grouped.setdefault((t.shape, t.dtype, t.layouts), []).append(t)
    cap: int | str = DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    if cap != AUTO and (not isinstance(cap, int) or cap < 1):
        raise SuggestError(f"bucket_bytes must be at least 1 or {AUTO!r}, got {bucket_bytes!r}")
    kind_ids: dict[tuple, int] = {}  # collective kind -> its number, in the order first met
    inferred = infer_data_parallel(chosen)
    loop, reason = _loop(chosen, inferred, loop)
    triples = []
    for members in grouped.values():
        first = members[0]
        try:
            flat = None if flat_axis is None else first.state().mesh.axis_index(flat_axis)
        except ShardlangError as e:
            raise SuggestError(f"tensor '{first.name}': flat axis: {e.message}", first.position) from None
        dp = inferred[first.param.mesh.geometry]
        triples.append((members, flat, dp, _triples(first, states_only, flat, dp, loop)))
    rank = chosen[0].state().mesh.ranks[0]  # predict_memory's: it holds the largest pieces
    pieces = [
        [rank_tensor(attrs.evolve(members[0], layouts=layouts), rank, optimizer, flat) for layouts, _ in found]
        for members, flat, _, found in triples
    ]
    copies = Copies.of([piece for group in pieces for piece in group])
    groups = []
    for (members, flat, dp, found), group_pieces in zip(triples, pieces, strict=True):
        first = members[0]
        cost = cost_for(spec, first)
        candidates = []
        for (layouts, strategies), piece in zip(found, group_pieces, strict=True):
            try:
                priced = _price(first, layouts, optimizer, cost, flat, kind_ids, solver_cap(cap), (piece, copies), dp)
            except PlanError as e:
                raise SuggestError(f"tensor '{first.name}': {e.message}", first.position) from None
            candidates.append(attrs.evolve(priced, strategies=strategies))
        original = _find(first.layouts, [c.layouts for c in candidates], flat)
        assert original is not None  # _triples adds the spec's own layouts where no candidate runs as they do
        groups.append(Group(tensors=tuple(members), candidates=tuple(candidates), original=original, cost=cost))
    return Problem(
        spec=spec,
        optimizer=optimizer,
        tensors=chosen,
        groups=tuple(groups),
        price_seconds=time.perf_counter() - started,
        flat_axis=flat_axis,
        bucket_bytes=cap,
        loop=loop,
        loop_reason=reason,
    )


def _loop(tensors: Sequence[TensorSpec], inferred: dict[tuple, tuple[int, ...]], loop: str) -> tuple[str, str]:
    """The loop to choose for and why: ``loop`` as given, or inferred (``"auto"``)."""
    if loop == AUTO_LOOP:
        roles = [(t, _roles(t, inferred[t.param.mesh.geometry])) for t in tensors]
        return infer_loop([(t.layouts, compute, g0, axes) for t, (axes, compute, g0) in roles])
    if loop not in LOOPS:
        raise SuggestError(f"unknown loop '{loop}' (expected one of {', '.join((*LOOPS, AUTO_LOOP))})")
    return loop, "given"


def build_problems(
    spec: Spec,
    optimizer: str = "adamw",
    *,
    states_only: bool = False,
    tensors: Sequence[TensorSpec] | None = None,
    bucket_bytes: int | str | None = None,
    loop: str = "any",
) -> tuple[Problem, ...]:
    """The plain problem, then one per axis the optimizers' flat sharding may use (none for
    FSDP2: its parameters are no flat chunks)."""
    options = {"states_only": states_only, "tensors": tensors, "bucket_bytes": bucket_bytes, "loop": loop}
    plain = build_problem(spec, optimizer, **options)
    options["loop"] = plain.loop
    axes = () if plain.loop.startswith("fsdp2") else flat_axes(plain.tensors)
    # The flat problems take the plain one's loop, and say why it is that loop as it does.
    flat = [
        attrs.evolve(build_problem(spec, optimizer, flat_axis=axis, **options), loop_reason=plain.loop_reason)
        for axis in axes
    ]
    return (plain, *flat)
