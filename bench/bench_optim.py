"""Sharded AdamW and CAME on 4 gloo ranks against the single-process optimizers.

    .venv/bin/python bench/bench_optim.py                  # the GPT-like model below, 20 timed steps
    .venv/bin/python bench/bench_optim.py --steps 30 --scale 2

The same model (a GPT-like set of tensors, f32) is stepped by:

* ``torch.optim.AdamW(foreach=True)`` and ``came_pytorch.CAME`` in one process, one thread;
* ``ShardedAdamW`` / ``ShardedCAME`` on 4 ranks (one thread each), data parallel: every rank
  holds the whole model and a gradient that is a pending mean over dp (``P(dp):avg``), with
  the states (a) replicated, as DDP does (one all-reduce per gradient, the full step
  everywhere), (b) split by rows over dp (ZeRO: reduce-scatter in, all-gather out),
  (c) split as flat chunks over dp (``flat_axis="dp"``).

Step time is the median over steps of rank 0's ``optimizer.step()`` (ranks aligned by a
barrier before each, all ways interleaved step by step so that noise hits all alike), the
machine being shared by the 4 ranks; "comm ms" is the part spent in collectives. Memory is
the optimizer state each rank holds, against what the single-process optimizer holds. Bytes
are what rank 0 sent in a step as measured by the runtime (``runtime.recording``: reshard
collectives and statistics all-reduces) next to the optimizer's prediction from the plans;
rank 0 is at coordinate 0 of every group, so the two must be equal. The hand-written peers
(DDP, ZeRO-2 with flat padded chunks, both with ``torch.optim.AdamW(foreach=True)``) run the
same collectives a user would write directly.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import came_pytorch
import results as bench_results
import torch
import torch.distributed as dist

import runtime
from runtime.comm.collectives import all_gather_single, reduce_scatter_single
from runtime.optim import ShardedAdamW, ShardedCAME
from runtime.testing import run_ranks
from shardlang import parse_layout, parse_spec
from shardlang.spec import Layouts

HYPER = {"adamw": {"lr": 1e-3, "weight_decay": 0.01}, "came": {"lr": 1e-3, "weight_decay": 0.01}}
STATES = {"replicated": ("R,R", "R", None), "zero rows": ("S(dp),R", "S(dp)", None), "flat": ("R,R", "R", "dp")}


def block_shapes(width: int, prefix: str, norms: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """4 GPT-like blocks ``{prefix}{i}``, each its attention and MLP weights and biases, then its
    norms' weights (bench_muon.py's model is these alone)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(4):
        for name, shape in (
            ("attn.c_attn", (3 * width, width)),
            ("attn.c_proj", (width, width)),
            ("mlp.c_fc", (4 * width, width)),
            ("mlp.c_proj", (width, 4 * width)),
        ):
            shapes[f"{prefix}{i}.{name}.weight"] = shape
            shapes[f"{prefix}{i}.{name}.bias"] = shape[:1]
        shapes |= {f"{prefix}{i}.{norm}.weight": (width,) for norm in norms}
    return shapes


def model_shapes(scale: int) -> dict[str, tuple[int, ...]]:
    """A GPT-like model: embedding, blocks of attention and MLP weights, biases, norms."""
    width, vocab = 256 * scale, 8003 * scale
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (vocab, width), "wpe.weight": (1025, width)}
    return shapes | block_shapes(width, "h.", ("ln_1", "ln_2"))


def spec_text(states: str) -> str:
    matrix, vector, _ = STATES[states]
    return f"""
    mesh world = [dp=4]
    rule "*.{{bias}}" {{ param = R over world  grad = R | P(dp):avg over world  state = {vector} over world }}
    rule "h.*.ln_*.weight" {{ param = R over world  grad = R | P(dp):avg over world  state = {vector} over world }}
    rule "*.weight" {{ param = R,R over world  grad = R,R | P(dp):avg over world  state = {matrix} over world }}
    """


def grads_for(shapes: dict[str, tuple[int, ...]], step: int, rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 10 + rank)
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


