"""accelerate's FSDP2 plugin with ShardedAdamW (examples/train_accelerate_fsdp2.py, runtime/stacks/fsdp2.py).

accelerate 1.16 takes its FSDP plugin only on GPUs and other accelerators: on CPU it sets
DistributedType.MULTI_CPU and wraps the model in DDP, saying nothing. The example's
``fsdp2_accelerator`` sets the type accelerate would have set, so that ``prepare`` runs
accelerate's own FSDP2 path (``fully_shard``, the parameters swapped) on 4 gloo ranks, as it
would on GPUs; the test checks that it did (the model an FSDP module, its parameters DTensors
sharded by rows).

Four ranks train a tiny MLP for 3 steps: ShardedAdamW on a ZeRO-3 spec over the DTensor
parameters, and torch.optim.AdamW as accelerate's FSDP2 gives it them. FSDP2 reduce-scatters the
gradients in both, so the parameters must be equal bit for bit. A 2-step run saves model and
optimizer with DCP; two ranks load it: the whole optimizer states and step counts must be those
saved, and step 3 (the same global batch, summed in another order) must give the 4-rank run's
parameters to rounding. An optimizer built before ``prepare`` (holding the parameters FSDP2
replaced) and a spec that does not say how FSDP2 shards a tensor are FSDP2Errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.testing import run_ranks
from tests.stack_support import as_torchrun, example, parameters, whole_states

pytest.importorskip("accelerate", reason="the Hugging Face stack is an optional extra: pip install -e '.[hf]'")

EXAMPLE = "train_accelerate_fsdp2.py"


def _train_on_four(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    import shardlang
    from runtime.optim import ShardedAdamW
    from runtime.stacks.fsdp2 import FSDP2Error, check_spec, prepare_fsdp2
    from runtime.testing import attempt

    as_torchrun(rank, world_size)
    module = example(EXAMPLE)
    ours, _, _ = module.train(module.sharded_adamw, 3)
    theirs, _, _ = module.train(module.torch_adamw, 3)
    saved_model, saved, _ = module.train(module.sharded_adamw, 2, save=f"{folder}/ckpt")
    placements = {n: str(p.placements) for n, p in ours.named_parameters()}

    # Built before prepare: accelerate swaps the sharded parameters into its param_groups, but
    # it placed (and would step) the old ones.
    accelerator = module.fsdp2_accelerator()
    model = module.tiny_model()
    zero1 = shardlang.spec_for(model.named_parameters(), f"world = [dp={world_size}]", "zero1")
    early = ShardedAdamW(model.named_parameters(), zero1, lr=1e-2)
    errors = {
        "before_prepare": attempt(lambda: prepare_fsdp2(accelerator, model, lambda _: early)),
        "spec": attempt(lambda: check_spec(saved_model.named_parameters(), zero1)),
    }
    return {
        "kind": type(ours).__name__,
        "placements": placements,
        "sharded": parameters(ours),
        "torch": parameters(theirs),
        "saved": whole_states(saved),
        "errors": {k: (name, message) for k, (name, message, _) in errors.items()},
        "error_type": FSDP2Error.__name__,
    }


def _resume_on_two(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    as_torchrun(rank, world_size)
    module = example(EXAMPLE)
    _, loaded, _ = module.train(module.sharded_adamw, 0, resume=f"{folder}/ckpt")
    model, stepped, _ = module.train(module.sharded_adamw, 1, resume=f"{folder}/ckpt")
    return {
        "states": whole_states(loaded),
        "steps": [h.step for h in loaded.optimizer.held_tensors()],
        "after": [h.step for h in stepped.optimizer.held_tensors()],
        "parameters": parameters(model),
    }


@pytest.mark.slow
def test_accelerate_fsdp2_with_sharded_adamw_equals_its_adamw_and_resumes_on_two_ranks(tmp_path: Path) -> None:
    four = run_ranks(_train_on_four, 4, (str(tmp_path),), timeout=240)
    for out in four:
        assert out["kind"].startswith("FSDP"), out["kind"]  # accelerate's FSDP2 path ran: fully_shard
        assert set(out["placements"].values()) == {"(Shard(dim=0),)"}, out["placements"]
        assert out["sharded"].keys() == out["torch"].keys()
        for name, want in out["torch"].items():
            assert torch.equal(out["sharded"][name], want), f"{name} differs from accelerate FSDP2 + torch AdamW"
        errors = out["errors"]
        assert all(name == out["error_type"] for name, _ in errors.values()), errors
        assert "built before FSDP2 sharded the model" in errors["before_prepare"][1]
        assert "FSDP2 shards it as 'S0,R" in errors["spec"][1] and "R,R" in errors["spec"][1]
    saved = four[0]["saved"]
    assert saved and all(torch.equal(v, four[1]["saved"][k]) for k, v in saved.items())
    assert (tmp_path / "ckpt" / ".metadata").is_file()

    two = run_ranks(_resume_on_two, 2, (str(tmp_path),), timeout=240)
    for out in two:
        assert out["steps"] == [2] * 4 and out["after"] == [3] * 4
        assert out["states"].keys() == saved.keys()
        for key, want in saved.items():
            assert torch.equal(out["states"][key], want), key
        for name, want in four[0]["sharded"].items():  # step 3 on 2 ranks as on 4, but for the sums' order
            torch.testing.assert_close(out["parameters"][name], want, rtol=1e-5, atol=1e-6, msg=name)
