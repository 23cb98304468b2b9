"""torch.distributed.checkpoint (DCP) with the sharded optimizers (runtime.optim.dcp).

Four gloo ranks train a tiny MLP for 3 steps (every rank the same batch, so gradients are the
same whole tensors everywhere) and save model and optimizer with ``dcp.save``: ShardedAdamW with
ZeRO rows (its parameters named as a DDP-wrapped model names them, ``module.``), ShardedCAME
on ``[dp=2,tp=2]`` states, and torch.optim.AdamW through ``get_optimizer_state_dict``. Two ranks
then load each into other layouts and train 2 more steps: ShardedAdamW from ours and from
torch's checkpoint, torch's AdamW from ours (``set_optimizer_state_dict``), ShardedCAME from
ours. The references are torch.optim.AdamW and came_pytorch.CAME trained 5 steps without a
break in the test process: AdamW bit for bit, CAME within 1e-5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import came_pytorch
import pytest
import torch

from runtime.optim.dcp import canonical_name
from runtime.testing import run_ranks

BEFORE, AFTER = 3, 2
LR = 1e-2
CAME_OPTIONS = {"lr": LR, "weight_decay": 0.1}


def model_at_start() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 30), torch.nn.Tanh(), torch.nn.Linear(30, 4))


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step))


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        model(batch(step)).square().mean().backward()
        optimizer.step()


def zero_spec(ranks: int) -> Any:
    import shardlang

    return shardlang.parse_spec(f"""
mesh world = [dp={ranks}]
rule "*.weight" {{ param = R,R over world  grad = R,R | P(dp):avg over world  state = S(dp),R over world }}
rule "*.bias"   {{ param = R over world    grad = R | P(dp):avg over world    state = S(dp) over world }}
""")


def tp_states_spec() -> Any:
    """CAME's states split over dp and tp (rows over dp, columns over tp)."""
    import shardlang

    return shardlang.parse_spec("""
mesh world = [dp=2,tp=2]
rule "*.weight" { param = R,R over world  grad = R,R | P(dp,tp):avg over world  state = S(dp),S(tp) over world }
rule "*.bias"   { param = R over world    grad = R | P(dp,tp):avg over world    state = S(tp) over world }
""")


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _save_on_four(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from runtime.optim import ShardedAdamW, ShardedCAME
    from runtime.optim.dcp import DCPLayoutError, OptimizerState

    out: dict[str, Any] = {}
    model = model_at_start()
    # As a DDP-wrapped model names its parameters: the checkpoint's names leave ``module.`` out.
    named = [(f"module.{n}", p) for n, p in model.named_parameters()]
    optimizer = ShardedAdamW(named, zero_spec(4), lr=LR)
    train(model, optimizer, range(BEFORE))
    dcp.save({"model": model.state_dict(), "optim": OptimizerState(optimizer)}, checkpoint_id=f"{folder}/ours")
    out["keys"] = sorted(OptimizerState(optimizer).state_dict()["state"])

    model = model_at_start()
    came = ShardedCAME(model.named_parameters(), tp_states_spec(), **CAME_OPTIONS)
    train(model, came, range(BEFORE))
    dcp.save({"model": model.state_dict(), "optim": OptimizerState(came)}, checkpoint_id=f"{folder}/came")

    model = model_at_start()
    reference = torch.optim.AdamW(model.parameters(), lr=LR)
    train(model, reference, range(BEFORE))
    theirs = get_optimizer_state_dict(model, reference)
    dcp.save({"model": model.state_dict(), "optim": theirs}, checkpoint_id=f"{folder}/torch")

    model = model_at_start()
    flat = ShardedAdamW(model.named_parameters(), zero_spec(4), lr=LR, flat_axis="dp")
    train(model, flat, range(1))
    try:
        OptimizerState(flat).state_dict()
    except DCPLayoutError as e:
        out["flat_error"] = str(e)
    return out


def _load_on_two(rank: int, world_size: int, folder: str) -> dict[str, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from runtime.optim import ShardedAdamW, ShardedCAME
    from runtime.optim.dcp import OptimizerState

    out = {}
    for source in ("ours", "torch"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 30), torch.nn.Tanh(), torch.nn.Linear(30, 4))  # other init
        optimizer = ShardedAdamW(model.named_parameters(), zero_spec(2), lr=0.5)  # the lr is loaded too
        dcp.load({"model": model.state_dict(), "optim": OptimizerState(optimizer)}, checkpoint_id=f"{folder}/{source}")
        train(model, optimizer, range(BEFORE, BEFORE + AFTER))
        out[f"sharded_from_{source}"] = state_of(model)

    model = torch.nn.Sequential(torch.nn.Linear(16, 30), torch.nn.Tanh(), torch.nn.Linear(30, 4))
    reference = torch.optim.AdamW(model.parameters(), lr=0.5)
    template = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, reference)}
    dcp.load(template, checkpoint_id=f"{folder}/ours")
    set_optimizer_state_dict(model, reference, template["optim"])
    train(model, reference, range(BEFORE, BEFORE + AFTER))
    out["torch_from_ours"] = state_of(model)

    model = torch.nn.Sequential(torch.nn.Linear(16, 30), torch.nn.Tanh(), torch.nn.Linear(30, 4))
    came = ShardedCAME(model.named_parameters(), zero_spec(2), **CAME_OPTIONS)
    dcp.load({"model": model.state_dict(), "optim": OptimizerState(came)}, checkpoint_id=f"{folder}/came")
    train(model, came, range(BEFORE, BEFORE + AFTER))
    out["came"] = state_of(model)
    return out


def reference(make: Any) -> dict[str, torch.Tensor]:
    model = model_at_start()
    train(model, make(model), range(BEFORE + AFTER))
    return state_of(model)


@pytest.mark.slow
def test_dcp_save_on_four_ranks_load_on_two(tmp_path: Path) -> None:
    saved = run_ranks(_save_on_four, 4, (str(tmp_path),), timeout=120)
    assert saved[0]["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]  # ``module.`` left out
    for out in saved:
        assert "flat ZeRO chunks" in out["flat_error"] and "runtime.checkpoint" in out["flat_error"]
    loaded = run_ranks(_load_on_two, 2, (str(tmp_path),), timeout=120)
    adamw = reference(lambda m: torch.optim.AdamW(m.parameters(), lr=LR))
    came = reference(lambda m: came_pytorch.CAME(m.parameters(), **CAME_OPTIONS))
    for out in loaded:
        for key in ("sharded_from_ours", "sharded_from_torch", "torch_from_ours"):
            for name, want in adamw.items():
                assert torch.equal(out[key][name], want), f"{key}: {name} differs from AdamW's uninterrupted run"
        for name, want in came.items():
            torch.testing.assert_close(out["came"][name], want, rtol=1e-5, atol=1e-6)


def test_canonical_names_leave_wrappers_out() -> None:
    assert canonical_name("module.h.0.attn.weight") == "h.0.attn.weight"
    assert canonical_name("module._orig_mod.lm_head.weight") == "lm_head.weight"
    assert canonical_name("layers.0._checkpoint_wrapped_module.w1.weight") == "layers.0.w1.weight"
    assert canonical_name("encoder.module.weight") == "encoder.module.weight"  # only DDP's, in front
