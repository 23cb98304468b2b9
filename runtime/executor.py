"""The distributed executor: run a plan on the calling rank with torch.distributed.

Every rank of the layout's mesh calls :func:`reshard` with its own piece; each step runs on
the process group of its mesh axis (``runtime.groups``), through the collective layer
(``runtime.comm``), with the rank's compiled moves (``runtime.program``) doing the padding
and trimming. Plans and compiled moves are cached per (src, dst, shape, dtype, rank), so a
training loop plans once.

Memory: a collective step allocates its result plus at most one padded buffer per side of
the collective (the send buffer is released before the result is assembled); no step holds
the global tensor unless the state it produces is replicated. The caller's tensor is never
written: an all_reduce copies it first, later steps reduce their own buffers in place.
The result is contiguous and shares no memory with ``local`` (unless the plan is empty, when
``local`` itself is returned).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import planner
from planner.plan import Plan
from runtime import stats
from runtime.comm import collective
from runtime.dtypes import dtype_name
from runtime.errors import DistributedError, PlanMismatchError, ReshardError
from runtime.groups import axis_group, group_for
from runtime.program import Move, bytes_sent, compile_plan, piece_shape
from shardlang.dtypes import ITEMSIZE
from shardlang.errors import ShardlangError
from shardlang.layout import Layout
from shardlang.mesh import Mesh

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


def reshard(
    local: torch.Tensor,
    src: Layout,
    dst: Layout,
    *,
    global_shape: Sequence[int],
    mesh: DeviceMesh | None = None,
    plan: Plan | None = None,
    timeout: float | datetime.timedelta | None = None,
    verify: bool = False,
    name: str | None = None,
) -> torch.Tensor:
    """This rank's piece in ``dst`` of the tensor whose piece in ``src`` is ``local``.

    ``global_shape`` is the full tensor's shape. ``mesh`` is an optional DeviceMesh whose
    groups to use (it must be the layouts' grid of ranks). ``plan`` overrides the planner's
    choice (it must be a plan from ``src`` to ``dst`` for this shape and dtype). Every wait
    is bounded by ``timeout`` (seconds or a timedelta; default 5 minutes). ``verify`` first
    checks that every rank of the mesh runs the same plan. ``name`` labels errors and
    communication records.
    """
    label = f"tensor '{name}'" if name is not None else "the tensor"
    _check_arguments(local, src, dst, label)
    if not dist.is_initialized():
        raise DistributedError(f"{label}: torch.distributed is not initialized (call init_process_group first)")
    rank = dist.get_rank()
    shape = _shape(global_shape, label)
    if rank not in src.mesh.ranks:
        raise ReshardError(f"{label}: rank {rank} is not in {src.mesh.describe()}; only the mesh's ranks call reshard")
    program = _program(src, dst, shape, dtype_name(local.dtype), plan, rank, label)
    if tuple(local.shape) != program.source_shape:
        raise ReshardError(
            f"{label}: rank {rank} holds a piece of shape {list(local.shape)}, but '{src}' gives it "
            f"{list(program.source_shape)} of {list(shape)}"
        )
    wait = _timeout(timeout, label)
    with torch.no_grad():  # collectives are not differentiable; nothing here records a graph
        if verify:
            _verify(program.plan, local.device, mesh, wait, label)
        return _execute(program, local, mesh, wait, label, name)


def _execute(
    program: _Program, local: torch.Tensor, device_mesh: DeviceMesh | None, wait: datetime.timedelta, label: str,
    name: str | None,
) -> torch.Tensor:
    if not program.moves:
        return local
    mesh = program.plan.src.mesh
    x, writable = local, False
    for move in program.moves:
        if move.is_local:
            x = move.local(x)
            continue
        send = move.send(x, writable=writable)
        x = None  # let the previous intermediate go before the collective allocates
        started = time.perf_counter()
        try:
            group = group_for(mesh, (move.step.axis,), move.members, device_mesh, timeout=wait)
            received = collective(move.step.op, send, move.n, move.step.reduce_op, group, wait)
        except (DistributedError, ReshardError) as e:
            raise type(e)(f"{label}: {_where(move, program.plan)} failed: {e.message}") from e
        if stats.is_recording():
            stats.record(
                stats.CommRecord(
                    tensor=name,
                    step=move.index,
                    op=move.step.op,
                    axis=move.step.axis,
                    ranks=move.members,
                    bytes_sent=bytes_sent(move, ITEMSIZE[program.plan.dtype]),
                    planned_bytes=move.step.bytes,
                    seconds=time.perf_counter() - started,
                )
            )
        del send
        x, writable = move.finish(received), True
    # Steps that never communicated return views of ``local``: copy them out.
    return x.contiguous() if writable else x.clone(memory_format=torch.contiguous_format)


def _check_arguments(local: object, src: object, dst: object, label: str) -> None:
    if not isinstance(local, torch.Tensor) or isinstance(local, DTensor):
        what = "a DTensor (pass its to_local())" if isinstance(local, DTensor) else type(local).__name__
        raise ReshardError(f"{label}: reshard takes this rank's piece as a plain torch.Tensor, not {what}")
    for role, layout in (("src", src), ("dst", dst)):
        if not isinstance(layout, Layout):
            raise ReshardError(
                f"{label}: {role} must be a shardlang Layout (see shardlang.parse_layout), not {type(layout).__name__}"
            )


class _Program:
    """A plan, its moves for one rank, and that rank's source piece shape."""

    __slots__ = ("moves", "plan", "source_shape")

    def __init__(self, plan: Plan, rank: int) -> None:
        self.plan = plan
        self.moves: tuple[Move, ...] = compile_plan(plan, rank)
        self.source_shape = piece_shape(plan.src.rank_piece(plan.shape, rank))


def _program(
    src: Layout, dst: Layout, shape: tuple[int, ...], dtype: str, plan: Plan | None, rank: int, label: str
) -> _Program:
    try:
        if plan is None:
            return _planned_program(src, dst, shape, dtype, rank)
        if (plan.src, plan.dst, plan.shape, plan.dtype) != (src, dst, shape, dtype):
            raise ReshardError(
                f"the plan given is for {plan.src} -> {plan.dst}, shape {list(plan.shape)}, {plan.dtype}; "
                f"this call is {src} -> {dst}, shape {list(shape)}, {dtype}"
            )
        return _given_program(plan, rank)
    except ShardlangError as e:
        raise type(e)(f"{label}: {e.message}", e.position) from None


@functools.lru_cache(maxsize=4096)
def _planned_program(src: Layout, dst: Layout, shape: tuple[int, ...], dtype: str, rank: int) -> _Program:
    return _Program(planner.plan(src, dst, shape, dtype), rank)


@functools.lru_cache(maxsize=1024)
def _given_program(plan: Plan, rank: int) -> _Program:
    return _Program(plan, rank)


def _shape(global_shape: Sequence[int], label: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in global_shape)
    except (TypeError, ValueError):
        raise ReshardError(f"{label}: global_shape must be a sequence of ints, not {global_shape!r}") from None


def _timeout(timeout: float | datetime.timedelta | None, label: str) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    wait = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=float(timeout))
    if wait.total_seconds() <= 0:
        raise ReshardError(f"{label}: timeout must be positive, got {timeout!r}")
    return wait


