"""What a sharded optimizer's step will communicate and what its rank holds, predicted from the
layouts and the step plan (``planned_traffic``, ``memory_report``) or read from the buffers it
keeps (``work_bytes``, ``bucket_buffer_bytes``); docs/memory.md says what each part is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from planner.memory import RankTensor, contiguous_in, rank_memory
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
from shardlang.dtypes import DTYPES, ITEMSIZE
from shardlang.interop import is_dtensor

# shardlang's name of every torch dtype it has one for (planner.memory sizes by name).
DTYPE_NAMES: dict[torch.dtype, str] = {getattr(torch, attr): name for name, (_, attr) in DTYPES.items()}


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
        transactional: bool,
        free_grads: bool,
    ) -> None:
        self._slots, self._store, self._compiler, self._driver = slots, store, compiler, driver
        self._clipping, self._flag, self._scratch = clipping, flag, scratch
        self._transactional, self._free_grads = transactional, free_grads

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

    def memory_report(
        self, optimizer: str, *, fused: bool, kept: int, iterated: Sequence[tuple[int, int]]
    ) -> MemoryReport:
        """What this rank holds for the parameters it steps (see
        ``ShardedOptimizer.memory_report``): ``planner.memory.rank_memory`` of the live slots'
        sizes, the same accounting ``predict_memory`` feeds a spec's tensors; ``optimizer``:
        its name there, ``fused``: AdamW's fused kernel, ``kept``: working buffers only the live
        optimizer knows (CAME's copies of states that lie in no one range, Muon's wave buffers), ``iterated``: the
        shapes of the matrices this rank runs Newton-Schulz iterations on (Muon)."""
        slots = self._slots.held()
        coming, keys = self._slots.coming()
        buffers = self._compiler.buffers.nbytes
        if coming and all(key is not None for key in keys):
            program = self._compiler.compiled(coming, keys).program  # type: ignore[arg-type]
            numels = (program.kept_numel, program.send_numel)
            buffers = sum(n * ITEMSIZE[dtype] for kind in numels for dtype, n in kind.items())
        runs, last, run = [], None, -1
        for slot in slots:  # the runs the math steps the slots in (runtime.optim.phases.StepWork.runs)
            key = (id(slot.group), slot.step, slot.dtype, slot.local_param().device)
            if slot.shard is not None and key != last:
                run, last = run + 1, key
            runs.append(run)
        return rank_memory(
            [self._rank_tensor(slot, run) for slot, run in zip(slots, runs, strict=True)],
            optimizer,
            buffers=buffers,
            transactional=self._transactional,
            fused=fused,
            free_grads=self._free_grads,
            kept=kept,
            wrapper=fsdp_unsharded_bytes(slots),
            iterated=iterated,
            cpu=all(slot.local_param().device.type == "cpu" for slot in slots),
            clip=self._clipping.norm_taken,
        )

    def _rank_tensor(self, slot: Slot, run: int) -> RankTensor:
        """The slot as ``planner.memory.rank_memory`` sizes it, stepped in ``run``."""
        local = slot.local_param()
        param = local.numel() * local.element_size()
        grad = param if slot.param.requires_grad else 0
        if slot.shard is None:
            return RankTensor(param, grad, 0, 0, 0, "f32")
        flat, own, master = self._store.predicted_bytes(slot)
        shard = slot.shard
        elements = math.prod(shard.local_shape)
        if shard.flat_range is None:
            chunk = math.prod(shard.layout.local_shape(shard.shape))
        else:
            chunk = -(-math.prod(shard.block_shape) // shard.layout.mesh.shape[shard.flat_axis])
        short, converted = elements < chunk, local.dtype != slot.dtype
        strided = shard.flat_range is None and not contiguous_in(shard.block_shape, tuple(local.shape))
        dtype = DTYPE_NAMES[slot.dtype]
        flat_matrix = shard.flat_range is not None and shard.factored
        return RankTensor(
            param, grad, flat + own, master, elements, dtype, short, converted, strided, flat_matrix, shard, run
        )


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
