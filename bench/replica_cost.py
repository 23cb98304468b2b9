"""What the replica checks cost (``verify_replicas``), a section of ``bench_step.py``.

A ZeRO-1 spec as a DDP-wrapped model uses it (params ``R,R``/``R``, gradients ``R,R``/``R``
declared replicated: DDP reduced them, states ``S(dp),R``/``S(dp)``), so that both checks run:
the parameters' when the optimizer is built, the gradients' inside ``step()``. Three
``ShardedAdamW`` on the same processes, interleaved step by step with a barrier before each:
``verify_replicas=False`` (no check), ``True`` (the default: the parameters at construction, the
gradients at the first step) and ``1`` (the gradients at every step). The gradients are random,
the same on every rank (as DDP leaves them), seeded per step. Measured on rank 0, after one
untimed build and step that make the process groups: building a fresh optimizer and its first
``step()`` (which also compiles the plan), median of :data:`BUILDS` interleaved, and the median
``step()`` of steps 4..N of one optimizer per mode, with the ratio to the run without the check.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from bench_model import ADAMW
from torch import nn

from runtime.optim import ShardedAdamW
from shardlang import parse_layout
from shardlang.spec import Layouts

MODES: dict[str, bool | int] = {"False": False, "True": True, "1": 1}
WHAT = {
    "False": "verify_replicas=False (no check)",
    "True": "verify_replicas=True (default: parameters at construction, gradients at step 1)",
    "1": "verify_replicas=1 (gradients at every step)",
}
BUILDS = 9
FIRST_TIMED = 4


def zero1_spec(model: nn.Module, world: int) -> dict[str, Layouts]:
    """Replicated parameters and gradients (reduced by DDP), states split over dp."""
    mesh = f"mesh[dp={world}]"
    spec = {}
    for name, p in model.named_parameters():
        dims, state = ("R,R", "S(dp),R") if p.dim() == 2 else ("R", "S(dp)")
        layout = parse_layout(f"{dims} over {mesh}")
        spec[name] = Layouts(param=layout, grad=layout, states=(("", parse_layout(f"{state} over {mesh}")),))
    return spec


def replica_section(base: nn.Module, world: int, steps: int) -> dict[str, dict[str, list[float]]]:
    """This rank's seconds per mode: ``build`` and ``first`` (a fresh optimizer built and its
    first ``step()``, :data:`BUILDS` times), ``step`` (each step of one optimizer)."""
    spec = zero1_spec(base, world)
    out: dict[str, dict[str, list[float]]] = {mode: {"build": [], "first": [], "step": []} for mode in MODES}

    def fresh(value: bool | int) -> tuple[list[tuple[str, nn.Parameter]], ShardedAdamW, float]:
        named = [(n, nn.Parameter(p.detach().clone())) for n, p in base.named_parameters()]
        dist.barrier()
        started = time.perf_counter()
        optimizer = ShardedAdamW(named, spec, **ADAMW, verify_replicas=value)
        return named, optimizer, time.perf_counter() - started

    def timed_step(named: list[tuple[str, nn.Parameter]], optimizer: ShardedAdamW, step: int) -> float:
        generator = torch.Generator().manual_seed(7000 + step)  # alike on every rank
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=generator)
        dist.barrier()
        started = time.perf_counter()
        optimizer.step()
        return time.perf_counter() - started

    named, optimizer, _ = fresh(1)  # untimed: the process groups every mode uses, made once
    timed_step(named, optimizer, 0)
    for _ in range(BUILDS):
        for mode, value in MODES.items():
            named, optimizer, seconds = fresh(value)
            out[mode]["build"].append(seconds)
            out[mode]["first"].append(timed_step(named, optimizer, 1))
    runs = {mode: fresh(value)[:2] for mode, value in MODES.items()}
    for step in range(1, steps + 1):
        for mode, (named, optimizer) in runs.items():
            out[mode]["step"].append(timed_step(named, optimizer, step))
    return out


def report_replicas(name: str, steps: int, seconds: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Print rank 0's table for one model; the numbers for JSON."""
    print(
        f"\n**{name}, the replica checks' cost** (ShardedAdamW, ZeRO-1 spec: gradients declared replicated; "
        f"rank 0; build and first step(): median of {BUILDS}; step(): median of steps {FIRST_TIMED}..{steps}):\n"
    )
    print("| verify_replicas | build ms | x off | first step() ms | x off | step() ms | x off |")
    print("|---|---|---|---|---|---|---|")

    def ms(values: list[float]) -> float:
        return statistics.median(values) * 1e3

    off = seconds["False"]
    base = (ms(off["build"]), ms(off["first"]), ms(off["step"][FIRST_TIMED - 1 :]))
    rows = {}
    for mode in MODES:
        got = seconds[mode]
        build, first, step = ms(got["build"]), ms(got["first"]), ms(got["step"][FIRST_TIMED - 1 :])
        print(
            f"| {WHAT[mode]} | {build:.1f} | {build / base[0]:.2f} | {first:.1f} | {first / base[1]:.2f} "
            f"| {step:.1f} | {step / base[2]:.2f} |"
        )
        rows[mode] = {
            "build_median_ms": build,
            "first_step_ms": first,
            "step_median_ms": step,
            "ratios_to_off": [build / base[0], first / base[1], step / base[2]],
            "build_seconds_rank0": got["build"],
            "first_step_seconds_rank0": got["first"],
            "step_seconds_rank0": got["step"],
        }
    return rows
