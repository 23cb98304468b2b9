"""Sharded optimizers driven by layout specs: AdamW, CAME, Adafactor and Muon on shards, exact.

    spec = shardlang.load_spec("examples/tiny_gpt_dp4.shard")
    optimizer = runtime.optim.ShardedCAME(model.named_parameters(), spec, lr=1e-3)
    loss.backward(); optimizer.step()

Each step reshards every gradient from its grad layout to its state layout, runs the math
on the local shards, and reshards the parameter back to its param layout; see ``base``.
"""

from runtime.optim.adafactor import ShardedAdafactor
from runtime.optim.adamw import ShardedAdamW
from runtime.optim.base import ShardedOptimizer, StepTraffic
from runtime.optim.came import ShardedCAME
from runtime.optim.errors import OptimizerError, OptimizerStepError
from runtime.optim.muon import ShardedMuon

__all__ = [
    "OptimizerError",
    "OptimizerStepError",
    "ShardedAdafactor",
    "ShardedAdamW",
    "ShardedCAME",
    "ShardedMuon",
    "ShardedOptimizer",
    "StepTraffic",
]
