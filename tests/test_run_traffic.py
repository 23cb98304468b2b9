"""runtime.execution.run.record_traffic, the one place a reshard's collectives, a bucket's and
an exchange's records are built: bytes as the ring formulas give them for the buffers passed,
worked out here by hand; a bucket's members summed into one record; an exchange in which a rank
sends and receives nothing leaves none.
"""

from __future__ import annotations

import time

import planner
from runtime import recording
from runtime.comm.exchange import RankExchange
from runtime.execution.program import CollectiveMove, compile_plan
from runtime.execution.run import record_traffic
from shardlang import parse_layout

MESH = "mesh[dp=4]"


def _moves(src: str, dst: str, shape: tuple[int, ...], rank: int) -> list:
    plan = planner.plan(parse_layout(f"{src} over {MESH}"), parse_layout(f"{dst} over {MESH}"), shape, "f32")
    return [m for m in compile_plan(plan, rank) if m is not None and not (isinstance(m, CollectiveMove) and m.is_local)]


def test_a_reduce_scatter_and_a_bucket_of_two_are_recorded_with_ring_bytes() -> None:
    (move,) = _moves("R | P(dp):sum", "S(dp)", (10,), 0)  # blocks of ceil(10 / 4) = 3 elements
    assert move.step.op == "reduce_scatter"
    with recording() as log:
        record_traffic([move], tensor="w", step=0, itemsize=4, planned_bytes=36, started=time.perf_counter())
        record_traffic([move, move], tensor="w,b", step=1, itemsize=4, planned_bytes=72, started=time.perf_counter())
    one, bucket = log.records
    assert (one.op, one.axis, one.ranks, one.tensor) == ("reduce_scatter", 0, (0, 1, 2, 3), "w")
    assert one.bytes_sent == 3 * 3 * 4  # (n - 1) blocks of 3 f32 to the peers
    assert (bucket.bytes_sent, bucket.planned_bytes, bucket.tensor) == (72, 72, "w,b")


def test_an_exchange_without_peers_leaves_no_record() -> None:
    (move,) = _moves("R | P(dp):sum", "S(dp)", (10,), 0)
    keeps = RankExchange(index=0, step=move.step, sends=(), receives=(), copies=(), after=(3,))
    with recording() as log:
        record_traffic([keeps], tensor="w", step=0, itemsize=4, planned_bytes=0, started=time.perf_counter())
        record_traffic([], tensor=None, step=0, itemsize=4, planned_bytes=0, started=time.perf_counter())
    assert log.records == []
