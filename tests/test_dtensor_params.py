"""DTensor parameters the sharded optimizers refuse, with our error naming the tensor: a
_StridedShard that is no nesting order for the tensor's length (FSDP2 over TP on a [4, 2]
mesh), and a DTensor on a sub-mesh whose spec layouts disagree with its placements. One
process, a fake process group (nothing is communicated before the step)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from runtime.optim import OptimizerError, ShardedAdamW
from shardlang import parse_spec


@pytest.fixture
def world() -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield
    dist.destroy_process_group()


def test_a_strided_shard_that_is_no_nesting_order_is_refused(world: None) -> None:
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    # 9 rows as FSDP2 over TP places them; rank 0's piece is rows 0:2 either way.
    placements = (_StridedShard(0, split_factor=2), Shard(0))
    param = torch.nn.Parameter(
        DTensor.from_local(torch.zeros(2, 3), mesh, placements, shape=torch.Size((9, 3)), stride=(3, 1))
    )
    with pytest.raises(OptimizerError) as caught:
        ShardedAdamW([("w", param)], None)
    assert "tensor 'w'" in caught.value.message
    assert "DTensor gives mesh coordinate dp=3, tp=0 the elements [8:9]" in caught.value.message


SPEC = """
mesh world = [dp=4,tp=2]
rule "w" { param = S(tp),R over world  grad = S(tp),R | P(dp):avg over world  state = S(tp,dp),R over world }
rule "v" { param = R,R over world  grad = R,R | P(dp):avg over world  state = S(dp),R over world }
"""


def test_sub_mesh_layouts_must_agree_with_the_placements(world: None) -> None:
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    on_tp = DTensor.from_local(torch.zeros(3, 4), mesh["tp"], (Shard(0),), shape=torch.Size((6, 4)), stride=(4, 1))
    with pytest.raises(OptimizerError) as caught:
        ShardedAdamW([("v", torch.nn.Parameter(on_tp))], parse_spec(SPEC))
    assert "tensor 'v'" in caught.value.message
    assert "which on the spec's mesh is 'S(tp),R over world', but the spec gives it the param layout 'R,R" in (
        caught.value.message
    )
    param = torch.nn.Parameter(on_tp)
    optimizer = ShardedAdamW([("w", param)], parse_spec(SPEC))
    param.grad = DTensor.from_local(
        torch.zeros(6, 4), mesh["tp"], (Replicate(),), shape=torch.Size((6, 4)), stride=(4, 1)
    )
    with pytest.raises(OptimizerError) as caught:
        optimizer.step_plan()
    assert "tensor 'w': its gradient lies as 'R,R over mesh[tp=2]" in caught.value.message
    assert "says 'S(tp),R over world' on those axes" in caught.value.message
