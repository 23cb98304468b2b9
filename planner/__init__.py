"""The planner: cheapest sequences of collectives between layouts, under a cost model.

It knows the language (``shardlang``) and nothing of torch.distributed.
"""

from planner.cost import DEFAULT_ALPHA, DEFAULT_BANDWIDTH, CostModel, PlanError
from planner.plan import COMMUNICATING_OPS, OPS, Plan, Step
from planner.search import plan

__all__ = [
    "COMMUNICATING_OPS",
    "DEFAULT_ALPHA",
    "DEFAULT_BANDWIDTH",
    "OPS",
    "CostModel",
    "Plan",
    "PlanError",
    "Step",
    "plan",
]
