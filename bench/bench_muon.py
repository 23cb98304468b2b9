"""ShardedMuon on 4 gloo ranks, owners against gathers, and torch.optim.Muon in one process.

    .venv/bin/python bench/bench_muon.py                  # the model below, 10 timed steps
    .venv/bin/python bench/bench_muon.py --steps 20 --width 512
    .venv/bin/python bench/bench_muon.py --bucket-bytes 1 # every move its own collective or exchange

The model: 4 blocks of GPT-like matrices (``[3w, w]``, ``[w, w]``, ``[4w, w]``, ``[w, 4w]``) and
their biases and norms, f32. One process steps it with ``torch.optim.Muon`` (the matrices) and
``torch.optim.AdamW`` (the rest), one thread. On 4 ranks (one thread each) every rank holds the
whole model and a gradient pending a mean over dp, with the states split by rows over dp
(ZeRO), as flat chunks over dp, or by columns over tp (TP; there the parameters and gradients
are column pieces too), each with every matrix gathered, with every matrix owned, and placed by the cost model
(``auto``, at the default stated rate of ``planner.owners``).

Step time is the median over steps of rank 0's ``optimizer.step()`` (ranks aligned by a
barrier before each, all ways interleaved step by step). Memory is the optimizer state each
rank holds, and the whole matrices the busiest rank assembles in a step, one after another
(gathers: every matrix; owners: those it owns). Newton-Schulz Gflop is the most any
rank runs per step (``planner.owners``). Bytes are what rank 0 sent in a step as the runtime
measured it (``runtime.recording``) and what the optimizer's plans predict for the busiest
rank, split into the reshards, the matrices' moves and the commit flag; "moves" counts the
collectives and exchanges of the matrices' moves (one per bucket of the step plan's matrix
part, ``planner.matrices``), and "modeled" is that part's estimate (bucketed moves plus the
busiest rank's iterations at the stated rate).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import results as bench_results
import torch
import torch.distributed as dist
from bench_optim import block_shapes

import runtime
from planner.owners import newton_schulz_flops
from runtime.optim import ShardedMuon
from runtime.testing import run_ranks
from shardlang import parse_layout
from shardlang.layout import Layout
from shardlang.spec import Layouts, TensorSpec

MUON = {"lr": 2e-2, "weight_decay": 0.1}
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}
# name: (mesh, param and grad of a 2-d tensor, its state, the same for 1-d, flat axis)
LAYOUTS = {
    "ZeRO rows": ("mesh[dp=4]", "R,R", "R,R | P(dp):avg", "S(dp),R", "R", "R | P(dp):avg", "S(dp)", None),
    "flat": ("mesh[dp=4]", "R,R", "R,R | P(dp):avg", "R,R", "R", "R | P(dp):avg", "R", "dp"),
    "TP columns": ("mesh[tp=4]", "R,S(tp)", "R,S(tp)", "R,S(tp)", "S(tp)", "S(tp)", "S(tp)", None),
}
PLACEMENTS = ("gather", "owner", "auto")


def model_shapes(width: int) -> dict[str, tuple[int, ...]]:
    """The model of the docstring: bench_optim.py's blocks, one norm each, no embeddings."""
    return block_shapes(width, "h", ("ln",))


