"""One rank of a large world, run for real in one process: the optimizer's own per-step work
against the rank count, without the machines.

    .venv/bin/python bench/bench_fake_world.py [--worlds 1024,4096,16384,65536] [--steps 5] [--json PATH]
    .venv/bin/python bench/bench_fake_world.py --worlds 4096 --profile 25     # a steady step's top functions

Each world size runs in a fresh process of its own (one intra-op thread; glibc's mmap threshold
at 64 KiB, as ``bench_memory.py`` sets it, so that freed tensors leave the resident set). Rank 0
joins a world of ``N`` ranks through torch's fake process group (``torch.testing._internal.
distributed.fake_pg``: every collective completes at once and moves nothing), builds its own
pieces of a Llama-7B-shaped model (vocab 32000, hidden 4096, FFN 11008, 32 blocks: 291 tensors,
bf16, 6.7B parameters) and runs the real ``ShardedAdamW`` step on them: step plans, buckets, kept
buffers, the commit flags, ``state_dict()`` and ``memory_report()``. What it measures is the work
of one rank, whatever the others would do.

Layouts (:func:`llama_spec`), on mesh ``[dp=N/8, tp=8]``, FSDP2 over TP: column-parallel weights
and the embedding ``S(tp,dp),R`` (TP's rows, each cut again over dp), row-parallel weights
``S(dp),S(tp)``, parameters, gradients (FSDP2 has reduced them) and states alike; the 65 RMSNorm
weights replicated, their gradients a pending mean over dp and their states ``S(dp)`` (ZeRO-2), so
that every step also reduce-scatters and all-gathers a bucket over the 512 (at 4,096 ranks) dp
ranks. Per world size:

* **construct s**: ``ShardedAdamW(...)``; **first step s**: step 1, which plans (step 2 plans
  again: the bf16 parameters' fp32 masters replace the parameter leg); **step ms**: the median
  CPU time of the steps after the second (process time, steadier than wall time on a shared
  machine); **state_dict ms**;
* **calls/step** and **alloc KiB/step**: Python function calls (``sys.setprofile``) and the
  peak of Python's own allocations (``tracemalloc``) over one steady step: these stay the same
  when the per-step work does not grow with the ranks;
* **peak RSS MiB** of the process (``ru_maxrss``), and **held MiB**: ``VmRSS`` after the steps
  minus ``VmRSS`` before the parameters were made (both after ``malloc_trim``);
* **counted MiB**: what the parameters, their gradients and every tensor the optimizer
  references hold, counted through their storages (``runtime.measure.storages``, as
  ``tests/test_memory_dist.py`` counts them), beside **predicted MiB**: the tensors of
  ``optimizer.memory_report()`` (``tensor_bytes``: its total less the ``host`` kind, the Python
  objects measured below);
* **objects MiB**: the Python objects the run left alive (``tracemalloc``'s current bytes after
  the steps less those before the parameters were made), counted in a second fresh process of
  the same world, since tracing costs resident memory of its own; **held / (predicted +
  objects)**: the resident set against the tensors the report predicts plus those objects.
  The calls and the allocations per step are counted in that second process too, so that the
  first one's steps are all plain: its timings and its held RSS are the steps' own, not the
  counting's (``sys.setprofile``'s counters, ``tracemalloc``'s tables, about 0.4 MiB).

What the held resident set counts, and why it is the rank's (measured phase by phase with
``VmRSS``, ``mallinfo2`` and ``sys._debugmallocstats`` at 4,096 ranks): the baseline is taken
after torch's imports, the fake group, the spec's parse and a warm-up of two steps of a one-block
model (code that every world size loads once; none of it is the optimizer's per-rank state).
Above it the run holds the tensors ``memory_report()`` predicts (28.6 MiB at 4,096 ranks), about
2.7 MiB of Python objects of the optimizer's own (its step programs, flat views, slots, buckets
and plans: ``runtime/`` state, roughly 10 KiB per tensor, which ``memory_report()`` leaves out
since it reports tensors; the same at every world size, since groups, the commit's members and
the meshes' keys hold their ranks as runs, ``shardlang.mesh.RankRuns``, not one by one: held
as tuples they grew to 9.2 MiB at 65,536 ranks), and about 2 MiB that the allocators
keep: Python's 1 MiB arenas and glibc's heap, grown by the first steps' planning and partly
occupied after it (with the optimizer, the parameters and every tensor dropped, 4.9 MiB stays
resident while only 0.45 MiB of traced Python objects survive). All of it is kept: a warm-up on
the full model would hide the optimizer's own objects and its allocators' growth in pages
touched before the baseline. The objects are counted by Python's allocator, not by
``memory_report()``'s formula, so the last column checks the report's tensors and names what is
outside them.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import gc
import io
import json
import os
import pstats
import re
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import results  # noqa: E402  (bench/, found through the path above)

LLAMA_7B = {"vocab": 32000, "hidden": 4096, "ffn": 11008, "layers": 32}
TP = 8
COL, ROW = "S(tp,dp),R", "S(dp),S(tp)"
MiB = 2**20


def llama_spec(world: int, *, vocab: int, hidden: int, ffn: int, layers: int) -> str:
    """The spec text of a Llama-shaped model under FSDP2 over TP on ``[dp=world/8, tp=8]``
    (module docstring)."""
    if world % TP:
        raise ValueError(f"the world size {world} is not a multiple of tp={TP}")
    blocks = f"{{0..{layers - 1}}}"

    def tensors(names: str, shape: str, layout: str) -> str:
        return (
            f"tensor {names} : bf16[{shape}] {{\n"
            f"  param = {layout} over world  grad = {layout} over world  state = {layout} over world\n}}\n"
        )

    text = f"mesh world = [dp={world // TP}, tp={TP}]\n"
    text += tensors("model.embed_tokens.weight", f"{vocab}, {hidden}", COL)
    text += tensors(f"model.layers.{blocks}.self_attn.{{q_proj,k_proj,v_proj}}.weight", f"{hidden}, {hidden}", COL)
    text += tensors(f"model.layers.{blocks}.self_attn.o_proj.weight", f"{hidden}, {hidden}", ROW)
    text += tensors(f"model.layers.{blocks}.mlp.{{gate_proj,up_proj}}.weight", f"{ffn}, {hidden}", COL)
    text += tensors(f"model.layers.{blocks}.mlp.down_proj.weight", f"{hidden}, {ffn}", ROW)
    text += tensors("lm_head.weight", f"{vocab}, {hidden}", COL)
    norms = f"model.layers.{blocks}.{{input_layernorm,post_attention_layernorm}}.weight"
    for names in (norms, "model.norm.weight"):
        text += (
            f"tensor {names} : bf16[{hidden}] {{\n"
            "  param = R over world  grad = R | P(dp):avg over world  state = S(dp) over world\n}\n"
        )
    return text


def join_fake_world(world: int, rank: int = 0) -> None:
    """Make this process rank ``rank`` of a fake world of ``world`` ranks (the default process
    group; one that exists is destroyed first)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _trimmed_rss() -> int:
    """``VmRSS`` after glibc returned its free heap memory (``malloc_trim``): the pieces here are
    mostly under the mmap threshold, so freed ones would stay resident in the heap otherwise."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _vm("VmRSS")


def _vm(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes (0 where there is none)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else 0


def counted_calls(call: Callable[[], object]) -> Counter[str]:
    """The Python functions ``call()`` calls (``sys.setprofile``'s call events), as
    ``path:name`` (the path from its top package folder) with the number of calls."""
    calls: Counter[Any] = Counter()

    def profile(frame: Any, event: str, arg: object) -> None:
        if event == "call":
            calls[frame.f_code] += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    named: Counter[str] = Counter()
    for code, n in calls.items():
        path = Path(code.co_filename)
        named[f"{'/'.join(path.parts[-2:])}:{code.co_name}"] += n
    return named


def traced_peak(call: Callable[[], object]) -> int:
    """The peak bytes of Python's own allocations (``tracemalloc``) while ``call()`` runs, above
    what was allocated when it began (tracing left on where it was on)."""
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        call()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        if not tracing:
            tracemalloc.stop()


def _warm_up(world: int, rank: int, options: dict[str, Any]) -> None:
    """Two steps of a one-block model with one row per rank, so that what every run loads once
    (modules torch imports lazily, kernels' code) is resident before the held memory is measured."""
    import torch

    import shardlang
    from runtime.optim import ShardedAdamW

    spec = shardlang.parse_spec(llama_spec(world, vocab=world, hidden=world // TP, ffn=world, layers=1))
    params = []
    for tensor in spec.tensors:
        piece = tensor.param.rank_piece(tensor.shape, rank).shape
        params.append((tensor.name, torch.nn.Parameter(torch.zeros(piece, dtype=torch.bfloat16))))
    optimizer = ShardedAdamW(params, spec, lr=1e-4, **options)
    for _ in range(2):
        for _, p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
    optimizer.state_dict()
    optimizer.memory_report()


def run_world(
    world: int,
    *,
    steps: int = 5,
    model: dict[str, int] | None = None,
    profile: int = 0,
    around_step: Callable[[], object] | None = None,
    warm_up: bool = True,
    trace_objects: bool = False,
    count_calls: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Rank 0 of a fake world of ``world`` ranks (already joined: :func:`join_fake_world`) runs
    ``steps`` steps of ``ShardedAdamW`` on its pieces of ``model`` (Llama-7B's shape by
    default); what it measured. ``options`` go to ``ShardedAdamW``; ``around_step`` runs inside
    every step's measurement (the tests' stand-in for work that walks the ranks); without
    ``warm_up`` the held RSS also counts what the first run of the code loads; with
    ``trace_objects`` Python's allocations are traced from the baseline on ("objects": what they
    hold at the end), which makes the resident figures the tracing's too; without ``count_calls``
    no step is counted or traced (calls and alloc 0), so that the held RSS is the steps' alone."""
    import torch
    import torch.distributed as dist

    import shardlang
    from runtime.measure.storages import storage_bytes
    from runtime.optim import ShardedAdamW

    if steps < 3:
        raise ValueError("steps must be at least 3 (two that plan, then steady ones)")
    rank = dist.get_rank()
    # The fake group's collectives move nothing, so the replicas' checksums it gathers are not
    # the other ranks': that check has nothing to compare here.
    options = {"verify_replicas": False} | options
    spec = shardlang.parse_spec(llama_spec(world, **(model or LLAMA_7B)))
    if warm_up:
        _warm_up(world, rank, options)
    if trace_objects:
        tracemalloc.start()
    objects_before = tracemalloc.get_traced_memory()[0]
    rss_before = _trimmed_rss()
    params = []
    generator = torch.Generator().manual_seed(rank)
    for tensor in spec.tensors:
        piece = tensor.param.rank_piece(tensor.shape, rank).shape
        params.append((tensor.name, torch.nn.Parameter(torch.randn(piece, generator=generator).to(torch.bfloat16))))
    started = time.perf_counter()
    optimizer = ShardedAdamW(params, spec, lr=1e-4, weight_decay=0.1, **options)
    construct = time.perf_counter() - started

    def one_step() -> None:
        optimizer.step()
        if around_step is not None:
            around_step()

    seconds, cpu = [], []
    calls: Counter[str] = Counter()
    alloc = 0
    stats = ""
    for step in range(steps):
        for _, p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(torch.bfloat16)
        if step == steps - 1 and count_calls:  # the last step, counted and traced (both slow it: not timed)
            calls = counted_calls(one_step)
        elif step == steps - 2 and steps > 3 and count_calls:
            alloc = traced_peak(one_step)
        elif step == steps - 3 and profile:
            profiler = cProfile.Profile()
            profiler.runcall(one_step)
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(profile)
            stats = out.getvalue()
        else:
            wall, process = time.perf_counter(), time.process_time()
            one_step()
            seconds.append(time.perf_counter() - wall)
            cpu.append(time.process_time() - process)
    if steps == 3 and count_calls:
        alloc = traced_peak(one_step)
    started = time.perf_counter()
    state = optimizer.state_dict()
    state_dict_seconds = time.perf_counter() - started
    del state
    gc.collect()
    report = optimizer.memory_report()
    rss_after = _trimmed_rss()
    objects = tracemalloc.get_traced_memory()[0] - objects_before if trace_objects else 0
    if trace_objects:
        tracemalloc.stop()
    local = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for _, p in params}
    grads = [p.grad for _, p in params if p.grad is not None]  # none: step() freed them (free_grads)
    local |= {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
    counted = sum(local.values()) + sum(storage_bytes(optimizer, set(local)).values())
    return {
        "world": world,
        "elements": sum(p.numel() for _, p in params),
        "construct_s": construct,
        "first_step_s": cpu[0],
        "second_step_s": cpu[1],
        "first_step_wall_s": seconds[0],
        "step_s": statistics.median(cpu[2:]) if len(cpu) > 2 else float("nan"),
        "step_min_s": min(cpu[2:]) if len(cpu) > 2 else float("nan"),
        "step_wall_s": statistics.median(seconds[2:]) if len(seconds) > 2 else float("nan"),
        "state_dict_s": state_dict_seconds,
        "calls_per_step": sum(calls.values()),
        "calls": dict(calls),
        "alloc_per_step": alloc,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "held_rss": rss_after - rss_before,
        "objects": objects,
        "counted": counted,
        "predicted": report.tensor_bytes,  # the host kind is what "objects" measures
        "host": report.host,
        "report": str(report),
        "buckets": len(optimizer.step_plan().buckets),
        "profile": stats,
    }


def _child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    join_fake_world(args.world)
    got = run_world(
        args.world,
        steps=args.steps,
        profile=args.profile,
        trace_objects=args.trace_objects,
        count_calls=args.trace_objects,
        bucket_bytes=args.bucket_bytes,
    )
    print("RESULT " + json.dumps(got))


def _in_fresh_process(world: int, args: argparse.Namespace, *, trace_objects: bool = False) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--world", str(world)]
    command += ["--steps", str(args.steps), "--profile", str(0 if trace_objects else args.profile)]
    if trace_objects:
        command.append("--trace-objects")
    if args.bucket_bytes is not None:
        command += ["--bucket-bytes", str(args.bucket_bytes)]
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"world {world} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads(lines[-1][len("RESULT ") :])


def _rows(runs: Iterable[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in runs:
        rows.append(
            [
                f"{r['world']:,}",
                f"{r['elements'] / 1e6:.2f}M",
                f"{r['construct_s']:.2f}",
                f"{r['first_step_s']:.2f}",
                f"{r['second_step_s']:.2f}",
                f"{r['step_s'] * 1e3:.1f}",
                f"{r['state_dict_s'] * 1e3:.1f}",
                f"{r['calls_per_step']:,}",
                f"{r['alloc_per_step'] / 1024:.0f}",
                f"{r['peak_rss'] / MiB:.0f}",
                f"{r['held_rss'] / MiB:.1f}",
                f"{r['counted'] / MiB:.2f}",
                f"{r['predicted'] / MiB:.2f}",
                f"{r['predicted'] / r['counted']:.3f}",
                f"{r['objects'] / MiB:.2f}",
                f"{r['held_rss'] / (r['predicted'] + r['objects']):.3f}",
            ]
        )
    return rows


COLUMNS = (
    "ranks",
    "elements/rank",
    "construct s",
    "first step s",
    "second step s",
    "step ms (CPU)",
    "state_dict ms",
    "calls/step",
    "alloc KiB/step",
    "peak RSS MiB",
    "held MiB (RSS)",
    "counted MiB",
    "predicted MiB",
    "predicted / counted",
    "objects MiB",
    "held / (predicted + objects)",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1024,4096,16384,65536", help="world sizes, multiples of 8")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per world (at least 3)")
    parser.add_argument("--bucket-bytes", type=int, default=None, help="the optimizer's bucket_bytes")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print a steady step's N top functions")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per world size")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--trace-objects", action="store_true", help=argparse.SUPPRESS)
    results.add_json_option(parser)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    runs = []
    for world in (int(w) for w in args.worlds.split(",")):
        got = _in_fresh_process(world, args)
        traced = _in_fresh_process(world, args, trace_objects=True)
        got |= {k: traced[k] for k in ("objects", "calls", "calls_per_step", "alloc_per_step")}
        runs.append(got)
        print(f"{world:,} ranks: {got['report']}", flush=True)
        if got["profile"]:
            print(got["profile"])
    rows = _rows(runs)
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(COLUMNS)]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) + " |")
    note = (
        "One rank (rank 0) of a fake world per row, each in a fresh process: ShardedAdamW on its pieces "
        "of a Llama-7B-shaped model (291 bf16 tensors) under FSDP2 over TP on [dp=N/8, tp=8], norms ZeRO-2. "
        "step ms: median CPU time of the steps after the two that plan; calls and alloc: one steady step's "
        "Python calls and peak Python allocation; counted: parameters, gradients and the optimizer's tensors "
        "by their storages; predicted: memory_report(); held: VmRSS after the steps less before the "
        "parameters (after a one-block warm-up); objects: the Python objects the run left alive (tracemalloc, "
        "in a second fresh process), the optimizer's bookkeeping that memory_report() leaves out."
    )
    table = results.table("One rank of a fake world, per world size", COLUMNS, rows, note)
    data = [{k: v for k, v in r.items() if k not in ("profile", "calls")} for r in runs]
    results.write(args.json, "fake_world", [table], data=data)


if __name__ == "__main__":
    main()
