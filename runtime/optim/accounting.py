"""What a sharded optimizer's step will communicate and what its rank holds, predicted from the
layouts and the step plan (``planned_traffic``, ``memory_report``) or read from the buffers it
keeps (``work_bytes``, ``bucket_buffer_bytes``); docs/memory.md says what each part is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from runtime.memory.buffers import Scratch
from runtime.optim.clipping import Clipping
from runtime.optim.commit import CommitFlag
from runtime.optim.compiler import StepCompiler
from runtime.optim.memory import MemoryReport
from runtime.optim.phases import PhaseDriver
from runtime.optim.records import StepTraffic
from runtime.optim.slots import Slot, Slots
from runtime.optim.states import StateStore
from runtime.optim.sums import plan_collectives
from shardlang.dtypes import ITEMSIZE
from shardlang.interop import is_dtensor


class Accounting:
    """Reads the owners of a step (no state of its own): the slots, their states, the step
    compiler and its buffers, the phase driver's and the norm's sums, the commit flag, and the
    math's working buffers (``scratch``)."""

    def __init__(
        self,
        slots: Slots,
        store: StateStore,
        compiler: StepCompiler,
        driver: PhaseDriver,
        clipping: Clipping,
        flag: CommitFlag,
        scratch: Scratch,
        *,
        spare_states: bool,
        free_grads: bool,
    ) -> None:
        self._slots, self._store, self._compiler, self._driver = slots, store, compiler, driver
        self._clipping, self._flag, self._scratch = clipping, flag, scratch
        self._spare_states, self._free_grads = spare_states, free_grads

    def planned_traffic(self) -> StepTraffic:
        """What the next step will communicate on this rank (see
        ``ShardedOptimizer.planned_traffic``)."""
        slots, keys = self._slots.coming()
        if not slots or any(key is None for key in keys):
            return StepTraffic()
        compiled = self._compiler.compiled(slots, keys)  # type: ignore[arg-type]
        phases = self._driver.phase_specs(slots)
        if self._clipping.every_step:
            phases.append(self._clipping.norm_specs(slots))
        sum_bytes = sum_collectives = 0
        for phase in phases:
            collectives = plan_collectives(phase, self._slots.rank)
            sum_bytes += sum(c.bytes for c in collectives)
            sum_collectives += len(collectives)
        flag = self._flag.traffic(self._slots.members(slots))
        return compiled.traffic((sum_bytes, sum_collectives), flag)

    @property
    def bucket_buffer_bytes(self) -> int:
        return self._compiler.buffers.nbytes

    @property
    def work_bytes(self) -> int:
        return self._store.spare_bytes + self._scratch.nbytes + self._compiler.buffers.nbytes

    def memory_report(self, scratch_bytes: Callable[[Sequence[Slot]], int]) -> MemoryReport:
        """What this rank holds for the parameters it steps (see
        ``ShardedOptimizer.memory_report``); ``scratch_bytes``: the math's working buffers for
        a step of the given slots."""
        slots = self._slots.held()
        coming, keys = self._slots.coming()
        buffers = self._compiler.buffers.nbytes
        if coming and all(key is not None for key in keys):
            program = self._compiler.compiled(coming, keys).program  # type: ignore[arg-type]
            numels = (program.kept_numel, program.send_numel)
            buffers = sum(n * ITEMSIZE[dtype] for kind in numels for dtype, n in kind.items())
        params = grads = flat = own = masters = 0
        for slot in slots:
            local = slot.local_param()
            params += local.numel() * local.element_size()
            grads += local.numel() * local.element_size() if slot.param.requires_grad and not self._free_grads else 0
            slot_flat, slot_own, slot_master = self._store.predicted_bytes(slot)
            flat, own, masters = flat + slot_flat, own + slot_own, masters + slot_master
        states = flat + own
        # The second set of the flat buffers and of the own-layout states (the math writes new ones).
        spare = flat + masters + own if self._spare_states else 0
        scratch = scratch_bytes(slots) + self._driver.sum_buffer_bytes
        return MemoryReport(params, grads, states, masters, buffers, spare, scratch, fsdp_unsharded_bytes(slots))


def fsdp_unsharded_bytes(slots: Sequence[Slot]) -> int:
    """Over FSDP2's parameters, the unsharded parameters of the largest ``fully_shard`` group
    holding one of ``slots``: what FSDP2 keeps between steps besides the shards (measured by
    ``bench/bench_memory.py``: its all-gather buffers of one group stay resident). FSDP2 has no
    public way from a parameter to its group, so its module states are read; 0 without FSDP2."""
    mine = {id(slot.param) for slot in slots if is_dtensor(slot.param)}
    if not mine:
        return 0
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # another torch: no FSDP2 states to read
        return 0
    largest = 0
    for ref in list(_module_state_mapping.values()):
        state = ref()
        if not isinstance(state, FSDPState):
            continue
        for group in state._fsdp_param_groups:
            params = group.fsdp_params
            if any(id(p.sharded_param) in mine for p in params):
                dtypes = [getattr(p, "param_dtype", None) or p.sharded_param.dtype for p in params]
                unsharded = sum(p._orig_size.numel() * d.itemsize for p, d in zip(params, dtypes, strict=True))
                largest = max(largest, unsharded)
    return largest
