"""The bucket cap the cost model chooses (``planner.bucket_cap``): the smallest power of two
from 1 MiB whose step is within 5% of the uncapped step's time, checked against the step's
time worked out by hand from the cost table; ``--bucket-bytes auto`` and the warnings where
a cap is far from it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from planner.bucket_cap import AUTO, BucketCap, far_from, step_bucket_cap
from planner.spec_plan import plan_spec
from shardlang import parse_spec
from tests.cli_support import no_traceback, run

N, ALPHA, BANDWIDTH, TENSORS = 64, 2e-6, 25e9, 64
ROWS = 1024  # bf16[1024, 1024]: 2 MiB a tensor
ZERO2 = f"""
mesh world = [dp={N}]  bandwidth {BANDWIDTH:.0f}  latency {ALPHA * 1e6:.0f}us
tensor w.{{0..{TENSORS - 1}}} : bf16[{ROWS}, 1024] {{
  param = R,R over world
  grad  = R,R | P(dp):avg over world
  state = S(dp),R over world
}}
"""


def _by_hand(cap: int) -> float:
    """The ZeRO-2 step's modeled seconds under ``cap``, from the cost table alone: one
    reduce_scatter kind and one all_gather kind, each tensor a 2 MiB buffer (N blocks of
    2 MiB / N), so a bucket takes floor(cap / 2 MiB) tensors (at least one); a bucket costs
    (N-1) rounds of ALPHA, and the bytes, (N-1)/N of each buffer, cost the same in any bucket."""
    buffer = ROWS * 1024 * 2
    per_bucket = max(cap // buffer, 1)
    buckets = math.ceil(TENSORS / per_bucket)
    sent = TENSORS * buffer * (N - 1) // N
    return 2 * (buckets * (N - 1) * ALPHA + sent / BANDWIDTH)


def test_the_cap_is_the_smallest_power_of_two_within_five_percent_of_uncapped() -> None:
    # by hand: a bucket's latency is 63 x 2 us = 126 us and each kind sends 132 MB (5.28 ms), so
    # within 5% of one bucket a kind (5.41 ms) allows 3 buckets: 22 tensors a bucket, 44 MiB, so
    # 64 MiB (2 buckets); 32 MiB takes 4 (5.79 ms a kind, 7% over)
    best = _by_hand(2**62)
    expected = next(2**k for k in range(20, 41) if _by_hand(2**k) <= 1.05 * best)
    assert expected == 64 * 2**20
    spec = parse_spec(ZERO2)
    planned = plan_spec(spec)
    got = step_bucket_cap(planned.step, {tp.tensor.name: tp.cost for tp in planned.tensors})
    assert got.bytes == expected
    assert got.seconds == pytest.approx(_by_hand(expected), rel=1e-9)
    assert got.best_seconds == pytest.approx(best, rel=1e-9)
    assert got.buffer_bytes == 32 * 2 * 2**20  # 32 tensors of 2 MiB a bucket
    auto = plan_spec(spec, bucket_bytes=AUTO).step
    assert auto.bucket_bytes == expected and auto == plan_spec(spec, bucket_bytes=expected).step
    assert planned.step.total_seconds == pytest.approx(_by_hand(32 * 2**20), rel=1e-9)


def test_far_from_the_model_cap() -> None:
    model = BucketCap(bytes=64 * 2**20, seconds=1.0, buffer_bytes=64 * 2**20, best_seconds=0.97)
    assert far_from((1.25, 32 * 2**20), model) is None
    assert far_from((1.26, 32 * 2**20), model) == "slower"
    assert far_from((0.97, 256 * 2**20), model) is None  # 4x: not more
    assert far_from((0.97, 257 * 2**20), model) == "larger"
    small = BucketCap(bytes=2**20, seconds=1.0, buffer_bytes=2**20, best_seconds=1.0)
    assert far_from((1.0, 16 * 2**20), small) is None  # 15 MiB more: under the 16 MiB floor


def test_plan_warns_where_the_cap_is_far_and_takes_auto(tmp_path: Path) -> None:
    spec = tmp_path / "zero2.shard"
    spec.write_text(ZERO2.replace("latency 2us", "latency 50us"))  # latency dear: a small cap is slow
    small = run("plan", str(spec), "--bucket-bytes", "2MiB")
    no_traceback(small)
    assert small.returncode == 0, small.stderr
    assert "warning: the 2 MiB bucket cap makes this step" in small.stdout
    assert "--bucket-bytes auto takes it" in small.stdout
    overlapped = run("plan", str(spec), "--bucket-bytes", "2MiB", "--overlap")  # what backward hides: unknown
    assert overlapped.returncode == 0 and "warning" not in overlapped.stdout
    auto = run("plan", str(spec), "--bucket-bytes", "auto")
    assert auto.returncode == 0 and "warning" not in auto.stdout
    data = json.loads(run("plan", str(spec), "--bucket-bytes", "2MiB", "--format", "json").stdout)
    assert any("bucket cap makes this step" in w for w in data["warnings"])
    large = run("plan", str(tmp_path / "zero2.shard"), "--bucket-bytes", "auto", "--format", "json")
    cap = json.loads(large.stdout)["step"]["bucket_bytes"]
    spec.write_text(ZERO2)  # latency cheap: 64 MiB is the model's cap, 1 GiB holds 2x the buffers of it
    assert "bucket cap holds" not in run("plan", str(spec), "--bucket-bytes", "1GiB").stdout
    spec.write_text(ZERO2.replace("w.{0..63}", "w.{0..1023}"))  # 16x the tensors: a 2 GiB bucket at 4 GiB
    huge = run("plan", str(spec), "--bucket-bytes", "4GiB")
    assert "warning: the 4 GiB bucket cap holds buckets of up to 2 GiB per rank" in huge.stdout
    assert cap > 2 * 2**20
    assert run("plan", str(spec), "--bucket-bytes", "often").returncode == 2


def test_suggest_auto_prices_each_choice_under_the_model_cap(tmp_path: Path) -> None:
    from planner.suggest import build_problems

    # the ZeRO-2 spec's own layouts under AUTO: the step's time under the model's cap (64 MiB,
    # by hand above), as `plan --bucket-bytes auto` and the optimizers' default take it
    problem = build_problems(parse_spec(ZERO2), bucket_bytes=AUTO)[0]
    own = problem.original()
    assert problem.cap_of(own.picks) == 64 * 2**20
    assert own.seconds == pytest.approx(_by_hand(64 * 2**20), rel=1e-9)
    fixed = build_problems(parse_spec(ZERO2), bucket_bytes=2 * 2**20)[0]
    assert fixed.original().seconds == pytest.approx(_by_hand(2 * 2**20), rel=1e-9)
    spec = tmp_path / "zero2.shard"
    spec.write_text(ZERO2.replace("latency 2us", "latency 50us"))
    small = run("suggest", str(spec), "--memory", "1GiB", "--bucket-bytes", "2MiB")
    no_traceback(small)
    assert small.returncode == 0, small.stderr
    assert "warning: the 2 MiB bucket cap makes this step" in small.stdout
    auto = run("suggest", str(spec), "--memory", "1GiB", "--bucket-bytes", "auto", "--format", "json")
    assert auto.returncode == 0, auto.stderr
    data = json.loads(auto.stdout)
    planned = json.loads(run("plan", str(spec), "--bucket-bytes", "auto", "--format", "json").stdout)
    assert data["bucket_bytes_auto"] and data["bucket_bytes"] == planned["step"]["bucket_bytes"]
    assert data["this_spec"]["seconds"] == pytest.approx(planned["step"]["total_seconds"], rel=1e-9)
    text = run("suggest", str(spec), "--memory", "1GiB", "--bucket-bytes", "auto").stdout
    assert "warning" not in text and "the cost model's cap for the suggested layouts" in text
