"""A whole training step on 4 gloo ranks: DDP, ZeRO, FSDP2 and the sharded optimizers.

    .venv/bin/python bench/bench_step.py                       # small (30 steps) and medium (12 steps)
    .venv/bin/python bench/bench_step.py --models small --steps 5
    .venv/bin/python bench/bench_step.py --variants ddp,fsdp2,sharded --json out/bench_step.json

Two language models built from ``torch.nn`` (no downloads): an embedding (vocabulary 512),
``nn.TransformerEncoderLayer`` blocks (4 heads, ``batch_first``, dropout 0, causal mask) and a
linear head without bias. "small": width 128, 4 layers, feed-forward 512 (50 tensors, 0.92M
parameters); "medium": width 256, 8 layers, feed-forward 1024 (98 tensors, 6.6M). f32.

Every rank (one thread each, ``runtime.testing.run_ranks``) trains on its own 4 x 64 random
tokens (seeded per rank and step, so every variant sees the same data), next-token
cross-entropy. One training step is ``model.zero_grad()`` + forward + backward +
``optimizer.step()``. The variants, each with its own copy of the same initial weights, live
in the same processes and are interleaved step by step (variant A step k, variant B step k,
...), a barrier before each timed region, so that machine noise hits all alike:

* ``ddp``: ``DistributedDataParallel`` + ``torch.optim.AdamW(foreach=True)``;
* ``zero``: DDP + ``ZeroRedundancyOptimizer(optimizer_class=torch.optim.AdamW, foreach=True)``;
* ``fsdp2``: ``fully_shard`` on every layer, then on the root, + ``torch.optim.AdamW(foreach=True)``;
* ``sharded``: ``ShardedAdamW``, no DDP wrapper, a ZeRO-2 spec over ``mesh[dp=4]``: params
  ``R,R``/``R``, gradients ``R,R | P(dp):avg``/``R | P(dp):avg``, states ``S(dp),R``/``S(dp)``;
* ``sharded-flat``: ``ShardedAdamW`` with the same param/grad layouts, states ``R,R``/``R`` and
  ``flat_axis="dp"`` (flat ZeRO);
* ``sharded-replicated``: ``ShardedAdamW`` with replicated states ``R,R``/``R``: one bucketed
  all-reduce, as DDP's, then the whole update on every rank.

lr 1e-3, weight decay 0.01, betas (0.9, 0.999), eps 1e-8 everywhere. Times are the median over
steps 4..N of rank 0's wall time (the "step()" column is the ``optimizer.step()`` part of
it); the ratio is to ``ddp``. "CPU ms, all ranks" sums over the ranks each one's median CPU time
of a training step (``time.process_time``: the process's threads, gloo's included): where it is
about twice the wall time, the 2 cores were busy throughout, so that only less work, not less
waiting, makes a step shorter. Losses (rank 0's batch) are printed per step beside the times and
must agree across variants within 1e-3 relative; a ``MISMATCH`` line says where they do not.

A second section times ``optimizer.step()`` alone on the same processes and the same
parameter shapes, with random gradients: ``ShardedAdamW`` (ZeRO-2 spec and flat) against one
flat all-reduce of all gradients (``torch.cat`` into one buffer, ``all_reduce``, divide by the
world size, copy back) + ``torch.optim.AdamW(foreach=True)``; ``ShardedCAME`` (ZeRO-2 spec and
flat, lr 1e-3, weight decay 0.01) against one flat all-reduce + ``came_pytorch.CAME``. The
last column is the largest difference of the parameters after all steps to the reference's,
relative to the reference's largest magnitude.

What is counted:

* collectives: c10d operators (``c10d::allreduce_``, ``c10d::broadcast_``,
  ``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``, ...; barriers excluded) that
  ``torch.profiler`` saw on rank 0 during step 3, inside ``optimizer.step()`` and inside the
  whole training step (DDP's reducer, FSDP2 and ``torch.distributed`` functions all go
  through these operators; nothing is patched); point-to-point messages posted one after
  another (``c10d::send``, ``c10d::recv_``: the runtime's all_gather on gloo) count as one. For
  the sharded optimizers, "recorded" is ``len(log.records)`` of ``runtime.recording()`` around
  the same ``step()`` call.
* held memory per rank after a step (the largest over ranks): parameters and gradients as
  tensors (FSDP2: the local shards), optimizer states (``optimizer.state`` tensors; ZeRO: its
  local optimizer's; ours: ``state_bytes()``), bucket buffers (DDP: its reducer's buckets from
  ``_get_ddp_logging_data()``, which exist beside the gradients; ours: ``work_bytes``, what a
  step keeps besides the states: the bucket buffers, the spare state buffers of the
  all-or-nothing swap and the working buffers of the flat math; others: none).
* transient peak: the most bytes the CPU allocator held above what it held when the step
  (or ``optimizer.step()``) began, from the profiler's allocation events during step 3 (the
  profiler runs from step 2, so tensors freed in step 3 were seen allocated); largest over
  ranks. Steps 2 and 3 are profiled and therefore never timed.

``--replicas`` runs only what the replica checks cost (``bench/replica_cost.py``) instead.

A third section times the collectives alone: one flat buffer of every parameter, all-reduced
(DDP's traffic) against reduce-scattered and all-gathered (ZeRO's), through the runtime's own
``collective``: the floor under any ZeRO step on the backend, whatever the optimizer does.

The machine this was written on is a shared 2-core VM: 4 ranks share 2 cores, so absolute
times are noisy and only ratios measured in the same run mean much. The default steps per
model (30 small, 12 medium: medians of 27 and 9 timed steps, since one step's time there varies
by 10% from step to step) keep the default run near 3 minutes there; ``--steps`` sets one
count for all models (at least 4).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import came_pytorch
import results as bench_results
import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_model import ADAMW, CAME, MODELS, VOCAB, build_model, spec_for, tokens_for
from replica_cost import replica_section, report_replicas
from step_profile import attribute_bytes, ddp_bucket_bytes, nbytes, profile_counts, torch_state_bytes
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function

import runtime
from runtime.comm.collectives import collective
from runtime.optim import ShardedAdamW, ShardedCAME
from runtime.testing import run_ranks

DEFAULT_STEPS = {"small": 30, "medium": 12}
FIRST_TIMED = 4  # steps are numbered from 1; steps 2 and 3 are profiled
PROFILED = (2, 3)
LOSS_RTOL = 1e-3
VARIANTS = {
    "ddp": "DDP + AdamW(foreach)",
    "zero": "DDP + ZeroRedundancyOptimizer(AdamW)",
    "fsdp2": "FSDP2 fully_shard + AdamW(foreach)",
    "sharded": "ShardedAdamW, ZeRO-2 spec",
    "sharded-flat": "ShardedAdamW, flat ZeRO",
    "sharded-replicated": "ShardedAdamW, replicated states (DDP's collectives)",
    "sharded-overlap": "ShardedAdamW, ZeRO-2 spec, overlap + prefetch_params",
}
STEP_ALONE = {
    "adamw-ref": "flat all-reduce + AdamW(foreach)",
    "adamw-sharded": "ShardedAdamW, ZeRO-2 spec",
    "adamw-flat": "ShardedAdamW, flat ZeRO",
    "came-ref": "flat all-reduce + came_pytorch.CAME",
    "came-sharded": "ShardedCAME, ZeRO-2 spec",
    "came-flat": "ShardedCAME, flat ZeRO",
}
MiB = 2**20


@dataclass
class Variant:
    """One way of stepping, as one rank runs it: ``prepare`` (untimed, may be None) then
    ``run`` (timed, returns the loss; None: ``optimizer.step()`` alone), and what it measured."""

    key: str
    model: nn.Module
    optimizer: Any
    memory: Callable[[], dict[str, int | None]]
    run: Callable[[int], float] | None = None
    prepare: Callable[[int], None] | None = None
    sharded: bool = False
    seconds: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)  # the process's CPU time (gloo's threads too)
    wait_seconds: list[float] = field(default_factory=list)  # ours: blocked on collectives in step()
    losses: list[float] = field(default_factory=list)
    recorded: dict[str, int] = field(default_factory=dict)

    def timed_step(self, step: int) -> None:
        """``optimizer.step()``, timed; on step 3 recorded by the runtime if it is ours."""
        recording = self.sharded and step == PROFILED[-1]
        planned = self.optimizer.planned_traffic() if recording else None
        with record_function(f"bench|{self.key}|step"):
            started = time.perf_counter()
            if planned is not None:
                with runtime.recording() as log:
                    self.optimizer.step()
                self.recorded = {
                    "collectives": len(log.records),
                    "bytes": log.total_bytes,
                    "planned_collectives": planned.collectives,
                    "planned_bytes": planned.bytes,
                }
            else:
                self.optimizer.step()
            self.step_seconds.append(time.perf_counter() - started)
            if self.sharded:
                self.wait_seconds.append(self.optimizer.last_wait_seconds)


def train_variant(
    key: str, base: nn.Module, rank: int, world: int, mesh: DeviceMesh, overlap_bucket_bytes: int | None
) -> Variant:
    """A copy of ``base`` and its optimizer, stepped the way ``key`` names."""
    model = copy.deepcopy(base)
    module: nn.Module = DistributedDataParallel(model) if key in ("ddp", "zero") else model
    optimizer: Any
    if key == "zero":
        optimizer = ZeroRedundancyOptimizer(
            list(model.parameters()), optimizer_class=torch.optim.AdamW, foreach=True, **ADAMW
        )
    elif key in ("ddp", "fsdp2"):
        if key == "fsdp2":
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True, **ADAMW)
    else:
        matrix, vector, flat = {
            "sharded": ("S(dp),R", "S(dp)", None),
            "sharded-flat": ("R,R", "R", "dp"),
            "sharded-replicated": ("R,R", "R", None),
            "sharded-overlap": ("S(dp),R", "S(dp)", None),
        }[key]
        spec = spec_for(model, world, matrix, vector)
        overlap = key == "sharded-overlap"
        optimizer = ShardedAdamW(
            model.named_parameters(),
            spec,
            **ADAMW,
            flat_axis=flat,
            overlap=overlap,
            bucket_bytes=overlap_bucket_bytes if overlap else None,
        )
        if overlap:
            optimizer.prefetch_params(model.embed, *model.layers, model.head)

    def memory() -> dict[str, int | None]:
        params = list(model.parameters())
        if key.startswith("sharded"):
            state, buckets = optimizer.state_bytes(), attribute_bytes(optimizer, "work_bytes")
        else:
            state = torch_state_bytes(optimizer.optim if key == "zero" else optimizer)
            buckets = ddp_bucket_bytes(module) if key in ("ddp", "zero") else None
        return {"params": nbytes(params), "grads": nbytes(p.grad for p in params), "state": state, "buckets": buckets}

    def run(step: int) -> float:
        tokens = tokens_for(step, rank)
        module.zero_grad(set_to_none=True)
        loss = F.cross_entropy(module(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        variant.timed_step(step)
        return loss.item()

    variant = Variant(key, module, optimizer, memory, run=run, sharded=key.startswith("sharded"))
    return variant


class FlatAllReduce:
    """One all-reduce of every gradient through one flat buffer, then ``optimizer.step()``."""

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, world: int) -> None:
        self.params, self.optimizer, self.world = params, optimizer, world

    def step(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        self.optimizer.step()

    def state_bytes(self) -> int:
        return torch_state_bytes(self.optimizer)


def step_alone_variant(key: str, base: nn.Module, rank: int, world: int) -> Variant:
    """``optimizer.step()`` alone on a copy of ``base``'s parameters with random gradients."""
    named = [(n, nn.Parameter(p.detach().clone())) for n, p in base.named_parameters()]
    params = [p for _, p in named]
    kind, how = key.split("-")
    if how == "ref":
        inner = (
            torch.optim.AdamW(params, foreach=True, **ADAMW) if kind == "adamw" else came_pytorch.CAME(params, **CAME)
        )
        optimizer: Any = FlatAllReduce(params, inner, world)
    else:
        matrix, vector, flat = ("S(dp),R", "S(dp)", None) if how == "sharded" else ("R,R", "R", "dp")
        spec = spec_for(base, world, matrix, vector)
        if kind == "adamw":
            optimizer = ShardedAdamW(named, spec, **ADAMW, flat_axis=flat)
        else:
            optimizer = ShardedCAME(named, spec, **CAME, flat_axis=flat)

    def prepare(step: int) -> None:
        gen = torch.Generator().manual_seed(step * 1000 + rank + 500)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)

    def memory() -> dict[str, int | None]:
        return {"state": optimizer.state_bytes()}

    return Variant(key, nn.ParameterList(params), optimizer, memory, prepare=prepare, sharded=how != "ref")


