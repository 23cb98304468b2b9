"""The distributed executor: run a plan on the calling rank with torch.distributed.

Every rank of the layout's mesh calls :func:`reshard` with its own piece; each step runs on
the process group of its mesh axis (``runtime.comm.groups``), through the collective layer
(``runtime.comm.collectives``). The plan is compiled for the rank as a step program of one leg,
a bucket per communicating step (``runtime.execution.reshard_program``), and run by the bucket
runner that runs an optimizer step's buckets (``runtime.execution.buckets.StageRun``: the
padding, packing and trimming; docs/design.md, "One executor"); this module only checks the
call and gives the runner its names, DeviceMesh and buffers, as the simulator gives it an
emulation. Plans and programs are cached per (src, dst, shape, dtype, rank, and whether
point-to-point plans are allowed), so a training loop plans and compiles once. Every wait is
bounded by the timeout on its own.

A point-to-point step (``runtime.comm.exchange``) sends boxes between global ranks of the default
group in one ``batch_isend_irecv``; a rank's own boxes are copied, never sent. Across meshes
(source and target meshes of other shapes or ranks, overlapping or not) every rank of either
mesh calls: ranks only in the source mesh run the source-mesh steps, send, and get ``None``;
ranks only in the target mesh pass ``local=None``, receive, and run the target-mesh steps.
Ranks in neither mesh do not call.

Memory: a collective step allocates its result plus at most one padded buffer per side of
the collective; no step holds the global tensor unless the state it produces is replicated.
Each step sends as its move does (``CollectiveMove.send``, the runner's ``direct``): from the
piece itself where its blocks are runs of its memory (a leading-dimension gather copies
nothing before its collective), else packed into a send buffer; the copies are those the
planner's copy table prices (``planner/copies.py``). On the CPU the send buffer and the blocks
gloo's reduce_scatter receives before summing them are kept between calls (per thread, one of
each per dtype, up to :data:`KEPT_BYTES` each; larger ones are allocated per call): allocated
anew, such a buffer's pages fault on first touch every call, which costs as much as the copy
into it (``runtime.memory.buffers``). Each step's result is allocated per call, and the
previous one goes once the next step has read it. On a GPU the caching allocator already
reuses memory, and buffers are allocated per call. A
point-to-point step allocates its output, plus one buffer per peer whose message is not a
single contiguous box (a message that is one is sent from the piece, or received into the
output, in place).
The caller's tensor is never written: an all_reduce copies it first, later steps reduce
their own buffers in place.
The result is contiguous and shares no memory with ``local`` (unless the plan is empty, when
``local`` itself is returned).

Agreement: before a plan's first use on a group (the ranks of its mesh, or of both meshes,
and the DeviceMesh if one is given), every rank exchanges the plan's fingerprint
(``runtime.execution.agreement``), which
covers layouts, shape, dtype and steps; ranks that disagree (a layout with the same byte
count, another dtype) all raise :class:`PlanMismatchError` before any step runs. The
agreement is remembered per (plan, DeviceMesh), so later calls pay one set lookup;
``verify=True`` exchanges the fingerprint on every call.
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import planner
from planner.legs import BEFORE
from planner.plans import Plan
from runtime.comm.collectives import default_device, timeout_of
from runtime.comm.groups import axis_group, ranks_group
from runtime.errors import DistributedError, PlanMismatchError, ReshardError
from runtime.execution.agreement import digests
from runtime.execution.buckets import StageRun
from runtime.execution.names import ReshardNames
from runtime.execution.reshard_program import compile_reshard
from runtime.memory.buffers import Scratch
from runtime.memory.dtypes import dtype_name, torch_dtype
from shardlang.errors import ShardlangError
from shardlang.interop import is_dtensor
from shardlang.layout import Layout


def reshard(
    local: torch.Tensor | None,
    src: Layout,
    dst: Layout,
    *,
    global_shape: Sequence[int],
    mesh: DeviceMesh | None = None,
    plan: Plan | None = None,
    timeout: float | datetime.timedelta | None = None,
    verify: bool = False,
    name: str | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    point_to_point: bool = False,
) -> torch.Tensor | None:
    """This rank's piece in ``dst`` of the tensor whose piece in ``src`` is ``local``.

    ``global_shape`` is the full tensor's shape. ``mesh`` is an optional DeviceMesh whose
    groups to use (it must be the layouts' grid of ranks; same-mesh plans only). ``plan``
    overrides the planner's choice (it must be a plan from ``src`` to ``dst`` for this shape
    and dtype). Every wait is bounded by ``timeout`` (seconds or a timedelta; default 5
    minutes). ``verify`` first checks that every rank of the mesh (of both meshes) runs the
    same plan. ``name`` labels errors and communication records. ``point_to_point`` lets the
    planner choose point-to-point and mixed plans on one mesh too (across meshes it always may).

    Across meshes every rank of either mesh calls: ``local`` is ``None`` on a rank outside
    the source mesh (give it ``dtype``, unless ``plan`` is given, and optionally ``device``,
    else the backend's default), and the result is ``None`` on a rank outside the target mesh.
    """
    label = f"tensor '{name}'" if name is not None else "the tensor"
    _check_arguments(local, src, dst, label)
    if not dist.is_initialized():
        raise DistributedError(f"{label}: torch.distributed is not initialized (call init_process_group first)")
    rank = dist.get_rank()
    shape = _shape(global_shape, label)
    same_mesh = src.mesh.same_geometry(dst.mesh)
    _check_membership(local, src, dst, rank, same_mesh, label)
    if mesh is not None and not same_mesh:
        raise ReshardError(
            f"{label}: a DeviceMesh describes one mesh, but {src.mesh.describe()} -> {dst.mesh.describe()} spans two; "
            "pass no mesh to use shardlang's groups"
        )
    program = _program(src, dst, shape, _dtype(local, dtype, plan, rank, label), plan, point_to_point, rank, label)
    if local is not None and tuple(local.shape) != program.source_shape:
        raise ReshardError(
            f"{label}: rank {rank} holds a piece of shape {list(local.shape)}, but '{src}' gives it "
            f"{list(program.source_shape)} of {list(shape)}"
        )
    wait = timeout_of(timeout, lambda message: ReshardError(f"{label}: {message}"))
    where = local.device if local is not None else _device(device, label)
    with torch.no_grad():  # collectives are not differentiable; nothing here records a graph
        agreement = (program.plan, mesh)
        if verify or agreement not in _AGREED:
            _verify(program.plan, where, mesh, wait, label)
            _AGREED.add(agreement)
        return _execute(program, local, where, mesh, wait, label, name)


# The (plan, DeviceMesh or None) pairs whose ranks have agreed on the plan (module docstring).
# Every rank adds the same pairs in the same order, so every rank skips the same exchanges.
_AGREED: set[tuple[Plan, DeviceMesh | None]] = set()


def _execute(
    program: _Program,
    local: torch.Tensor | None,
    device: torch.device,
    device_mesh: DeviceMesh | None,
    wait: datetime.timedelta,
    label: str,
    name: str | None,
) -> torch.Tensor | None:
    """Run this rank's program of the plan (``runtime.execution.reshard_program``: one leg, a
    bucket per communicating step) with the bucket runner, each collective on torch.distributed,
    and copy its result out of the runner's buffers."""
    plan = program.plan
    if not plan.steps:
        return local
    scratch = _kept_buffers() if device.type == "cpu" else None
    names = ReshardNames(plan, label, name, device_mesh)
    run = StageRun(
        program.steps,
        BEFORE,
        device_meshes={},
        timeout=wait,
        buffers=scratch,
        device=device,
        names=names,
        each_within=True,
        direct=True,
    )
    try:
        x = run.run_one(local)
    except (DistributedError, ReshardError):
        run.drain()
        _THREAD.scratch = None  # a collective that failed may still use them: new ones next time
        raise
    if x is None:
        return None  # a rank outside the target mesh
    # Steps that never communicated return views of ``local``: copy them out. Otherwise the
    # result is a view of the last bucket's, allocated for this call (``direct``).
    if not program.steps.buckets:
        return x.clone(memory_format=torch.contiguous_format)
    return x.contiguous()


