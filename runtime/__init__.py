"""The runtime: executes reshard plans with torch.distributed, and simulates them in one process.

It is the one layer that communicates; it reads layouts (``shardlang``) and plans (``planner``).

* ``shard`` / ``unshard``: the piece each rank holds of a full tensor, and back (ground truth).
* ``simulate``: run a plan for every rank at once, in one process.
* ``reshard``: run a plan on the calling rank, collectives over the mesh axes' process groups,
  point-to-point steps with ``batch_isend_irecv``; across meshes every rank of either mesh calls.
* ``axis_group``: the calling rank's process group along some mesh axes.
* ``recording``: measure what each collective sent.
* ``shutdown``: end a rank's part in the job (a final barrier, then every group destroyed).
"""

from runtime.comm.collectives import DEFAULT_TIMEOUT
from runtime.comm.groups import axis_group, shutdown
from runtime.errors import DistributedError, PlanMismatchError, ReshardError
from runtime.execution.agreement import plan_fingerprint
from runtime.execution.executor import reshard
from runtime.execution.simulate import simulate
from runtime.measure.stats import CommLog, CommRecord, recording
from runtime.memory.dtypes import dtype_name, torch_dtype
from runtime.memory.pieces import shard, unshard

__all__ = [
    "DEFAULT_TIMEOUT",
    "CommLog",
    "CommRecord",
    "DistributedError",
    "PlanMismatchError",
    "ReshardError",
    "axis_group",
    "dtype_name",
    "plan_fingerprint",
    "recording",
    "reshard",
    "shard",
    "shutdown",
    "simulate",
    "torch_dtype",
    "unshard",
]
