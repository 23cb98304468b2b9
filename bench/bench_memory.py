"""Memory per rank, measured by the operating system: DDP, ZeRO, FSDP2 and the sharded optimizers.

    .venv/bin/python bench/bench_memory.py                         # every variant, 4 ranks
    .venv/bin/python bench/bench_memory.py --ranks 2,4,8 --variants ddp,sharded
    .venv/bin/python bench/bench_memory.py --json out/bench_memory.json

Every variant runs in fresh processes of its own (one per rank, started by this script, one
intra-op thread each, gloo), so that nothing one variant allocated stays in another's figures.
glibc's mmap threshold is fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``) so that tensors freed go
back to the system and leave the resident set, as a long job's would after the allocator's
dynamic threshold settles.

The model is ``bench_model.py``'s language model at width 512, 6 ``nn.TransformerEncoderLayer``
blocks of feed-forward 2048 (19.4M f32 parameters, 74 MiB), batch 4 x 64 tokens per rank; lr 1e-3,
weight decay 0.01 everywhere. Per rank and variant:

* **held**: ``VmRSS`` after the last training step minus ``VmRSS`` just before the model was
  built (torch imported, the process group made and one small layer's forward and backward run
  by then, so that code every variant loads is left out): parameters, gradients, optimizer
  states and whatever the optimizer or the wrapper keeps between steps;
* **step peak**: ``VmHWM`` over the last ``optimizer.step()`` (reset through
  ``/proc/self/clear_refs`` right before it) minus ``VmRSS`` right before it: what the step
  allocates above what it held;
* **predicted**: for the sharded optimizers, ``optimizer.memory_report()``'s total (our own
  accounting, beside the measurement; the goal is agreement within 10%; over FSDP2's parameters
  it counts the unsharded parameters FSDP2 keeps for its largest group).

The table gives the largest over ranks and the ratio to DDP + AdamW of the same world size.
Losses (rank 0's, the last step) must agree across variants within 1e-3 relative.

Variants: ``ddp`` (``DistributedDataParallel`` + ``torch.optim.AdamW(foreach=True)``), ``zero``
(DDP + ``ZeroRedundancyOptimizer(AdamW)``), ``fsdp2`` (``fully_shard`` per layer and the root +
AdamW), ``sharded`` (``ShardedAdamW``, the ZeRO-2 spec: params ``R,R``, gradients
``R,R | P(dp):avg``, states ``S(dp),R``, no wrapper), ``sharded-flat`` (the same with states
``R,R`` and ``flat_axis="dp"``; both free the gradients in ``step()`` once reduced, their
default), ``sharded-kept`` (ZeRO-2 with ``free_grads=False``: gradients kept),
``sharded-overlap`` (ZeRO-2 with ``overlap=True``: gradients freed during backward, the
default), ``sharded-overlap-kept`` (``overlap=True`` with ``free_grads=False``: gradients kept),
``sharded-overlap-prefetch`` (``sharded-overlap`` with
``prefetch_params`` per layer), ``sharded-fsdp2`` (``ShardedAdamW`` over FSDP2's parameters,
no spec), ``ddp-came`` (DDP + ``came_pytorch.CAME``), ``sharded-came`` and ``sharded-came-flat``,
``ddp-muon`` (DDP + ``torch.optim.Muon`` on the matrices and ``torch.optim.AdamW`` on the rest)
and ``sharded-muon`` (``ShardedMuon``, the ZeRO-2 spec: each matrix's update gathered whole for
its Newton-Schulz iteration, one bucket at a time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import bench_step  # noqa: E402  (bench/, found through the path above)
import results  # noqa: E402

VARIANTS = {key: bench_step.VARIANTS[key] for key in ("ddp", "zero", "fsdp2", "sharded", "sharded-flat")} | {
    "sharded-kept": "ShardedAdamW, ZeRO-2 spec, free_grads=False",
    "sharded-overlap": "ShardedAdamW, ZeRO-2 spec, overlap",
    "sharded-overlap-kept": "ShardedAdamW, ZeRO-2 spec, overlap, free_grads=False",
    "sharded-overlap-prefetch": "ShardedAdamW, ZeRO-2 spec, overlap + prefetch_params",
    "sharded-fsdp2": "ShardedAdamW over FSDP2's parameters",
    "ddp-came": "DDP + came_pytorch.CAME",
    "sharded-came": "ShardedCAME, ZeRO-2 spec",
    "sharded-came-flat": "ShardedCAME, flat ZeRO",
    "ddp-muon": "DDP + torch.optim.Muon (matrices) + AdamW",
    "sharded-muon": "ShardedMuon, ZeRO-2 spec",
}
# What each variant is compared with besides DDP + AdamW (the goals of docs/memory.md).
PEERS = {"sharded": "zero", "sharded-flat": "zero", "sharded-fsdp2": "fsdp2"}
PEERS |= {"sharded-came": "ddp-came", "sharded-came-flat": "ddp-came", "sharded-muon": "ddp-muon"}
# ShardedMuon's defaults, given to torch's Muon and AdamW alike (the AdamW part: bench_model's).
MUON = {"lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}
WIDTH, LAYERS, FEED_FORWARD = 512, 6, 2048
STEPS = 5
MMAP_THRESHOLD = 64 * 1024
LOSS_RTOL = bench_step.LOSS_RTOL
MiB = 2**20


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Make ``VmHWM`` the current ``VmRSS`` (Linux: ``clear_refs`` 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def _warm_up(torch: Any) -> None:
    """Load what every variant loads whatever its model (the modules ``torch.optim.Optimizer``
    imports, autograd's threads, the kernels of one small layer's forward and backward), so that
    the baseline leaves it out: the figures are the model's and its optimizer's."""
    import torch._dynamo

    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    layer(torch.randn(2, 8, 16)).sum().backward()


def worker(variant: str, rank: int, world: int, port: int, steps: int, bucket_bytes: int | None) -> dict[str, Any]:
    """One rank of one variant: train ``steps`` steps and measure (see the module doc)."""
    import came_pytorch
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from bench_model import ADAMW, CAME, VOCAB, LanguageModel, spec_for, tokens_for
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from runtime.optim import ShardedAdamW, ShardedCAME, ShardedMuon

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    _warm_up(torch)
    dist.barrier()
    before = _status("VmRSS")
    torch.manual_seed(0)
    model = LanguageModel(WIDTH, LAYERS, FEED_FORWARD)
    module: torch.nn.Module = model
    optimizer: Any
    if variant in ("ddp", "zero", "ddp-came", "ddp-muon"):
        module = DistributedDataParallel(model)
    if variant in ("fsdp2", "sharded-fsdp2"):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if variant in ("ddp", "fsdp2"):
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True, **ADAMW)
    elif variant == "zero":
        optimizer = ZeroRedundancyOptimizer(
            list(model.parameters()), optimizer_class=torch.optim.AdamW, foreach=True, **ADAMW
        )
    elif variant == "ddp-came":
        optimizer = came_pytorch.CAME(model.parameters(), **CAME)
    elif variant == "ddp-muon":
        matrices = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        optimizer = _Both(torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(rest, foreach=True, **ADAMW))
    elif variant == "sharded-muon":
        spec = spec_for(model, world, "S(dp),R", "S(dp)")
        adamw = {f"adamw_{k}": v for k, v in ADAMW.items()}
        optimizer = ShardedMuon(model.named_parameters(), spec, **MUON, **adamw, bucket_bytes=bucket_bytes)
    elif variant == "sharded-fsdp2":
        optimizer = ShardedAdamW(model.named_parameters(), None, **ADAMW, bucket_bytes=bucket_bytes)
    else:
        flat = "-flat" in variant
        spec = spec_for(model, world, "R,R" if flat else "S(dp),R", "R" if flat else "S(dp)")
        overlap = variant.startswith("sharded-overlap")
        options: dict[str, Any] = {"flat_axis": "dp" if flat else None, "overlap": overlap}
        if variant.endswith("-kept"):  # the default frees them, with overlap too
            options["free_grads"] = False
        options["bucket_bytes"] = bucket_bytes
        if variant.startswith("sharded-came"):
            optimizer = ShardedCAME(model.named_parameters(), spec, **CAME, **options)
        else:
            optimizer = ShardedAdamW(model.named_parameters(), spec, **ADAMW, **options)
        if variant == "sharded-overlap-prefetch":
            optimizer.prefetch_params(model.embed, *model.layers, model.head)
    loss = 0.0
    step_peak = 0
    for step in range(1, steps + 1):
        tokens = tokens_for(step, rank)
        module.zero_grad(set_to_none=True)
        out = module(tokens[:, :-1])
        loss_t = F.cross_entropy(out.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss_t.backward()
        del out
        if step == steps:
            at_step = _status("VmRSS")
            _reset_peak()
        optimizer.step()
        if step == steps:
            step_peak = _status("VmHWM") - at_step
        loss = loss_t.item()
    if hasattr(optimizer, "wait_params"):
        optimizer.wait_params()
    held = _status("VmRSS") - before
    predicted = None
    report = getattr(optimizer, "memory_report", None)
    if report is not None:
        predicted = report().total_bytes
    dist.barrier()
    dist.destroy_process_group()
    return {"held": held, "step_peak": step_peak, "loss": loss, "predicted": predicted}


class _Both:
    """Two torch optimizers stepped as one (Muon's matrices and AdamW's rest)."""

    def __init__(self, *optimizers: Any) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


def run_variant(
    variant: str, world: int, steps: int, timeout: float, bucket_bytes: int | None = None
) -> list[dict[str, Any]]:
    """``variant`` on ``world`` fresh processes; each rank's measurements in rank order."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    env = os.environ | {
        "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(BENCH.parent), str(BENCH), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__)),
                "--worker",
                variant,
                str(rank),
                str(world),
                str(store.port),
                str(steps),
                str(bucket_bytes),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    measured = []
    deadline = time.monotonic() + timeout
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(
                f"{variant} on {world} ranks: rank {rank} did not finish within {timeout:.0f} s"
            ) from None
        if proc.returncode != 0:
            for p in procs:
                p.kill()
            raise RuntimeError(f"{variant} on {world} ranks: rank {rank} failed:\n{err[-4000:]}")
        measured.append(json.loads(out.strip().splitlines()[-1]))
    del store
    return measured


