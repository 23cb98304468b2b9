"""A profiled optimizer step: ``torch.profiler``'s trace holds one named range per bucket for
its start and one for its wait, in each stage, named after the bucket, and one per stage of the
step around them: the gradient hooks under overlap (named after the gradient and its bucket),
the overlap agreement, the gradient norm, the math and its phases' sums, the commit flags and,
with prefetch_params, the gathers' writes in forward (2 gloo ranks; the names are the table's
of docs/stacks/profiler.md); a step without a profiler builds none. The expected ranges are
built from the model's tensors and the step plan's buckets, not from the ranges. The spec is
examples/profile_step.py's."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest
import torch

from runtime.testing import run_ranks
from tests.conftest import REPO
from tests.stack_support import example

WIDTH, LAYERS = 16, 3


def _run(rank: int, world_size: int, kind: str, options: dict[str, Any]) -> dict[str, Any]:
    import shardlang
    from runtime.optim import ShardedAdafactor, ShardedAdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    make = {"ShardedAdamW": ShardedAdamW, "ShardedAdafactor": ShardedAdafactor}[kind]
    prefetch = options.pop("prefetch_params", False)
    spec = shardlang.parse_spec(example("profile_step.py").SPEC)  # ZeRO-2 over [dp=2]
    optimizer = make(model.named_parameters(), spec, lr=1e-3, **options)
    if prefetch:  # each layer's forward writes its parameters, gathered since the last step
        optimizer.prefetch_params(*model)
    generator = torch.Generator().manual_seed(rank)

    def train_step() -> None:
        model(torch.randn(4, WIDTH, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    train_step()  # plans and compiles: the profiled step is a steady one
    built, record = [], torch.profiler.record_function
    torch.profiler.record_function = lambda name, *_: built.append(name)  # type: ignore[assignment,misc]
    try:
        train_step()  # no profiler runs: no range is built
    finally:
        torch.profiler.record_function = record  # type: ignore[misc]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        train_step()
    plan = optimizer.step_plan()
    return {
        "built": built,
        "names": [e.name for e in profile.events() if e.name.startswith("shardlang ")],
        "buckets": [
            (b.stage, b.describe(), sorted({plan.legs[m.leg].tensor for m in b.members})) for b in plan.buckets
        ],
        "tensors": [n for n, p in model.named_parameters()],
    }


def _bucket(index: int, count: int, described: str, tensors: list[str]) -> re.Pattern[str]:
    """A bucket's part of a range name: 'bucket 2 of 5 (reduce_scatter(...) f32 of 'w', 'b')'."""
    listed = "".join(rf"(?=.*'{re.escape(t)}')" for t in tensors[:3])
    return re.compile(rf"bucket {index} of {count} \({re.escape(described)} of {listed}.*\)")


def _expected(got: dict[str, Any], kind: str, options: dict[str, Any]) -> list[tuple[str, int]]:
    """Per range (a regular expression of its whole name), how many times the step runs it."""
    buckets, tensors = got["buckets"], got["tensors"]
    count = len(buckets)
    want = []
    for index, (stage, described, members) in enumerate(buckets, start=1):
        bucket = _bucket(index, count, described, members).pattern
        want += [(rf"shardlang {stage}: start {bucket}", 1), (rf"shardlang {stage}: wait {bucket}", 1)]
    if options.get("overlap"):
        for tensor in tensors:  # each gradient's hook, named after the bucket that packs it
            index, (_, described, members) = next(
                (i, b) for i, b in enumerate(buckets, start=1) if b[0] == "before the update" and tensor in b[2]
            )
            bucket = _bucket(index, count, described, members).pattern
            want.append((rf"shardlang backward: hook '{re.escape(tensor)}' into {bucket}", 1))
        want.append(("shardlang before the update: overlap agreement", 1))
    if options.get("max_grad_norm"):
        want.append(("shardlang before the update: gradient norm", 1))
    want.append((rf"shardlang the update: {kind} math", 1))
    if kind == "ShardedAdafactor":  # its two phases' sums (runtime.optim.adafactor.PHASES)
        want.append((r"shardlang the update: sums 1 of 2 \(the second-moment sums and the parameter's norm\)", 1))
        want.append((r"shardlang the update: sums 2 of 2 \(the update's RMS\)", 1))
    if options.get("prefetch_params"):  # in forward, each layer's gathers written into it
        want += [(rf"shardlang after the update: write '{i}\.weight' and 1 more", 1) for i in range(LAYERS)]
    flags = 1 if options.get("transactional") else 2
    want += [(f"shardlang commit: flag {k} of {flags}", 1) for k in range(1, flags + 1)]
    return want


CASES = {
    "zero2": ("ShardedAdamW", {"bucket_bytes": 1100, "max_grad_norm": 1.0}),
    "overlap": ("ShardedAdamW", {"bucket_bytes": 1100, "overlap": True, "max_grad_norm": 1.0}),
    "prefetch": ("ShardedAdamW", {"bucket_bytes": 1100, "prefetch_params": True}),
    "transactional": ("ShardedAdafactor", {"bucket_bytes": 1100, "transactional": True}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_profiled_step_names_every_bucket_and_stage(case: str) -> None:
    kind, options = CASES[case]
    for got in run_ranks(_run, 2, (kind, dict(options)), timeout=120):
        names = got["names"]
        assert got["built"] == [], got["built"]  # nothing without a profiler
        assert len(got["buckets"]) >= 4, got["buckets"]  # several buckets before the update and after it
        counts = Counter(names)
        matched: set[str] = set()
        for pattern, times in _expected(got, kind, options):
            found = [n for n in counts if re.fullmatch(pattern, n)]
            assert len(found) == 1 and counts[found[0]] == times, (pattern, names)
            matched.add(found[0])
        assert set(counts) == matched, sorted(set(counts) - matched)  # no range the table leaves out


def _table() -> list[re.Pattern[str]]:
    """The page's table of ranges, each name made a pattern: ``(...)`` any bucket, numbers any
    number, a quoted tensor any tensor, the optimizer any optimizer."""
    page = (REPO / "docs" / "stacks" / "profiler.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(shardlang [^`]+)` \|", page, flags=re.M)
    patterns = []
    for row in rows:
        text = re.escape(row).replace(r"\(\.\.\.\)", r"\(.*\)").replace("ShardedAdamW", r"\w+")
        text = re.sub(r"'[^']*'", "'[^']+'", re.sub(r"\d+", r"\\d+", text))
        patterns.append(re.compile(text))
    return patterns


@pytest.mark.slow
def test_the_pages_table_names_every_range_seen() -> None:
    """docs/stacks/profiler.md's table holds every range a step shows, and each of its rows is
    seen in some step of the cases above."""
    table = _table()
    assert len(table) >= 10, table
    seen: set[str] = set()
    for kind, options in CASES.values():
        seen |= {n for got in run_ranks(_run, 2, (kind, dict(options)), timeout=120)[:1] for n in got["names"]}
    for name in seen:
        assert any(p.fullmatch(name) for p in table), f"{name!r} is not in the page's table"
    for pattern in table:
        assert any(pattern.fullmatch(n) for n in seen), f"no step shows {pattern.pattern!r}"
