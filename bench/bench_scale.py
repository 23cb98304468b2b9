"""The ``shardlang`` command at real cluster sizes: time, peak memory and output size of every
command a user runs on a model's spec, from 64 to 131,072 ranks, in one process per command.

    .venv/bin/python bench/bench_scale.py [--ranks 64,4096,131072] [--models 7b,70b]
        [--meshes 2,3,4,5] [--commands check,plan,...] [--repeat N] [--json PATH] [--update PATH]

``--update PATH`` reruns only the rows asked for: the other rows of the results file ``PATH``
stay, each with the commit it was measured at (the table's note names both).

Specs (:func:`model_spec`): Llama-shaped models, bf16, TP=8 inside a node and ZeRO-2 over every
other axis: column-parallel weights (q, k, v, gate, up, the embedding and the head)
``S(tp),R``, row-parallel ones (o, down) ``R,S(tp)``, their gradients a pending mean over the
data axes and their states split over them too (``S(tp,dp,...),R`` and ``S(dp,...),S(tp)``);
RMSNorm weights replicated, states split over the data axes. 7B: 32 layers, hidden 4096, FFN
11008, vocab 32000 (291 tensors); 70B: 80 layers, hidden 8192, FFN 28672, 64 query heads and
8 key-value heads of 128 (GQA: k and v are 1024 x 8192; 723 tensors). Meshes, outermost axis
first, ``dp`` taking the ranks the others leave: 2-D ``[dp, tp=8]``, 3-D ``[dp, fsdp=4, tp=8]``,
4-D ``[dp, fsdp=4, cp=2, tp=8]``, 5-D ``[rep=2, dp, fsdp=4, cp=2, tp=8]``.

Commands (each a fresh ``python -m cli`` process; start-up and imports included):
``check``, ``plan`` (the whole step, text), ``plan-json`` (``--format json``), ``plan-flat``
(``--flat-axis dp``), ``plan-p2p`` (``--p2p``), ``suggest`` (``--memory 24GiB``, the norms
given by ``--tensor``, the training loop inferred from the spec: plain, its gradients pending
their mean; 24 GiB for 7B, 80 GiB for 70B, whose plain loop holds 35 GB of parameters and
gradients per rank), ``suggest-any`` (the same with ``--loop any``: every ZeRO form, the largest
search) and ``reshard``: the checkpoint of the embedding's state
(``S(tp,<data axes>),R``, 32000 x hidden) planned onto a 2-D mesh of three quarters of the ranks,
as loading a checkpoint on a smaller cluster does. Per command: wall seconds, CPU seconds
(user + system, of the child), its peak resident set (``ru_maxrss`` from ``os.wait4``: the
operating system's figure for that process alone) and the bytes it printed. With ``--repeat N``
each command runs N times and the run of least CPU is kept (the data lists every run's CPU
seconds): a shared machine's other tenants slow a run by up to a fifth. Each process finds
the project's modules compiled (bytecode in a cache of the run's own, written before the first
command), as an installed command does from its second run on: where the environment says not to
write bytecode (``PYTHONDONTWRITEBYTECODE``), every process would otherwise compile them again.

The goals (docs/benchmarks/history/planner.md): every command within 5 s and 500 MiB at
131,072 ranks; the output's size independent of the rank count; ``suggest`` on the 7B
``[dp=512, tp=8]`` spec within 24 GiB choosing states at most as large as ZeRO-2's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import results  # noqa: E402  (bench/, found through the path above)

REPO = BENCH.parent
MODELS: dict[str, dict[str, int]] = {
    "7b": {"layers": 32, "hidden": 4096, "ffn": 11008, "vocab": 32000, "kv": 4096},
    "70b": {"layers": 80, "hidden": 8192, "ffn": 28672, "vocab": 32000, "kv": 1024},
}
TP = 8
# The axes besides dp and tp, outermost first, per mesh rank (module docstring).
MESHES: dict[int, tuple[tuple[str, int], ...]] = {
    2: (),
    3: (("fsdp", 4),),
    4: (("fsdp", 4), ("cp", 2)),
    5: (("rep", 2), ("fsdp", 4), ("cp", 2)),
}
COMMANDS = ("check", "plan", "plan-json", "plan-flat", "plan-p2p", "suggest", "suggest-any", "reshard")
GOAL_SECONDS, GOAL_MIB = 5.0, 500.0
SUGGEST_BUDGET = "24GiB"
# suggest's budget per model: 70B's plain loop holds its TP shards of parameters and gradients
# whole (35 GB per rank), so it is asked for an 80 GB accelerator's.
BUDGETS = {"7b": SUGGEST_BUDGET, "70b": "80GiB"}


def mesh_axes(ranks: int, ndim: int) -> list[tuple[str, int]] | None:
    """The mesh's axes, outermost first; ``None`` where the other axes leave dp no rank."""
    others = MESHES[ndim]
    fixed = TP
    for _, n in others:
        fixed *= n
    if ranks % fixed or ranks < fixed:
        return None
    outer = [a for a in others if a[0] == "rep"]  # rep stays outside dp
    return [*outer, ("dp", ranks // fixed), *(a for a in others if a[0] != "rep"), ("tp", TP)]


def _mesh_text(axes: list[tuple[str, int]]) -> str:
    return "[" + ", ".join(f"{name}={n}" for name, n in axes) + "]"


def model_spec(model: str, axes: list[tuple[str, int]]) -> tuple[str, str]:
    """The spec text of ``model`` over ``axes`` (module docstring), and the ``--tensor``
    argument that names its RMSNorm weights (the rule's tensors)."""
    m = MODELS[model]
    data = ",".join(name for name, _ in axes if name != "tp")
    blocks = f"model.layers.{{0..{m['layers'] - 1}}}"
    col, row = f"S(tp,{data}),R", f"S({data}),S(tp)"

    def tensors(names: str, rows: int, cols: int, parallel: str, state: str) -> str:
        return (
            f"tensor {names} : bf16[{rows}, {cols}] {{\n"
            f"  param = {parallel} over world\n  grad  = {parallel} | P({data}):avg over world\n"
            f"  state = {state} over world\n}}\n"
        )

    h = m["hidden"]
    text = f"mesh world = {_mesh_text(axes)}  bandwidth 25e9  latency 20us\n"
    text += tensors("model.embed_tokens.weight", m["vocab"], h, "S(tp),R", col)
    text += tensors(f"{blocks}.self_attn.q_proj.weight", h, h, "S(tp),R", col)
    text += tensors(f"{blocks}.self_attn.{{k_proj,v_proj}}.weight", m["kv"], h, "S(tp),R", col)
    text += tensors(f"{blocks}.self_attn.o_proj.weight", h, h, "R,S(tp)", row)
    text += tensors(f"{blocks}.mlp.{{gate_proj,up_proj}}.weight", m["ffn"], h, "S(tp),R", col)
    text += tensors(f"{blocks}.mlp.down_proj.weight", h, m["ffn"], "R,S(tp)", row)
    text += tensors("lm_head.weight", m["vocab"], h, "S(tp),R", col)
    text += (
        'rule "model.{layers.*.input_layernorm,layers.*.post_attention_layernorm,norm}.weight" {\n'
        f"  param = R over world\n  grad  = R | P({data}):avg over world\n  state = S({data}) over world\n}}\n"
    )
    norms = f"{blocks}.{{input_layernorm,post_attention_layernorm}}.weight:{h}:bf16"
    return text, norms


def command(name: str, spec: Path, norms: str, model: str, axes: list[tuple[str, int]]) -> list[str]:
    """The ``shardlang`` arguments of one command on ``spec``."""
    if name == "check":
        return ["check", str(spec)]
    if name in ("suggest", "suggest-any"):
        tensors = ["--tensor", norms, "--tensor", norms_final(norms)]
        loop = ["--loop", "any"] if name == "suggest-any" else []
        return ["suggest", str(spec), "--memory", BUDGETS[model], *tensors, *loop]
    if name == "reshard":
        data = ",".join(a for a, _ in axes if a != "tp")
        ranks = 1
        for _, n in axes:
            ranks *= n
        src = f"S(tp,{data}),R over mesh{_mesh_text(axes)}"
        dst = f"S(tp,dp),R over mesh[dp={ranks * 3 // 4 // TP},tp={TP}]"
        return ["plan", src, dst, "--shape", f"{MODELS[model]['vocab']}x{MODELS[model]['hidden']}", "--dtype", "bf16"]
    extra = {"plan": [], "plan-json": ["--format", "json"], "plan-flat": ["--flat-axis", "dp"], "plan-p2p": ["--p2p"]}
    return ["plan", str(spec), *extra[name]]


def norms_final(norms: str) -> str:
    """The final norm's ``--tensor`` argument, of the blocks' norms' width and dtype."""
    return "model.norm.weight:" + norms.split(":", 1)[1]


# The environment of every command (module docstring): the bytecode cache :func:`compiled` sets.
_ENV = dict(os.environ)


def compiled(cache: Path) -> None:
    """The project's modules compiled into ``cache``, which every command then reads."""
    _ENV.pop("PYTHONDONTWRITEBYTECODE", None)
    _ENV["PYTHONPYCACHEPREFIX"] = str(cache)
    packages = ("cli", "planner", "runtime", "shardlang")
    subprocess.run([sys.executable, "-m", "compileall", "-q", *packages], cwd=REPO, env=_ENV, check=True)


def run_one(args: list[str]) -> dict[str, Any]:
    """One ``shardlang`` process: wall and CPU seconds, peak RSS in MiB, exit code, its output."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "cli", *args], cwd=REPO, stdout=out, stderr=err, env=_ENV)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        printed, errors = out.read(), err.read()
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_mib": usage.ru_maxrss / 1024,  # KiB on Linux
        "rc": proc.returncode,
        "out_bytes": len(printed),
        "stdout": printed.decode("utf-8", "replace"),
        "stderr": errors.decode("utf-8", "replace")[-2000:],
    }


def suggest_verdict(printed: str) -> str:
    """Whether ``suggest --format json`` chose states at most as large as ZeRO-2's."""
    data = json.loads(printed)
    chosen, zero2 = data["suggested"]["memory_bytes"], data["strategies"]["zero2"]["memory_bytes"]
    fits = chosen <= data["budget_bytes"] and chosen <= zero2
    return f"{'ZeRO-2 or leaner' if fits else 'MORE than ZeRO-2'}: {chosen / 2**30:.2f} GiB (zero2 {zero2 / 2**30:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="64,4096,131072", help="comma-separated rank counts")
    parser.add_argument("--models", default="7b,70b")
    parser.add_argument("--meshes", default="2,3,4,5", help="mesh ranks (axes) to run")
    parser.add_argument("--commands", default=",".join(COMMANDS))
    parser.add_argument("--repeat", type=int, default=1, help="runs per command; the least CPU is kept")
    results.add_json_option(parser)
    parser.add_argument("--update", type=Path, metavar="PATH", help="keep the other rows of this results file")
    args = parser.parse_args()
    commands = args.commands.split(",")
    commit = (results.provenance()["commit"] or "")[:10]
    raw = []
    with tempfile.TemporaryDirectory() as tmp:
        compiled(Path(tmp) / "bytecode")
        for model in args.models.split(","):
            for ndim in (int(n) for n in args.meshes.split(",")):
                for ranks in (int(n) for n in args.ranks.split(",")):
                    axes = mesh_axes(ranks, ndim)
                    if axes is None:
                        continue
                    text, norms = model_spec(model, axes)
                    spec = Path(tmp) / f"{model}_{ranks}_{ndim}d.shard"
                    spec.write_text(text, encoding="utf-8")
                    for name in commands:
                        runs = [run_one(command(name, spec, norms, model, axes)) for _ in range(args.repeat)]
                        got = min(runs, key=lambda r: r["cpu_s"])
                        error = got["stderr"].strip().splitlines()[-1] if got["rc"] else ""
                        raw.append({k: v for k, v in got.items() if k not in ("stdout", "stderr")})
                        raw[-1]["cpu_s_runs"] = [round(r["cpu_s"], 3) for r in runs]
                        raw[-1].update(model=model, mesh=_mesh_text(axes), ranks=ranks, command=name, error=error)
                        raw[-1]["commit"] = commit
                        if name.startswith("suggest") and got["rc"] == 0:  # or stopped at the node limit
                            raw[-1]["optimal"] = "solved: optimal" in got["stdout"]
                        print(" | ".join(_row(raw[-1])), flush=True)
        verdict = _suggest_goal() if "suggest" in commands else _kept_verdict(args.update)
    kept = _kept_rows(args.update, raw) if args.update else []
    raw = sorted(kept + raw, key=_order)
    largest = max(r["ranks"] for r in raw)
    misses = [
        f"{r['model']} {r['mesh']} {r['command']}"
        for r in raw
        if r["ranks"] == largest and not (r["cpu_s"] <= GOAL_SECONDS and r["peak_mib"] <= GOAL_MIB and r["rc"] == 0)
    ]
    columns = ["model", "mesh", "ranks", "command", "wall s", "CPU s", "peak MiB", "output bytes", "result"]
    commits = sorted({r.get("commit", "") for r in raw})
    measured = (
        f" Rows measured at commit{'s' * (len(commits) > 1)} {', '.join(commits)} (the data says which)."
        if kept
        else ""
    )
    note = (
        f"Goals at {largest:,} ranks: every command <= {GOAL_SECONDS:g} s of CPU and <= {GOAL_MIB:g} MiB; "
        + (f"missed by: {', '.join(misses)}." if misses else "all met.")
        + f" suggest on 7B [dp=512, tp=8] within {SUGGEST_BUDGET}: {verdict}. CPU seconds judge the time: "
        "wall seconds on a shared machine count its other processes too." + measured + _repeats(raw)
    )
    print(note)
    every = sorted({r["command"] for r in raw}, key=lambda c: COMMANDS.index(c) if c in COMMANDS else len(COMMANDS))
    tables = [
        summary(raw, every),
        results.table("Each command in a fresh process", columns, [_row(r) for r in raw], note),
    ]
    for t in tables[:1]:
        print(t["title"], t["columns"], *t["rows"], sep="\n")
    results.write(args.json, "scale", tables, data=raw)


def _repeats(raw: list[dict[str, Any]]) -> str:
    """What the note says of the rows run several times (``--repeat``): how much slower their
    slowest run was than the one kept."""
    runs = [r["cpu_s_runs"] for r in raw if len(r.get("cpu_s_runs", ())) > 1]
    if not runs:
        return ""
    worst = max(max(c) / min(c) for c in runs)
    return (
        f" {len(runs)} rows ran {max(len(c) for c in runs)} times each and keep the run of least CPU; "
        f"the slowest run of a row took up to {worst:.2f}x it (every run's CPU seconds are in the data)."
    )


def _row(r: dict[str, Any]) -> list[str]:
    """A data row's table cells; a failed command's cell keeps the start of its error."""
    note = f"exit {r['rc']}: {r['error'][:100]}..." if r["rc"] else "ok"
    if r.get("optimal") is False:
        note = "ok, solver stopped at its node limit (gap stated)"
    cells = [r["model"], r["mesh"], f"{r['ranks']:,}", r["command"], f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}"]
    return [*cells, f"{r['peak_mib']:.0f}", f"{r['out_bytes']:,}", note]


def _order(r: dict[str, Any]) -> tuple:
    """Rows in the order a full run makes them: model, mesh rank, ranks, command."""
    command = COMMANDS.index(r["command"]) if r["command"] in COMMANDS else len(COMMANDS)
    return list(MODELS).index(r["model"]), r["mesh"].count("="), r["ranks"], command


def _kept_rows(path: Path, fresh: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the results file ``path`` that this run did not measure again, each with
    the commit it was measured at."""
    record = results.read(path)
    again = {(r["model"], r["mesh"], r["ranks"], r["command"]) for r in fresh}
    kept = [dict(r) for r in record["data"] if (r["model"], r["mesh"], r["ranks"], r["command"]) not in again]
    for r in kept:
        r.setdefault("commit", (record["commit"] or "")[:10])
    return kept


def _kept_verdict(path: Path | None) -> str:
    """The suggest goal's verdict as the results file ``path`` states it, when suggest is not rerun."""
    if path is None:
        return "not run"
    note = results.read(path)["tables"][-1]["note"]
    start = note.find(f"within {SUGGEST_BUDGET}: ")
    return note[start + len(f"within {SUGGEST_BUDGET}: ") :].split(". CPU seconds")[0] if start >= 0 else "not run"


def summary(raw: list[dict[str, Any]], commands: list[str]) -> dict[str, Any]:
    """Per command, at the largest rank count, the worst CPU seconds and peak MiB of any model
    per mesh rank, and how much the output grew from the smallest rank count to the largest
    (the most over models and meshes; a failed run shows as failed)."""
    largest, smallest = max(r["ranks"] for r in raw), min(r["ranks"] for r in raw)
    ndims = sorted({r["mesh"].count("=") for r in raw})
    rows = []
    for name in commands:
        cells = [name]
        for ndim in ndims:
            runs = [r for r in raw if r["command"] == name and r["ranks"] == largest and r["mesh"].count("=") == ndim]
            failed = [r for r in runs if r["rc"] != 0]
            if not runs:
                cells.append("-")
            elif failed:
                cells.append(f"failed ({len(failed)} of {len(runs)})")
            else:
                cells.append(f"{max(r['cpu_s'] for r in runs):.2f} s, {max(r['peak_mib'] for r in runs):.0f} MiB")
        growth = []
        for r in raw:
            if r["command"] == name and r["ranks"] == largest and r["rc"] == 0:
                base = [
                    b
                    for b in raw
                    if b["command"] == name
                    and b["ranks"] == smallest
                    and b["rc"] == 0
                    and (b["model"], b["mesh"].count("=")) == (r["model"], r["mesh"].count("="))
                ]
                if base and base[0]["out_bytes"]:
                    growth.append(r["out_bytes"] / base[0]["out_bytes"])
        cells.append(f"{max(growth):.2f}x" if growth else "-")
        rows.append(cells)
    columns = ["command", *(f"{n}-D mesh" for n in ndims), f"output {largest:,} / {smallest:,} ranks"]
    title = f"Worst of the models at {largest:,} ranks: CPU seconds and peak RSS per command and mesh"
    return results.table(title, columns, rows)


def _suggest_goal() -> str:
    """``suggest --format json`` on the 7B ``[dp=512, tp=8]`` spec, judged (module docstring)."""
    axes = mesh_axes(4096, 2)
    assert axes is not None
    text, norms = model_spec("7b", axes)
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "7b_4096_2d.shard"
        spec.write_text(text, encoding="utf-8")
        got = run_one([*command("suggest", spec, norms, "7b", axes), "--format", "json"])
    if got["rc"] != 0:
        return f"failed: {got['stderr'].strip().splitlines()[-1]}"
    return suggest_verdict(got["stdout"])


if __name__ == "__main__":
    main()