COLLECTIVE_REPS = 7


def collectives_alone(numel: int, world: int) -> dict[str, list[float]]:
    """Seconds of the collectives a step needs at least, on one flat f32 buffer of every
    parameter (``numel`` elements, padded to a multiple of ``world``), through the runtime's own
    ``collective`` (gloo's reduce_scatter as an all_to_all and a local sum, as the step runs it):
    DDP's one all_reduce, against ZeRO's reduce_scatter and all_gather. Interleaved, a barrier
    before each. Every result and workspace is allocated (and touched) once, before the timed
    runs, as the step keeps its bucket buffers: a fresh buffer of megabytes faults in every page
    on first touch, which would time the allocator, not the collective."""
    group, timeout = dist.group.WORLD, datetime.timedelta(seconds=600)
    padded = -(-numel // world) * world
    grads = torch.randn(padded, generator=torch.Generator().manual_seed(dist.get_rank()))
    shard = grads[: padded // world].clone()
    outs = {"all_reduce": None, "reduce_scatter": torch.zeros(padded // world), "all_gather": torch.zeros(padded)}
    workspace = torch.zeros(padded)
    times: dict[str, list[float]] = {op: [] for op in outs}
    for _ in range(COLLECTIVE_REPS):
        for op, out in outs.items():
            send = shard if op == "all_gather" else grads.clone()
            dist.barrier()
            started = time.perf_counter()
            reduce_op = None if op == "all_gather" else "sum"
            collective(op, send, world, reduce_op, group, timeout, out=out, workspace=workspace)
            times[op].append(time.perf_counter() - started)
    return times


def interleaved(variants: list[Variant], steps: int) -> dict[str, dict[str, int]]:
    """Step every variant ``steps`` times, interleaved; profile steps 2 and 3."""
    prof = None
    for step in range(1, steps + 1):
        if step == PROFILED[0]:
            prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            prof.__enter__()
        for variant in variants:
            if variant.prepare is not None:
                variant.prepare(step)
            dist.barrier()
            with record_function(f"bench|{variant.key}|train"):
                started, cpu = time.perf_counter(), time.process_time()
                if variant.run is not None:
                    variant.losses.append(variant.run(step))
                else:
                    variant.timed_step(step)
                variant.seconds.append(time.perf_counter() - started)
                variant.cpu_seconds.append(time.process_time() - cpu)
        if step == PROFILED[-1]:
            assert prof is not None
            for variant in variants:  # no gloo work in flight across the profiler's stop (runtime/comm/collectives.py)
                if variant.sharded:
                    variant.optimizer.wait_params()
            prof.__exit__(None, None, None)
    assert prof is not None
    return profile_counts(prof, [v.key for v in variants])


def reference_difference(variant: Variant, reference: Variant) -> float:
    """Largest |ours - reference| over all parameters, relative to the reference's largest |p|."""
    ours, ref = list(variant.model.parameters()), list(reference.model.parameters())
    scale = max(p.detach().abs().max().item() for p in ref)
    return max((a.detach() - b.detach()).abs().max().item() for a, b in zip(ours, ref, strict=True)) / scale


def results_of(variants: list[Variant], counts: dict[str, dict[str, int]]) -> dict[str, dict[str, Any]]:
    return {
        v.key: {
            "seconds": v.seconds,
            "step_seconds": v.step_seconds,
            "cpu_seconds": v.cpu_seconds,
            "wait_seconds": v.wait_seconds,
            "losses": v.losses,
            "recorded": v.recorded,
            "memory": v.memory(),
            **counts[v.key],
        }
        for v in variants
    }


def rank_main(
    rank: int, world: int, models: list[str], steps: dict[str, int], keys: list[str], options: tuple[int | None, bool]
) -> dict[str, Any]:
    """Every section for every model, on this rank (``options``: the overlap bucket bytes, and
    whether to run only the replica checks' section)."""
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    overlap_bucket_bytes, replicas = options
    for name in models:
        base = build_model(name)
        if replicas:
            out[name] = replica_section(base, world, steps[name])
            continue
        started = time.perf_counter()
        variants = [train_variant(key, base, rank, world, mesh, overlap_bucket_bytes) for key in keys]
        train = results_of(variants, interleaved(variants, steps[name]))
        del variants
        middle = time.perf_counter()
        alone = [step_alone_variant(key, base, rank, world) for key in STEP_ALONE]
        step_alone = results_of(alone, interleaved(alone, steps[name]))
        wall = {"train": middle - started, "step_alone": time.perf_counter() - middle}
        numel = sum(p.numel() for p in base.parameters())
        by_key = {v.key: v for v in alone}
        for v in alone:
            step_alone[v.key]["param_difference"] = reference_difference(v, by_key[v.key.split("-")[0] + "-ref"])
        out[name] = {
            "train": train,
            "step_alone": step_alone,
            "collectives": collectives_alone(numel, world),
            "wall_seconds": wall,
        }
        del alone
    return out


def median_ms(values: list[float]) -> float:
    return statistics.median(values[FIRST_TIMED - 1 :]) * 1e3


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:.2f}"


def report_model(name: str, steps: int, ranks: list[dict[str, Any]], keys: list[str]) -> dict[str, Any]:
    """Print one model's per-step losses and times, and its tables; the numbers for JSON."""
    base = build_model(name)
    tensors = len(list(base.parameters()))
    numel = sum(p.numel() for p in base.parameters())
    wall = ranks[0][name]["wall_seconds"]
    print(f"\n## {name}: {tensors} tensors, {numel:,} f32 parameters ({numel * 4 / MiB:.1f} MiB), {steps} steps")
    print(
        f"(rank 0 wall time: training section {wall['train']:.0f} s, step-alone section {wall['step_alone']:.0f} s)\n"
    )
    train = [r[name]["train"] for r in ranks]
    first = train[0]
    print("step  " + "  ".join(f"{k + ' loss':>18} {'ms':>7}" for k in keys))
    for i in range(steps):
        cells = []
        for k in keys:
            loss = first[k]["losses"][i]
            cells.append(f"{loss:>18.6f} {first[k]['seconds'][i] * 1e3:>7.1f}")
        mark = "" if i + 1 >= FIRST_TIMED else "  (untimed)"
        print(f"{i + 1:>4}  " + "  ".join(cells) + mark)
    mismatches = []
    for k in keys[1:]:
        for i, (a, b) in enumerate(zip(first[k]["losses"], first[keys[0]]["losses"], strict=True)):
            if abs(a - b) > LOSS_RTOL * abs(b):
                mismatches.append(f"MISMATCH: {k} step {i + 1}: loss {a:.6f}, {keys[0]} {b:.6f}")
    for line in mismatches:
        print(line)
    if not mismatches:
        print(f"losses agree within {LOSS_RTOL:g} relative at every step ({len(keys)} variants)")
    ddp_ms = median_ms(first["ddp"]["seconds"]) if "ddp" in first else None
    rows = {}
    print(
        f"\n**{name}** ({tensors} tensors, {numel / 1e6:.2f}M parameters, {len(ranks)} gloo ranks; median of steps "
        f"{FIRST_TIMED}..{steps} on rank 0; memory per rank, the largest over ranks):\n"
    )
    print(
        "| variant | train step ms | x DDP | CPU ms, all ranks | step() ms | of it waiting ms | collectives in step() "
        "| collectives per train step "
        "| params+grads MiB | optimizer state MiB | bucket / step buffers MiB | held MiB "
        "| peak above start: train step / step() MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k in keys:
        ms, step_ms = median_ms(first[k]["seconds"]), median_ms(first[k]["step_seconds"])
        cpu_ms = sum(median_ms(r[k]["cpu_seconds"]) for r in train)
        memory = {part: max((r[k]["memory"][part] or 0) for r in train) for part in ("params", "grads", "state")}
        bucket_values = [r[k]["memory"]["buckets"] for r in train]
        buckets = None if all(b is None for b in bucket_values) else max(b or 0 for b in bucket_values)
        held = sum(memory.values()) + (buckets or 0)
        peak_train, peak_step = max(r[k]["peak_train"] for r in train), max(r[k]["peak_step"] for r in train)
        colls = str(first[k]["collectives_step"])
        if first[k]["recorded"]:
            colls += f" (recorded {first[k]['recorded']['collectives']})"
        ratio = "-" if ddp_ms is None else f"{ms / ddp_ms:.2f}"
        waits = first[k]["wait_seconds"][FIRST_TIMED - 1 :]
        wait_ms = statistics.median(waits) * 1e3 if waits else None
        print(
            f"| {VARIANTS[k]} | {ms:.1f} | {ratio} | {cpu_ms:.1f} | {step_ms:.1f} "
            f"| {'-' if wait_ms is None else f'{wait_ms:.1f}'} "
            f"| {colls} | {first[k]['collectives_train']} "
            f"| {mib(memory['params'] + memory['grads'])} | {mib(memory['state'])} | {mib(buckets)} | {mib(held)} "
            f"| {mib(peak_train)} / {mib(peak_step)} |"
        )
        rows[k] = {
            "median_ms": ms,
            "step_median_ms": step_ms,
            "cpu_median_ms_all_ranks": cpu_ms,
            "wait_median_ms": wait_ms,
            "ratio_to_ddp": None if ddp_ms is None else ms / ddp_ms,
            "collectives_step": first[k]["collectives_step"],
            "collectives_train": first[k]["collectives_train"],
            "recorded": first[k]["recorded"],
            "memory_max_over_ranks": memory | {"buckets": buckets, "held": held},
            "peak_train_bytes": peak_train,
            "peak_step_bytes": peak_step,
            "seconds_rank0": first[k]["seconds"],
            "step_seconds_rank0": first[k]["step_seconds"],
            "losses_rank0": first[k]["losses"],
        }
    alone = [r[name]["step_alone"] for r in ranks]
    print(f"\n**{name}, optimizer.step() alone** (random gradients, median of steps {FIRST_TIMED}..{steps}, rank 0):\n")
    print("| optimizer step | ms | x reference | collectives in step() | state MiB/rank | max rel. param diff |")
    print("|---|---|---|---|---|---|")
    alone_rows = {}
    for k in STEP_ALONE:
        ms = median_ms(alone[0][k]["step_seconds"])
        ref = median_ms(alone[0][k.split("-")[0] + "-ref"]["step_seconds"])
        state = max(r[k]["memory"]["state"] for r in alone)
        difference = max(r[k]["param_difference"] for r in alone)
        print(
            f"| {STEP_ALONE[k]} | {ms:.1f} | {ms / ref:.2f} | {alone[0][k]['collectives_step']} | {mib(state)} "
            f"| {difference:.1e} |"
        )
        alone_rows[k] = {
            "median_ms": ms,
            "ratio_to_reference": ms / ref,
            "collectives_step": alone[0][k]["collectives_step"],
            "recorded": alone[0][k]["recorded"],
            "state_bytes_max_over_ranks": state,
            "param_difference": difference,
            "step_seconds_rank0": alone[0][k]["step_seconds"],
        }
    seconds = ranks[0][name]["collectives"]
    collective_ms = {op: median_ms(times) for op, times in seconds.items()}
    zero_ms = collective_ms["reduce_scatter"] + collective_ms["all_gather"]
    print(
        f"\n**{name}, the collectives alone** (one flat f32 buffer of all {numel:,} parameters through "
        f"runtime.comm.collectives.collective, median of {COLLECTIVE_REPS}, rank 0): DDP's all_reduce "
        f"{collective_ms['all_reduce']:.1f} ms; ZeRO's reduce_scatter {collective_ms['reduce_scatter']:.1f} ms + "
        f"all_gather {collective_ms['all_gather']:.1f} ms = {zero_ms:.1f} ms "
        f"({zero_ms / collective_ms['all_reduce']:.2f}x the all_reduce)"
    )
    return {
        "collectives_ms": collective_ms,
        "tensors": tensors,
        "parameters": numel,
        "steps": steps,
        "wall_seconds_rank0": wall,
        "losses_agree": not mismatches,
        "mismatches": mismatches,
        "train": rows,
        "step_alone": alone_rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small,medium", help="comma-separated: " + ",".join(MODELS))
    parser.add_argument("--steps", type=int, default=None, help=f"steps per model (default {DEFAULT_STEPS})")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the default")
    parser.add_argument("--replicas", action="store_true", help="only the replica checks' cost (replica_cost.py)")
    bench_results.add_json_option(parser)
    parser.add_argument(
        "--overlap-bucket-kib",
        type=int,
        default=None,
        help="bucket_bytes of sharded-overlap (default: the optimizer's)",
    )
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    keys = [k for k in args.variants.split(",") if k]
    unknown = [m for m in models if m not in MODELS] + [k for k in keys if k not in VARIANTS]
    if unknown or not models or not keys:
        parser.error(f"unknown or missing models/variants: {unknown}")
    if args.steps is not None and args.steps < FIRST_TIMED:
        parser.error(f"--steps must be at least {FIRST_TIMED} (steps {PROFILED} are profiled, never timed)")
    steps = {m: args.steps or DEFAULT_STEPS[m] for m in models}
    # Quiet the profiler in every rank: kineto's start/stop lines (level 5), and the allocator's
    # warning that blocks allocated before profiling have no deallocation events (expected here).
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    started = time.perf_counter()
    options = (None if args.overlap_bucket_kib is None else args.overlap_bucket_kib * 1024, args.replicas)
    ranks = run_ranks(rank_main, args.ranks, (models, steps, keys, options), timeout=3600, collective_timeout=900)
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}; {time.perf_counter() - started:.0f} s")
    report = {"command": sys.argv, "ranks": args.ranks, "variants": ["replicas"] if args.replicas else keys}
    with bench_results.printed() as shown:
        if args.replicas:
            report["models"] = {m: report_replicas(m, steps[m], ranks[0][m]) for m in models}
        else:
            report["models"] = {m: report_model(m, steps[m], ranks, keys) for m in models}
    # The tables as printed, with the command, commit, date and machine (bench/results.py).
    title = "Replica checks' cost" if args.replicas else "Training step"
    bench_results.write(args.json, title, bench_results.markdown_tables(shown.getvalue()), data=report)


if __name__ == "__main__":
    main()
