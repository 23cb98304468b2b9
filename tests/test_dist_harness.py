"""The multi-process harness itself: results come back, failures and hangs are reported."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from runtime.testing import RankFailed, run_ranks


def _sum_of_ranks(rank: int, world_size: int) -> tuple[int, int]:
    t = torch.tensor([rank])
    dist.all_reduce(t)
    return int(t.item()), torch.get_num_threads()


def _rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")


def _rank_one_dies(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)  # as a crash would: no result, no traceback


def test_all_ranks_report_results_each_on_one_thread_as_under_torchrun() -> None:
    assert run_ranks(_sum_of_ranks, 3, timeout=60) == [(3, 1)] * 3


def test_an_exception_on_one_rank_fails_the_run() -> None:
    with pytest.raises(RankFailed, match="boom on rank 1"):
        run_ranks(_rank_one_raises, 2, timeout=60)


def test_a_rank_that_dies_without_reporting_fails_the_run_naming_it() -> None:
    with pytest.raises(RankFailed, match=r"ranks \[1\] exited without reporting a result \(exit codes rank 1: 3\)"):
        run_ranks(_rank_one_dies, 2, timeout=60)


def test_ranks_run_the_project_their_caller_imported(tmp_path) -> None:
    """A copy of the project outside the installed one (as a benchmark of a ``git archive``
    snapshot is), imported by a caller whose working directory is neither: its ranks import that
    copy too, not the installed project (the fork server preloads the runtime from its own path)."""
    root = Path(__file__).resolve().parent.parent
    copy = tmp_path / "copy"
    for package in ("runtime", "planner", "shardlang"):
        shutil.copytree(root / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "probe.py").write_text("def where(rank, world):\n    import runtime\n    return runtime.__file__\n")
    script = (
        f"import sys; sys.path.insert(0, {str(copy)!r})\n"
        "from runtime.testing import run_ranks\n"
        "import probe\n"
        "print(run_ranks(probe.where, 2, timeout=60))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    expected = str(copy / "runtime" / "__init__.py")
    assert done.stdout.strip() == repr([expected, expected])
