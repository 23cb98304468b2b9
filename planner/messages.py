"""The messages of a point-to-point step, summarized per rank pair.

A step may carry thousands of transfers (64 ranks each receiving from many blocks); what a
reader (and a benchmark against the receive bound) wants is who sends whom how much: the
transfers merged per (sender, receiver) pair, local copies counted apart, and the busiest rank's
volumes.
"""

from __future__ import annotations

from collections import Counter

import attrs

from planner.plans import Step
from shardlang.dtypes import itemsize


@attrs.frozen
class MessageSummary:
    """``pairs[(sender, receiver)]``: bytes over the wire per rank pair; ``local_copies``: the
    transfers a rank makes to itself; the largest bytes one rank sends and one receives."""

    pairs: dict[tuple[int, int], int]
    messages: int
    local_copies: int
    most_sent: int
    most_received: int


def step_messages(step: Step, dtype: str) -> MessageSummary:
    size = itemsize(dtype)
    pairs: Counter[tuple[int, int]] = Counter()
    sent: Counter[int] = Counter()
    received: Counter[int] = Counter()
    copies = messages = 0
    for t in step.transfers:
        if t.src_rank == t.dst_rank:
            copies += 1
            continue
        nbytes = t.box.numel * size
        messages += 1
        pairs[(t.src_rank, t.dst_rank)] += nbytes
        sent[t.src_rank] += nbytes
        received[t.dst_rank] += nbytes
    return MessageSummary(
        pairs=dict(sorted(pairs.items())),
        messages=messages,
        local_copies=copies,
        most_sent=max(sent.values(), default=0),
        most_received=max(received.values(), default=0),
    )