def grads_for(shapes: dict[str, tuple[int, ...]], step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


def single_process(shapes: dict[str, tuple[int, ...]], steps: int) -> tuple[float, int]:
    torch.set_num_threads(1)
    params = {n: torch.nn.Parameter(torch.randn(s)) for n, s in shapes.items()}
    optimizers = [
        torch.optim.Muon([p for p in params.values() if p.ndim == 2], **MUON),
        torch.optim.AdamW([p for p in params.values() if p.ndim != 2], foreach=True, **ADAMW),
    ]
    times = []
    for step in range(steps + 2):
        for n, g in grads_for(shapes, step).items():
            params[n].grad = g
        started = time.perf_counter()
        for optimizer in optimizers:
            optimizer.step()
        times.append(time.perf_counter() - started)
    state = sum(t.numel() * t.element_size() for o in optimizers for s in o.state.values() for t in s.values())
    return statistics.median(times[2:]) * 1e3, state


def _spec(layout: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, TensorSpec]:
    mesh, p2, g2, s2, p1, g1, s1, _ = LAYOUTS[layout]
    out = {}
    for name, shape in shapes.items():
        param, grad, state = (p2, g2, s2) if len(shape) == 2 else (p1, g1, s1)
        lay = {k: parse_layout(f"{t} over {mesh}") for k, t in (("p", param), ("g", grad), ("s", state))}
        layouts = Layouts(param=lay["p"], grad=lay["g"], states=(("", lay["s"]),))
        out[name] = TensorSpec(name=name, dtype="f32", shape=shape, layouts=layouts)
    return out


def _piece(full: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """The rank's block of ``full`` in ``layout``; under a pending mean over dp every rank
    holds the same gradient, whose mean it is."""
    return runtime.shard(full, Layout(dims=layout.dims, mesh=layout.mesh), rank)


def sharded(rank: int, world: int, shapes: dict[str, tuple[int, ...]], steps: int, bucket_bytes: int | None) -> bytes:
    runs = {}
    for layout in LAYOUTS:
        spec = _spec(layout, shapes)
        for placement in PLACEMENTS:
            gen = torch.Generator().manual_seed(0)
            params = {
                n: torch.nn.Parameter(_piece(torch.randn(s, generator=gen), spec[n].param, rank).clone())
                for n, s in shapes.items()
            }
            flat_axis = LAYOUTS[layout][-1]
            adamw = {f"adamw_{k}": v for k, v in ADAMW.items()}
            optimizer = ShardedMuon(
                list(params.items()),
                spec,
                placement=placement,
                flat_axis=flat_axis,
                bucket_bytes=bucket_bytes,
                **MUON,
                **adamw,
            )
            runs[(layout, placement)] = (spec, params, optimizer, [], [])
    for step in range(steps + 2):
        grads = grads_for(shapes, step)
        for spec, params, optimizer, times, sent in runs.values():
            for n, g in grads.items():
                params[n].grad = _piece(g, spec[n].grad, rank).clone()
            dist.barrier()
            with runtime.recording() as log:
                started = time.perf_counter()
                optimizer.step()
                times.append(time.perf_counter() - started)
            sent.append(log.total_bytes)
    out = {}
    for key, (_, _, optimizer, times, sent) in runs.items():
        plan = optimizer.step_plan().matrices
        flops: dict[int, int] = {}
        assembled = 0
        for name, shape in shapes.items():
            if len(shape) != 2:
                continue
            owner = plan.of(name).owner
            for r in range(world) if owner is None else (owner,):
                flops[r] = flops.get(r, 0) + newton_schulz_flops(shape, 5)
            if owner is None or owner == rank:
                assembled += shape[0] * shape[1] * 4
        owners = sorted({m.owner for m in plan.matrices}, key=str)
        out[key] = {
            "owners": owners,
            "ms": statistics.median(times[2:]) * 1e3,
            "state": optimizer.state_bytes(),
            "assembled": assembled,
            "gflop": max(flops.values()) / 1e9,
            "sent": statistics.median(sent[2:]),
            "traffic": optimizer.planned_traffic(),
            "modeled": plan.seconds,
        }
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def _chose(placement: str, owners: list[int | None]) -> str:
    """What ``auto`` chose, in words."""
    if placement != "auto":
        return ""
    return " (chose gathers)" if owners == [None] else f" (chose owners {owners})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--bucket-bytes", type=int, default=None, help="the optimizers' bucket_bytes")
    args = parser.parse_args()
    shapes = model_shapes(args.width)
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    matrices = sum(1 for s in shapes.values() if len(s) == 2)
    one, one_state = single_process(shapes, args.steps)
    results = run_ranks(sharded, 4, args=(shapes, args.steps, args.bucket_bytes), timeout=1200)
    rank0 = torch.load(io.BytesIO(results[0]), weights_only=False)
    per_rank = [torch.load(io.BytesIO(r), weights_only=False) for r in results]
    print(f"{numel / 1e6:.2f}M f32 parameters, {matrices} matrices, {args.steps} timed steps")
    print("| optimizer | step ms | state MiB/rank | whole matrices MiB/rank/step | NS Gflop/rank |", end="")
    print(" sent B/step (rank 0) | planned: reshards + matrices + flag | moves | modeled ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| torch Muon + AdamW, 1 process | {one:.1f} | {one_state / 2**20:.2f} | | | | | | |")
    for key, r in rank0.items():
        assembled = max(p[key]["assembled"] for p in per_rank)
        t = r["traffic"]
        print(
            f"| ShardedMuon, 4 ranks, {key[0]}, {key[1]}{_chose(key[1], r['owners'])} | {r['ms']:.1f} | "
            f"{r['state'] / 2**20:.2f} | "
            f"{assembled / 2**20:.2f} | {r['gflop']:.2f} | {int(r['sent']):,} | "
            f"{t.reshard_bytes:,} + {t.matrix_bytes:,} + {t.commit_bytes:,} | {t.matrix_collectives} | "
            f"{r['modeled'] * 1e3:.2f} |"
        )


if __name__ == "__main__":
    # --json PATH: also write what it prints, with command, commit, date and machine (bench/results.py).
    bench_results.main(main, "Muon step")
