"""What torch's bf16 matrix products keep on a CPU rank once Muon has run its Newton-Schulz
iterations: the ``kernels`` kind of the memory report (docs/memory.md, "Predicting it").

On CPU torch runs bf16 matrix products through oneDNN (via ideep), which builds a primitive
per distinct product (shapes, strides, which operand is transposed) and keeps it in two caches,
ideep's and oneDNN's, for the life of the process; the first bf16 product also loads oneDNN's
bf16 code. ``torch.optim._muon._zeropower_via_newtonschulz`` iterates a matrix ``X`` of
``m <= n`` (a tall matrix is transposed first) with three products, ``X @ X.T``,
``addmm(G, G, G)`` and ``addmm(X, U, X)``: three distinct primitives per shape ``(m, n)``. A
tall matrix enters the first iteration as a transposed view, so its products there are two more
(``addmm(G, G, G)`` does not see ``X``); a tall matrix and the wide one of its transposed shape
share the other three.

Measured (``tests/test_memory_kernels.py`` holds it): in fresh processes with one intra-op
thread and glibc's mmap threshold fixed at 64 KiB, after a float32 layer's forward and backward
(``bench/bench_memory.py``'s warm-up), ``VmRSS`` after iterating and freeing grows by about
5.7 MiB for the first iteration beside its products, 1.7 MiB per further square or wide shape
(from 48x48 to 1024x4096) and 2.9 MiB per tall one (from 512x128 to 4096x1024), on torch 2.13
(CPU). The constants below are those figures; CUDA's matrix products keep no such caches in host
memory and are not counted.
"""

from __future__ import annotations

from collections.abc import Iterable

# Bytes the caches keep per distinct oneDNN bf16 product (ideep's and oneDNN's primitive and
# its scratch): 1.7 MiB per wide shape's three products, measured (module doc).
PRODUCT_BYTES = 576 * 1024
# Bytes the first bf16 Newton-Schulz iteration of a process loads beside its products
# (oneDNN's bf16 code and its first caches; measured, module doc).
FIRST_USE_BYTES = 5_900 * 1024
# Distinct products of an iteration: per shape with m <= n; a tall shape's first iteration.
WIDE_PRODUCTS = 3
TALL_PRODUCTS = 2


def newton_schulz_products(shapes: Iterable[tuple[int, int]]) -> int:
    """Distinct oneDNN products the Newton-Schulz iterations of matrices of ``shapes`` build
    (module doc).

    >>> newton_schulz_products([(512, 512), (512, 512)]), newton_schulz_products([(2048, 512)])
    (3, 5)
    >>> newton_schulz_products([(2048, 512), (512, 2048), (128, 512)])
    8
    """
    wide: set[tuple[int, int]] = set()
    tall: set[tuple[int, int]] = set()
    for rows, cols in shapes:
        wide.add((min(rows, cols), max(rows, cols)))
        if rows > cols:
            tall.add((rows, cols))
    return WIDE_PRODUCTS * len(wide) + TALL_PRODUCTS * len(tall)


def kernel_bytes(shapes: Iterable[tuple[int, int]]) -> int:
    """What the bf16 product caches keep once matrices of ``shapes`` were iterated on a CPU
    rank (none when it iterates none)."""
    products = newton_schulz_products(shapes)
    return 0 if not products else FIRST_USE_BYTES + PRODUCT_BYTES * products
