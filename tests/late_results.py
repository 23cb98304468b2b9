"""Bucket collectives whose results land as late as an asynchronous backend may let them.

A collective started with ``async_op`` may write its result at any moment before it is waited
on. :class:`LateResults` makes the runtime's buckets (``runtime.execution.buckets``) meet the latest such
moment: while it is ``delaying``, a collective runs into private buffers, and its result is
copied into the buffers it was given only when it is waited on, or, if it never is, right after
the works of the next collective waited on (before that one's result is read: a gloo
reduce_scatter's blocks are reduced after its all_to_all). Code that reads a result before
waiting for it, or reuses a buffer while a collective that writes it is still in flight, then
reads or keeps wrong values every time, not once in many runs.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

import attrs
import torch

import runtime.execution.buckets
from runtime.comm.collectives import PendingCollective, start_collective


@attrs.define(eq=False)
class _Landing:
    """A collective's result held in ``private`` until it lands in ``target``."""

    pending: PendingCollective
    private: torch.Tensor
    target: torch.Tensor
    late: list[_Landing]

    def wait(self, timeout: datetime.timedelta) -> bool:
        if self in self.late:
            self.late.remove(self)
            self.pending.wait(timeout)
            self.target.copy_(self.private)
        return True


@attrs.define(eq=False)
class _Flush:
    """The last work of a collective not held back: the held-back results land once its own
    works are done."""

    late: list[_Landing]

    def wait(self, timeout: datetime.timedelta) -> bool:
        for landing in list(self.late):
            landing.wait(timeout)
        return True


class LateResults:
    """See the module docstring; :meth:`installed` puts it in place of the buckets'
    ``start_collective``, :meth:`delayed` holds results back inside it."""

    def __init__(self) -> None:
        self.late: list[_Landing] = []
        self.delaying = False

    def start(self, op: str, send: torch.Tensor, *args: Any, out: torch.Tensor | None = None, **kw: Any) -> Any:
        if not self.delaying or (out is None and op != "all_reduce"):
            pending = start_collective(op, send, *args, out=out, **kw)
            return attrs.evolve(pending, works=(*pending.works, _Flush(self.late)))
        if op == "all_reduce":  # reduces in place: on a copy, landing in ``send``
            target, private = send, send.clone()
            pending = start_collective(op, private, *args, **kw)
        else:
            assert out is not None
            target, private = out, torch.empty_like(out)
            if kw.get("workspace") is not None:  # gloo's reduce_scatter: its blocks too
                kw["workspace"] = torch.empty_like(kw["workspace"])
            pending = start_collective(op, send, *args, out=private, **kw)
        landing = _Landing(pending, private, target, self.late)
        self.late.append(landing)
        return attrs.evolve(pending, received=target, works=(landing,), blocks=None, reduce_op=None)

    @contextlib.contextmanager
    def installed(self) -> Iterator[LateResults]:
        runtime.execution.buckets.start_collective = self.start  # type: ignore[assignment]
        try:
            yield self
        finally:
            runtime.execution.buckets.start_collective = start_collective

    @contextlib.contextmanager
    def delayed(self) -> Iterator[None]:
        self.delaying = True
        try:
            yield
        finally:
            self.delaying = False
