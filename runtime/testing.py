"""Run a function on N gloo ranks in separate processes, bounded in time: a public helper
(docs/api/runtime.md), which this project's own multi-process tests and benchmarks use.

    results = run_ranks(check_pairs, world_size=4, args=(cases,), timeout=120)

Ranks meet through a TCPStore served by this process on a port the OS picks.
``fn(rank, world_size, *args)`` must be a module-level function (it is pickled by name).
Each rank's return value comes back in rank order; an exception on any rank is re-raised
here with that rank's traceback; a run that outlives ``timeout`` is killed and fails.
Every run gets fresh processes, forked from one server process that imported torch and this
project once (importing torch costs a spawned process seconds; a fork from the server, a
tenth of one). The server starts at the first run and keeps the environment it saw then, so
set environment variables for the ranks before the first run. It imports the project from the
folder this module was imported from (Python 3.11's fork server does not take the caller's
``sys.path``, so it would otherwise import whatever its own path finds first: the installed
copy, not a snapshot run from elsewhere). A run still costs a group's
rendezvous, so batch many cases into one run.
``attempt(call)`` records what a call raised on a rank (and how soon), for fault tests.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import queue
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What the fork server imports once for every rank it forks: torch and the project's runtime
# (which imports planner and shardlang); what else a rank's function needs it imports itself.
_PRELOAD = ["torch", "torch.distributed", "runtime"]
# The folder holding this project's packages: put first on the fork server's path when it starts.
_PROJECT = str(Path(__file__).resolve().parent.parent)


@contextlib.contextmanager
def _server_path() -> Iterator[None]:
    """While processes start (the first start launches the fork server): ``PYTHONPATH`` begins
    with :data:`_PROJECT`, so the server preloads the same project as its caller."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = _PROJECT if not before else os.pathsep.join((_PROJECT, before))
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def _rendezvous_store(timeout: float) -> dist.TCPStore:
    """A store served by this (parent) process on a port the OS picks and keeps bound, so
    parallel runs can never race for the same port."""
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )


def attempt(call: Callable[[], object]) -> tuple[str, str, float]:
    """What ``call`` did on this rank, for fault tests: ``("ok", "", seconds)``, or the name and
    message of the exception it raised and the seconds until it did."""
    started = time.monotonic()
    try:
        call()
    except Exception as e:  # the test inspects the type and message
        return type(e).__name__, str(e), time.monotonic() - started
    return "ok", "", time.monotonic() - started


def _drain(results: Any, got: dict[int, tuple[str, Any]]) -> None:
    """Read every result still in the queue into ``got``."""
    while True:
        try:
            rank, status, value = results.get(timeout=1.0)
        except queue.Empty:
            return
        got[rank] = (status, value)


class RankFailed(AssertionError):
    """One or more ranks raised; the message holds their tracebacks."""


def _worker(
    rank: int,
    world_size: int,
    port: int,
    collective_timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    wait_for_peers: bool,
    backend: str,
) -> None:
    # One intra-op thread per rank, as torchrun starts each process (OMP_NUM_THREADS=1): the
    # variable is read when torch is imported, before this runs, so the count is set directly.
    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=collective_timeout)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        if backend == "nccl":  # one device per rank, set before NCCL's first call (docs/gpu.md)
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            dist.init_process_group(
                "nccl", store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device
            )
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            value = fn(rank, world_size, *args)
            # Serialized: tensors sent through the queue as shared memory vanish when the
            # rank exits before the parent reads them.
            buffer = io.BytesIO()
            torch.save(value, buffer)
            results.put((rank, "ok", buffer.getvalue()))
            if wait_for_peers:
                dist.barrier()  # no rank tears gloo down while a peer still talks to it
        finally:
            dist.destroy_process_group()
    except BaseException:  # report everything, even SystemExit from a deliberately dying rank
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    timeout: float = 180.0,
    collective_timeout: float = 60.0,
    allow_missing: tuple[int, ...] = (),
    backend: str = "gloo",
) -> list[Any]:
    """``fn``'s return value per rank. Ranks in ``allow_missing`` may exit without reporting
    (fault tests); their entry is ``None``, and the others then skip the closing barrier.
    ``backend="nccl"`` gives rank ``r`` CUDA device ``r`` (modulo the devices there are) as its
    current device; return CPU tensors from ``fn`` then, which the caller can load anywhere."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read once, when the server starts
    results = ctx.Queue()
    store = _rendezvous_store(timeout)
    port = store.port
    worker_args = (world_size, port, collective_timeout, fn, args, results, not allow_missing, backend)
    procs = [ctx.Process(target=_worker, args=(r, *worker_args), daemon=True) for r in range(world_size)]
    with _server_path():
        for p in procs:
            p.start()
    deadline = time.monotonic() + timeout
    got: dict[int, tuple[str, Any]] = {}
    try:
        while len(got) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, 0.5))
                got[rank] = (status, value)
            except queue.Empty:
                # Ranks allowed to vanish that are gone: stop waiting for them. A rank that died
                # without reporting (a crash: its result would have arrived before its exit)
                # fails the run now rather than at the deadline.
                alive = {r for r, p in enumerate(procs) if p.is_alive()}
                if all(r in got or (r in allow_missing and r not in alive) for r in range(world_size)):
                    break
                if any(r not in got and r not in alive and r not in allow_missing for r in range(world_size)):
                    _drain(results, got)  # what a rank put just before it exited
                    if len(got) < world_size:
                        break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del store  # the rendezvous lives exactly as long as the run
    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(got.items()) if s == "error"]
    missing = [r for r in range(world_size) if r not in got and r not in allow_missing]
    died = [r for r in missing if procs[r].exitcode not in (None, -9)]  # -9: killed here at the deadline
    if died:  # the cause, before what it made the others raise
        codes = ", ".join(f"rank {r}: {procs[r].exitcode}" for r in died)
        errors.insert(0, f"ranks {died} exited without reporting a result (exit codes {codes})")
    if errors:
        raise RankFailed("\n".join(errors))
    if missing:
        raise RankFailed(f"ranks {missing} did not finish within {timeout}s")
    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) if r in got else None for r in range(world_size)]