# Up to this many bytes, the runner's send buffer and gloo's reduce_scatter workspace are kept
# between calls on the CPU (module docstring).
KEPT_BYTES = 64 * 2**20
_THREAD = threading.local()  # its ``scratch``: this thread's kept buffers (a Scratch, or None)


def _kept_buffers() -> Scratch:
    """This thread's buffers kept between calls (module docstring): one per thread, since two
    threads resharding at once must not pack into the same memory."""
    scratch = getattr(_THREAD, "scratch", None)
    if scratch is None:
        scratch = _THREAD.scratch = Scratch(keep_at_most=KEPT_BYTES)
    return scratch


def _check_arguments(local: object, src: object, dst: object, label: str) -> None:
    if local is not None and (not isinstance(local, torch.Tensor) or is_dtensor(local)):
        what = "a DTensor (pass its to_local())" if is_dtensor(local) else type(local).__name__
        raise ReshardError(f"{label}: reshard takes this rank's piece as a plain torch.Tensor, not {what}")
    for role, layout in (("src", src), ("dst", dst)):
        if not isinstance(layout, Layout):
            raise ReshardError(
                f"{label}: {role} must be a shardlang Layout (see shardlang.parse_layout), not {type(layout).__name__}"
            )


def _check_membership(
    local: torch.Tensor | None, src: Layout, dst: Layout, rank: int, same_mesh: bool, label: str
) -> None:
    """Ranks of the source mesh pass their piece, ranks only in the target mesh pass None."""
    in_source = rank in src.mesh.ranks
    if not in_source and rank not in dst.mesh.ranks:
        meshes = src.mesh.describe(), dst.mesh.describe()
        where = f"not in {meshes[0]}" if same_mesh else f"in neither {meshes[0]} nor {meshes[1]}"
        raise ReshardError(f"{label}: rank {rank} is {where}; only the ranks of the layouts' meshes call reshard")
    if in_source and local is None:
        raise ReshardError(f"{label}: rank {rank} is in the source mesh {src.mesh.describe()}; pass its piece as local")
    if not in_source and local is not None:
        raise ReshardError(
            f"{label}: rank {rank} is not in the source mesh {src.mesh.describe()} and holds no piece; pass local=None"
        )


