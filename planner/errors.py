"""The planner's errors: what a request for a plan can fail with."""

from __future__ import annotations

from shardlang.errors import ShardlangError


class PlanError(ShardlangError):
    """No plan exists (or the request is malformed): names the layouts and the reason."""


class PlanBudgetError(PlanError):
    """The search for a plan used up its budget (``max_states``, see ``planner.search``) before
    it finished: names the pair, the budget, and what to change."""