def mib(value: float | None) -> str:
    return "" if value is None else f"{value / MiB:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="4", help="comma-separated world sizes (default 4)")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ",".join(VARIANTS)
    )
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per variant")
    results.add_json_option(parser)
    parser.add_argument(
        "--bucket-kib", type=int, default=None, help="bucket_bytes of the sharded optimizers (default: theirs)"
    )
    parser.add_argument("--worker", nargs=6, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        variant, rank, world, port, steps, bucket = args.worker
        bucket_bytes = None if bucket == "None" else int(bucket)
        print(json.dumps(worker(variant, int(rank), int(world), int(port), int(steps), bucket_bytes)))
        return
    keys = [k for k in args.variants.split(",") if k]
    unknown = [k for k in keys if k not in VARIANTS]
    if unknown or not keys:
        parser.error(f"unknown or missing variants: {unknown}")
    if "ddp" not in keys:
        keys.insert(0, "ddp")  # every ratio is to DDP + AdamW of the same run
    worlds = [int(w) for w in args.ranks.split(",") if w]
    started = time.perf_counter()
    measured: dict[str, Any] = {"steps": args.steps, "results": {}}
    with results.printed() as out:
        for world in worlds:
            bucket = None if args.bucket_kib is None else args.bucket_kib * 1024
            rows = {key: run_variant(key, world, args.steps, args.timeout, bucket) for key in keys}
            measured["results"][str(world)] = rows
            print_table(world, keys, rows, args.steps)
    print(f"\ncommand: {' '.join([Path(sys.executable).name, *sys.argv])}; {time.perf_counter() - started:.0f} s")
    results.write(args.json, "memory", results.markdown_tables(out.getvalue()), data=measured)


def print_table(world: int, keys: list[str], rows: dict[str, list[dict[str, Any]]], steps: int) -> None:
    """One world size's table: the largest over ranks, ratios to DDP + AdamW and to the peer."""
    ddp = max(r["held"] for r in rows["ddp"])
    print(f"\n**{world} ranks** ({WIDTH}x{LAYERS} model, {steps} steps; MiB per rank, the largest over ranks)\n")
    print("| variant | held MiB | x DDP | x peer | step peak MiB | predicted MiB | predicted / held | loss |")
    print("|---|---|---|---|---|---|---|---|")
    for key in keys:
        family = next((f for f in ("came", "muon") if f in key and f"ddp-{f}" in rows), None)
        reference_loss = rows["ddp" if family is None else f"ddp-{family}"][0]["loss"]
        held = max(r["held"] for r in rows[key])
        peak = max(r["step_peak"] for r in rows[key])
        predicted = [r["predicted"] for r in rows[key] if r["predicted"] is not None]
        peer = PEERS.get(key)
        versus = f"{held / max(r['held'] for r in rows[peer]):.2f} ({peer})" if peer in rows else ""
        guess = max(predicted) if predicted else None
        loss = rows[key][0]["loss"]
        flag = "" if abs(loss - reference_loss) <= LOSS_RTOL * abs(reference_loss) else " MISMATCH"
        print(
            f"| {VARIANTS[key]} | {mib(held)} | {held / ddp:.2f} | {versus} | {mib(peak)} | {mib(guess)} "
            f"| {'' if guess is None else f'{guess / held:.2f}'} | {loss:.5f}{flag} |"
        )


if __name__ == "__main__":
    main()