def single_process(kind: str, shapes: dict[str, tuple[int, ...]], steps: int) -> dict[str, tuple[float, int]]:
    """Median step seconds and state bytes of the single-process optimizer, and of ours on a
    one-rank mesh (no communication: the cost of the out-of-place math), interleaved."""
    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes.values()]
    ours = {n: torch.nn.Parameter(torch.randn(s)) for n, s in shapes.items()}
    layouts = {n: parse_layout(f"{','.join('R' for _ in s)} over mesh[1]") for n, s in shapes.items()}
    spec = {n: Layouts(param=layout, grad=layout, states=(("", layout),)) for n, layout in layouts.items()}
    if kind == "adamw":
        optimizers = {"ref": torch.optim.AdamW(params, foreach=True, **HYPER[kind])}
        optimizers["ours"] = ShardedAdamW(list(ours.items()), spec, **HYPER[kind])
    else:
        optimizers = {"ref": came_pytorch.CAME(params, **HYPER[kind])}
        optimizers["ours"] = ShardedCAME(list(ours.items()), spec, **HYPER[kind])
    times: dict[str, list[float]] = {"ref": [], "ours": []}
    for step in range(steps + 2):
        for p, q, g in zip(params, ours.values(), grads_for(shapes, step, 0).values(), strict=True):
            p.grad, q.grad = g, g.clone()
        for key, optimizer in optimizers.items():
            started = time.perf_counter()
            optimizer.step()
            if step >= 2:
                times[key].append(time.perf_counter() - started)
    state = sum(
        t.numel() * t.element_size()
        for s in optimizers["ref"].state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    return {
        "ref": (statistics.median(times["ref"]), state),
        "ours": (statistics.median(times["ours"]), optimizers["ours"].state_bytes()),
    }


def hand_written(rank: int, world: int, shapes: dict[str, tuple[int, ...]], zero: bool):
    """The peers a user would write with torch.distributed and torch.optim.AdamW(foreach=True):
    DDP (all-reduce every gradient, step the whole model) or ZeRO-2 (per tensor, reduce-scatter
    the flattened gradient padded to equal chunks, step fp32 chunks, all-gather them back).
    Returns the step as a function of the gradients."""
    params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(1))) for s in shapes.values()]
    chunks = [-(-p.numel() // world) for p in params]
    if not zero:
        optimizer = torch.optim.AdamW(params, foreach=True, **HYPER["adamw"])

        def ddp(grads: list[torch.Tensor]) -> None:
            for p, g in zip(params, grads, strict=True):
                dist.all_reduce(g)
                p.grad = g / world
            optimizer.step()

        return ddp
    shards = [torch.nn.Parameter(torch.zeros(c)) for c in chunks]
    for p, shard, c in zip(params, shards, chunks, strict=True):
        shard.data[: max(0, min(c, p.numel() - rank * c))] = p.detach().flatten()[rank * c : (rank + 1) * c]
    optimizer = torch.optim.AdamW(shards, foreach=True, **HYPER["adamw"])

    def zero2(grads: list[torch.Tensor]) -> None:
        for g, shard, c in zip(grads, shards, chunks, strict=True):
            padded = torch.zeros(c * world)
            padded[: g.numel()] = g.flatten()
            shard.grad = torch.empty(c)
            reduce_scatter_single(shard.grad, padded)
            shard.grad /= world
        optimizer.step()
        for p, shard, c in zip(params, shards, chunks, strict=True):
            gathered = torch.empty(c * world)
            all_gather_single(gathered, shard.detach())
            p.data.copy_(gathered[: p.numel()].view_as(p))

    return zero2


def sharded(rank: int, world: int, shapes: dict[str, tuple[int, ...]], steps: int) -> bytes:
    """Every way on this rank, interleaved step by step so that machine noise hits all alike."""
    peers = {("hand", "ddp"): hand_written(rank, world, shapes, zero=False)}
    peers[("hand", "zero2")] = hand_written(rank, world, shapes, zero=True)
    optimizers, params = {}, {}
    for kind in ("adamw", "came"):
        for states in STATES:
            params[(kind, states)] = {
                n: torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(1)))
                for n, s in shapes.items()
            }
            make = ShardedAdamW if kind == "adamw" else ShardedCAME
            spec = parse_spec(spec_text(states))
            named = list(params[(kind, states)].items())
            optimizers[(kind, states)] = make(named, spec, flat_axis=STATES[states][2], **HYPER[kind])
    results: dict[tuple[str, str], dict] = {
        key: {"times": [], "comm": [], "traffic": []} for key in [*peers, *optimizers]
    }
    for step in range(steps + 2):
        for key, run in peers.items():
            grads = list(grads_for(shapes, step, rank).values())
            dist.barrier()
            started = time.perf_counter()
            run(grads)
            if step >= 2:
                results[key]["times"].append(time.perf_counter() - started)
        for key, optimizer in optimizers.items():
            for name, grad in grads_for(shapes, step, rank).items():
                params[key][name].grad = grad
            planned = optimizer.planned_traffic()
            dist.barrier()
            with runtime.recording() as log:
                started = time.perf_counter()
                optimizer.step()
                elapsed = time.perf_counter() - started
            if step >= 2:
                results[key]["times"].append(elapsed)
                results[key]["comm"].append(log.seconds)
                traffic = (log.total_bytes, planned.bytes, len(log.records), optimizer.last_traffic.sum_collectives)
                results[key]["traffic"].append(traffic)
    out = {}
    for key, r in results.items():
        out[key] = {"seconds": statistics.median(r["times"]), "traffic": r["traffic"]}
        if key in optimizers:
            out[key] |= {"comm_seconds": statistics.median(r["comm"]), "state_bytes": optimizers[key].state_bytes()}
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--scale", type=int, default=1, help="multiplies the model's width and vocabulary")
    args = parser.parse_args()
    shapes = model_shapes(args.scale)
    numel = sum(torch.Size(s).numel() for s in shapes.values())
    print(f"model: {len(shapes)} tensors, {numel:,} f32 parameters ({numel * 4 / 2**20:.1f} MiB)")
    reference = {kind: single_process(kind, shapes, args.steps) for kind in ("adamw", "came")}
    ranks = [
        torch.load(io.BytesIO(r), weights_only=False) for r in run_ranks(sharded, 4, (shapes, args.steps), timeout=1800)
    ]
    print()
    print(
        f"{len(shapes)} tensors, {numel:,} f32 parameters; median step of {args.steps}; 4 ranks: rank 0's step "
        "and the largest state over ranks"
    )
    print("| optimizer | step ms | comm ms | state MiB/rank | x 1-proc | sent B/step | planned | colls | sums |")
    print("|" + "---|" * 9)
    for kind, label in (("adamw", "torch.optim.AdamW(foreach=True)"), ("came", "came_pytorch.CAME")):
        ref_seconds, ref_bytes = reference[kind]["ref"]
        _row(f"{label}, 1 process", f"{ref_seconds * 1e3:.2f}", "", f"{ref_bytes / 2**20:.2f}", "1.00")
        seconds, state = reference[kind]["ours"]
        name = f"Sharded{'AdamW' if kind == 'adamw' else 'CAME'}, 1 process (mesh[1])"
        _row(name, f"{seconds * 1e3:.2f}", "", f"{state / 2**20:.2f}", f"{state / ref_bytes:.2f}")
        if kind == "adamw":
            for peer, name in (("ddp", "hand-written DDP + AdamW, 4 ranks"), ("zero2", "hand-written ZeRO-2, 4 ranks")):
                _row(name, f"{ranks[0][('hand', peer)]['seconds'] * 1e3:.2f}")
        for states in STATES:
            cases = [r[(kind, states)] for r in ranks]
            state = max(c["state_bytes"] for c in cases)
            sent, planned, collectives, sums = cases[0]["traffic"][-1]
            agree = all(s == p for s, p, _, _ in cases[0]["traffic"])
            name = f"Sharded{'AdamW' if kind == 'adamw' else 'CAME'}, 4 ranks, {states}"
            _row(
                name,
                f"{cases[0]['seconds'] * 1e3:.2f}",
                f"{cases[0]['comm_seconds'] * 1e3:.2f}",
                f"{state / 2**20:.2f}",
                f"{state / ref_bytes:.2f}",
                f"{sent:,}",
                f"{planned:,}" + ("" if agree else " (MEASURED != PLANNED)"),
                str(collectives),
                str(sums),
            )


def _row(*cells: str) -> None:
    """A row of the markdown table ``main`` prints; cells left out are empty."""
    print("| " + " | ".join([*cells, *[""] * (9 - len(cells))]) + " |")


if __name__ == "__main__":
    # --json PATH: also write what it prints, with command, commit, date and machine (bench/results.py).
    bench_results.main(main, "Optimizer step")
