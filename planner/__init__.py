"""The planner: cheapest sequences of collectives (and point-to-point steps) between layouts,
under a cost model.

It knows the language (``shardlang``) and nothing of torch.distributed.
"""

from planner.cheapest import plan
from planner.cost import DEFAULT_ALPHA, DEFAULT_BANDWIDTH, PRICED_OPS, CostModel, OpCost, Regime
from planner.errors import PlanBudgetError, PlanError
from planner.holdings import receive_lower_bound
from planner.p2p import point_to_point_plan
from planner.plans import BASELINE_OPS, COMMUNICATING_OPS, OPS, Plan, Step, Transfer
from planner.search import DEFAULT_MAX_STATES

__all__ = [
    "BASELINE_OPS",
    "COMMUNICATING_OPS",
    "DEFAULT_ALPHA",
    "DEFAULT_BANDWIDTH",
    "DEFAULT_MAX_STATES",
    "OPS",
    "PRICED_OPS",
    "CostModel",
    "OpCost",
    "Plan",
    "PlanBudgetError",
    "PlanError",
    "Regime",
    "Step",
    "Transfer",
    "plan",
    "point_to_point_plan",
    "receive_lower_bound",
]
