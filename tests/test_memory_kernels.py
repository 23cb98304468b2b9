"""The ``kernels`` kind of the memory report (``planner.matmul_caches``) against the resident
memory the operating system measures: in fresh processes set up as ``bench/bench_memory.py``
sets its ranks up (one intra-op thread, glibc's mmap threshold at 64 KiB, a float32 layer's
forward and backward before the baseline), torch's own Newton-Schulz iteration (what
``ShardedMuon`` runs) on matrices of the given shapes, its results freed, leaves ``VmRSS``
grown by at least four fifths of what ``kernel_bytes`` predicts, its anonymous part by at most that: the
library code paged in depends on the page cache (docs/memory.md, "Predicting it").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from planner.matmul_caches import kernel_bytes

MiB = 2**20
# Runs in a fresh process: the growth of VmRSS (bytes) once matrices of argv's shapes (made
# before the baseline) were iterated twice and the results freed.
_MEASURE = textwrap.dedent(
    """
    import ctypes, gc, json, sys
    import torch
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz

    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")

    def rss():
        gc.collect()
        libc.malloc_trim(0)
        with open("/proc/self/status") as status:
            kib = {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmRSS", "RssAnon"))}
        return [1024 * kib["VmRSS"], 1024 * kib["RssAnon"]]

    layer = torch.nn.Linear(64, 64)
    layer(torch.randn(8, 64)).sum().backward()
    del layer
    grads = [torch.randn(*map(int, s.split("x"))) for s in sys.argv[1:]]
    before = rss()
    for _ in range(2):
        for grad in grads:
            result = _zeropower_via_newtonschulz(grad, (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, EPS)
            del result
    print(json.dumps([a - b for a, b in zip(rss(), before)]))
    """
)


def _measured(shapes: list[tuple[int, int]]) -> tuple[int, int]:
    """The growth of VmRSS and of its anonymous part (RssAnon), in bytes."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    args = [f"{r}x{c}" for r, c in shapes]
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, *args], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    resident, private = json.loads(out.stdout.strip().splitlines()[-1])
    return resident, private


# The bench model's matrices (width 512, feed-forward 2048: attention's in- and out-projections,
# the two feed-forward layers, a vocabulary of 1,024), one square shape, and one tall shape
# repeated with its wide transpose (which shares three of its products).
CASES = {
    "bench model": [(1536, 512), (512, 512), (2048, 512), (512, 2048), (1024, 512)],
    "square": [(256, 256)],
    "tall and its transpose": [(2048, 512), (2048, 512), (512, 2048)],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_predict_what_newton_schulz_leaves_resident(case: str) -> None:
    shapes = CASES[case]
    (resident, private), predicted = _measured(shapes), kernel_bytes(shapes)
    # Most of the growth is the library's code paged in (RssFile), whose extent depends on the
    # page cache (a freshly installed wheel maps more of it): the prediction lies between what
    # the iterations surely keep private (RssAnon) and the whole resident growth (docs/memory.md).
    assert private <= predicted <= 1.25 * resident, (case, private / MiB, predicted / MiB, resident / MiB)


@pytest.mark.slow
def test_a_second_iteration_of_the_same_shapes_keeps_nothing_more() -> None:
    # The caches are per distinct product: iterating the same matrices once more (here: each
    # shape twice over) grows the resident set by no more than the noise of one page run.
    once, again = _measured([(1024, 256)])[0], _measured([(1024, 256), (1024, 256), (256, 1024)])[0]
    assert abs(again - once) <= 0.25 * once, (once / MiB, again / MiB)
