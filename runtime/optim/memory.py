"""What a sharded optimizer's rank holds, by kind: the prediction ``memory_report()`` gives.

The figures come from the layouts and the step program, not from measuring: parameters and
their gradients (the rank's pieces, in their dtypes: the training loop holds them, the optimizer
only reads them), the optimizer states and fp32 master shards (their local shapes), the bucket
buffers of the step program (its kept and send buffers, ``planner.buffers.lay_out``), the spare
state buffers of a transactional step, the math's working buffers, and over FSDP2's parameters
the unsharded parameters FSDP2 keeps for its largest ``fully_shard`` group. ``bench/bench_memory.py``
sets the total beside the resident memory the operating system measures; docs/memory.md says
what each part is and how it scales with the ranks.
"""

from __future__ import annotations

import attrs

MiB = 2**20


@attrs.frozen
class MemoryReport:
    """Bytes this rank holds for the optimizer's parameters, by kind.

    >>> report = MemoryReport(params=8 * MiB, grads=8 * MiB, states=4 * MiB, masters=0, buffers=3 * MiB, spare=0,
    ...                       scratch=MiB)
    >>> report.total_bytes == 24 * MiB
    True
    >>> print(report)
    params 8.00 MiB + grads 8.00 MiB + states 4.00 MiB + buffers 3.00 MiB + scratch 1.00 MiB = 24.00 MiB
    """

    params: int  # the rank's pieces of the parameters
    grads: int  # their gradients (as backward leaves them: the parameters' shapes and dtypes)
    states: int  # optimizer states (exp_avg, ...), fp32 masters excluded
    masters: int  # fp32 master shards of lower-precision parameters
    buffers: int  # the step program's bucket buffers (kept and send)
    spare: int  # the second set of state buffers of a transactional step
    scratch: int  # the math's working buffers
    # What the model's wrapper keeps besides the parameters' shards: over FSDP2's parameters, the
    # unsharded parameters of its largest fully_shard group (measured held between steps).
    wrapper: int = 0

    @property
    def total_bytes(self) -> int:
        return (
            self.params + self.grads + self.states + self.masters + self.buffers + self.spare + self.scratch
        ) + self.wrapper

    def __str__(self) -> str:
        parts = [(k, v) for k, v in attrs.asdict(self).items() if v]
        text = " + ".join(f"{k} {v / MiB:.2f} MiB" for k, v in parts)
        return f"{text} = {self.total_bytes / MiB:.2f} MiB"
