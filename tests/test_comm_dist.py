"""The collective layer on real gloo process groups: an all_gather as gloo's ring and as
point-to-point messages (results of ``GATHER_MESSAGES_BYTES`` or more) gives every rank the
blocks of every rank in order, on the whole world and on subgroups, complex values too, also with two gathers and a
plan's own point-to-point messages in flight at once, and after gathers started and dropped
without a wait; a gather waited on keeps none of its messages' works (kept past
``destroy_process_group``, one aborted its process at exit)."""

from __future__ import annotations

import datetime
import functools
import gc

import torch
import torch.distributed as dist

import runtime.comm.collectives as collectives
from runtime.comm.collectives import (
    GATHER_MESSAGES_BYTES,
    post_point_to_point,
    start_collective,
    wait_point_to_point,
)
from runtime.testing import run_ranks

TIMEOUT = datetime.timedelta(seconds=60)
BIG = GATHER_MESSAGES_BYTES // 4 // 2  # f32 elements per rank: the result of 2 ranks is the threshold
SMALL = 1000


def block(rank: int, numel: int, salt: int) -> torch.Tensor:
    """What ``rank`` contributes: values no other rank, size or gather has."""
    return torch.arange(numel, dtype=torch.float32) * 8 + rank + 1000 * salt


def complex_block(rank: int, numel: int) -> torch.Tensor:
    """A complex block whose real and imaginary parts differ per rank and element."""
    return torch.complex(block(rank, numel, 7), -block(rank, numel, 8))


def _run(rank: int, world_size: int) -> dict[str, list[torch.Tensor]]:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in order
    pair = pairs[rank // 2]
    out: dict[str, list[torch.Tensor]] = {}
    for name, group, n in (("world", dist.group.WORLD, 4), ("pair", pair, 2)):
        for numel in (SMALL, BIG):
            me = dist.get_rank(group)
            got = start_collective("all_gather", block(me, numel, numel), n, None, group, waited_at_once=True).wait(
                TIMEOUT
            )
            out[f"{name} {numel}"] = [got]
    # Complex values, which the process group moves as pairs of reals.
    got = start_collective(
        "all_gather", complex_block(rank, BIG // 2), 4, None, dist.group.WORLD, waited_at_once=True
    ).wait(TIMEOUT)
    out["complex"] = [got]
    # Two gathers on one group and a point-to-point exchange in between, all in flight at once.
    peer = rank ^ 1
    first = start_collective("all_gather", block(rank, BIG, 1), 4, None, dist.group.WORLD, waited_at_once=True)
    received = torch.empty(SMALL)
    messages = post_point_to_point([(peer, block(rank, SMALL, 2))], [(peer, received)])
    second = start_collective("all_gather", block(rank, BIG, 3), 4, None, dist.group.WORLD, waited_at_once=True)
    wait_point_to_point(messages, TIMEOUT)
    out["in flight"] = [first.wait(TIMEOUT), second.wait(TIMEOUT), received]
    # A gather waited on lets go of its messages' works.
    waited = start_collective("all_gather", block(rank, BIG, 9), 4, None, dist.group.WORLD, waited_at_once=True)
    waited.wait(TIMEOUT)
    kept = [w for w in collectives._MESSAGES_IN_FLIGHT if any(w is mine for mine in waited.works)]
    out["kept"] = [torch.tensor(len(kept)), torch.tensor(len(waited.works))]
    # Gathers never waited on (as the prefetch after a run's last step), then one that is.
    for salt in (4, 5):
        start_collective("all_gather", block(rank, BIG, salt), 4, None, dist.group.WORLD, waited_at_once=True)
    gc.collect()
    out["after dropped"] = [
        start_collective("all_gather", block(rank, BIG, 6), 4, None, dist.group.WORLD, waited_at_once=True).wait(
            TIMEOUT
        )
    ]
    return out


@functools.cache
def _results() -> list[dict[str, list[torch.Tensor]]]:
    return run_ranks(_run, 4, timeout=120)


def test_all_gather_both_ways_gives_every_block_in_rank_order() -> None:
    assert 2 * BIG * 4 >= GATHER_MESSAGES_BYTES > 4 * SMALL * 4  # both ways really run
    for rank, result in enumerate(_results()):
        for name, n in (("world", 4), ("pair", 2)):
            for numel in (SMALL, BIG):
                (got,) = result[f"{name} {numel}"]
                want = torch.cat([block(r, numel, numel) for r in range(n)])
                assert torch.equal(got, want), f"rank {rank}: {name} all_gather of {numel} elements"


def test_a_complex_all_gather_as_messages_keeps_both_parts() -> None:
    assert 4 * (BIG // 2) * 8 >= GATHER_MESSAGES_BYTES  # it runs as messages
    want = torch.cat([complex_block(r, BIG // 2) for r in range(4)])
    for rank, result in enumerate(_results()):
        (got,) = result["complex"]
        assert got.dtype == torch.complex64 and torch.equal(got, want), f"rank {rank}"


def test_gathers_in_flight_with_point_to_point_messages_match_their_own() -> None:
    for rank, result in enumerate(_results()):
        first, second, received = result["in flight"]
        assert torch.equal(first, torch.cat([block(r, BIG, 1) for r in range(4)])), f"rank {rank}: first gather"
        assert torch.equal(second, torch.cat([block(r, BIG, 3) for r in range(4)])), f"rank {rank}: second gather"
        assert torch.equal(received, block(rank ^ 1, SMALL, 2)), f"rank {rank}: point-to-point message"


def test_a_gather_after_gathers_dropped_unwaited_gets_its_own_blocks() -> None:
    for rank, result in enumerate(_results()):
        (got,) = result["after dropped"]
        assert torch.equal(got, torch.cat([block(r, BIG, 6) for r in range(4)])), f"rank {rank}"


def test_a_gather_waited_on_keeps_none_of_its_messages() -> None:
    for rank, result in enumerate(_results()):
        kept, works = (int(t) for t in result["kept"])
        assert works == 6, f"rank {rank}: ran as {works} works, not as messages to and from 3 peers"
        assert kept == 0, f"rank {rank}: {kept} of its messages' works still kept after the wait"