def _where(move: Move, plan: Plan) -> str:
    step = move.step
    what = f"{step.describe()} -> {step.layout}, on ranks {list(move.members)}"
    return f"step {move.index + 1} of {len(plan.steps)} ({what})"


def plan_fingerprint(plan: Plan) -> int:
    """A 63-bit digest of the plan's JSON form (layouts, shape, dtype, steps, cost model)."""
    text = json.dumps(plan.to_json(), sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def _verify(
    plan: Plan, device: torch.device, device_mesh: DeviceMesh | None, wait: datetime.timedelta, label: str
) -> None:
    mesh: Mesh = plan.src.mesh
    mine = plan_fingerprint(plan)
    try:
        group = axis_group(mesh, tuple(range(mesh.ndim)), device_mesh, timeout=wait)
        gathered = collective(
            "all_gather", torch.tensor([mine], dtype=torch.int64, device=device), mesh.size, None, group, wait
        )
    except DistributedError as e:
        raise DistributedError(f"{label}: verifying the plan {plan.src} -> {plan.dst} failed: {e.message}") from e
    prints = gathered.tolist()
    if any(p != mine for p in prints):
        by_print: dict[int, list[int]] = {}
        for r, p in zip(mesh.ranks, prints, strict=True):
            by_print.setdefault(p, []).append(r)
        groups = "; ".join(f"ranks {ranks} hold plan {p:016x}" for p, ranks in by_print.items())
        raise PlanMismatchError(
            f"{label}: the ranks of {mesh.describe()} disagree on the plan (this rank {dist.get_rank()} runs "
            f"{plan.src} -> {plan.dst}, shape {list(plan.shape)}, {plan.dtype}, plan {mine:016x}): {groups}"
        )
