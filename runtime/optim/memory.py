"""What a sharded optimizer's rank holds, by kind: the prediction ``memory_report()`` gives.

The figures come from the layouts and the step program, not from measuring: parameters and
their gradients (the rank's pieces, in their dtypes: the training loop holds them, the optimizer
only reads them), the optimizer states and fp32 master shards (their local shapes), the bucket
buffers of the step program (its kept and send buffers, ``planner.buffers.lay_out``), the spare
state buffers a step writes before it commits, the math's working buffers, and over FSDP2's
parameters the unsharded parameters FSDP2 keeps for its largest ``fully_shard`` group. One
accounting computes them, torch-free, for a spec before any optimizer exists and for a live
optimizer (``planner.memory.rank_memory``); the report is its :class:`MemoryReport`.
``bench/bench_memory.py`` sets the total beside the resident memory the operating system
measures; docs/memory.md says what each part is and how it scales with the ranks.
"""

from __future__ import annotations

from planner.memory import MemoryReport

__all__ = ["MemoryReport"]
