"""The ranks' agreement on what they are about to run: one check for every compiled program.

A reshard's plan (``runtime.execution.executor``), a step plan's buckets
(``runtime.optim.compiler``) and Muon's matrix plan (``runtime.optim.matrix_iterations``) are
each described by records every rank of a group builds alike; the ranks all-gather a 63-bit
digest of them (:func:`digests`) before the program's first collective, so that ranks configured
apart raise, naming each other, instead of exchanging buffers that match in size only.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch

from planner.plans import Plan
from runtime.comm.collectives import collective


def fingerprint(data: Any) -> int:
    """A 63-bit digest of ``data``'s JSON form (what ranks all-gather to check they agree)."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def plan_fingerprint(plan: Plan) -> int:
    """A 63-bit digest of the plan's JSON form (layouts, shape, dtype, steps, cost model)."""
    return fingerprint(plan.to_json())


def digests(
    records: object, members: Sequence[int], group: Any, device: torch.device, timeout: datetime.timedelta
) -> tuple[int, list[int]]:
    """This rank's digest of ``records`` and every member's of theirs (``members``: the ranks
    of ``group`` in its order): one all-gather of 8 bytes. Raises ``DistributedError`` when the
    all-gather fails."""
    mine = fingerprint(records)
    digest = torch.tensor([mine], dtype=torch.int64, device=device)
    return mine, collective("all_gather", digest, len(members), None, group, timeout).tolist()


def differing_ranks(
    records: object, members: Sequence[int], group: Any, device: torch.device, timeout: datetime.timedelta
) -> list[int]:
    """The ranks of ``group`` whose digest of their ``records`` differs from this rank's
    (:func:`digests`)."""
    mine, gathered = digests(records, members, group, device, timeout)
    return [r for r, p in zip(members, gathered, strict=True) if p != mine]