def _dtype(
    local: torch.Tensor | None, dtype: torch.dtype | str | None, plan: Plan | None, rank: int, label: str
) -> str:
    """The language's name of the tensor's dtype: from the piece, else ``dtype``, else the plan."""
    try:
        given = dtype if dtype is None or isinstance(dtype, str) else dtype_name(dtype)
        if given is not None:
            torch_dtype(given)  # an unknown name is an error here, not later
        if local is not None:
            held = dtype_name(local.dtype)
            if given is not None and given != held:
                raise ReshardError(f"rank {rank} holds a piece of {held} but dtype={given} is given")
            return held
    except ShardlangError as e:
        raise type(e)(f"{label}: {e.message}", e.position) from None
    if given is not None:
        return given
    if plan is not None:
        return plan.dtype
    raise ReshardError(f"{label}: rank {rank} holds no piece (it is not in the source mesh); pass dtype=")


def _device(device: torch.device | str | None, label: str) -> torch.device:
    try:
        return default_device() if device is None else torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ReshardError(f"{label}: not a device: {device!r} ({e})") from None


class _Program:
    """A plan, its program for one rank (``runtime.execution.reshard_program``), and that
    rank's source piece shape (``None`` outside the source mesh)."""

    __slots__ = ("plan", "source_shape", "steps")

    def __init__(self, plan: Plan, rank: int) -> None:
        self.plan = plan
        self.steps = compile_reshard(plan, rank)
        in_source = rank in plan.src.mesh.ranks
        self.source_shape = plan.src.rank_piece(plan.shape, rank).shape if in_source else None


def _program(
    src: Layout,
    dst: Layout,
    shape: tuple[int, ...],
    dtype: str,
    plan: Plan | None,
    point_to_point: bool,
    rank: int,
    label: str,
) -> _Program:
    try:
        if plan is None:
            return _planned_program(src, dst, shape, dtype, point_to_point, rank)
        if (plan.src, plan.dst, plan.shape, plan.dtype) != (src, dst, shape, dtype):
            raise ReshardError(
                f"the plan given is for {plan.src} -> {plan.dst}, shape {list(plan.shape)}, {plan.dtype}; "
                f"this call is {src} -> {dst}, shape {list(shape)}, {dtype}"
            )
        return _given_program(plan, rank)
    except ShardlangError as e:
        raise type(e)(f"{label}: {e.message}", e.position) from None


@functools.lru_cache(maxsize=4096)
def _planned_program(
    src: Layout, dst: Layout, shape: tuple[int, ...], dtype: str, point_to_point: bool, rank: int
) -> _Program:
    return _Program(planner.plan(src, dst, shape, dtype, point_to_point=point_to_point), rank)


@functools.lru_cache(maxsize=1024)
def _given_program(plan: Plan, rank: int) -> _Program:
    return _Program(plan, rank)


def _shape(global_shape: Sequence[int], label: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in global_shape)
    except (TypeError, ValueError):
        raise ReshardError(f"{label}: global_shape must be a sequence of ints, not {global_shape!r}") from None


def _verify(
    plan: Plan, device: torch.device, device_mesh: DeviceMesh | None, wait: datetime.timedelta, label: str
) -> None:
    src, dst = plan.src.mesh, plan.dst.mesh
    # Every rank that calls: the source mesh's ranks in mesh order, then the target mesh's others.
    members = (*src.ranks, *(r for r in dst.ranks if r not in src.ranks))
    where = src.describe() if src.same_geometry(dst) else f"{src.describe()} and {dst.describe()}"
    try:
        if src.same_geometry(dst):
            group = axis_group(src, tuple(range(src.ndim)), device_mesh, timeout=wait)
        else:
            group = ranks_group(members, timeout=wait)
        mine, prints = digests(plan.to_json(), members, group, device, wait)
    except DistributedError as e:
        raise DistributedError(
            f"{label}: verifying the plan {plan.src} -> {plan.dst} on ranks {list(members)} failed: {e.message}"
        ) from e
    if any(p != mine for p in prints):
        by_print: dict[int, list[int]] = {}
        for r, p in zip(members, prints, strict=True):
            by_print.setdefault(p, []).append(r)
        groups = "; ".join(f"ranks {ranks} hold plan {p:016x}" for p, ranks in by_print.items())
        raise PlanMismatchError(
            f"{label}: the ranks of {where} disagree on the plan (this rank {dist.get_rank()} runs "
            f"{plan.src} -> {plan.dst}, shape {list(plan.shape)}, {plan.dtype}, plan {mine:016x}): {groups}"
        )
