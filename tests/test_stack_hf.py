"""The Hugging Face Trainer and accelerate with ShardedAdamW (examples/train_hf_trainer.py,
examples/train_accelerate.py, runtime/stacks/hf.py).

Four gloo ranks (with the environment torchrun would give them) run the example's ``main`` and
train a tiny GPT-2 for 3 steps through the Trainer, which wraps it in DDP: once with ShardedAdamW on a ZeRO-1 spec and a
warm-up schedule, once with torch.optim.AdamW and the same schedule. The gradients are DDP's
in both, so the parameters must be equal bit for bit. The sharded run checkpoints at step 2;
two ranks resume from it: the optimizer's whole states, its step count and the schedule must
be those saved, and training goes on to step 3. The same four ranks run the accelerate loop
(DDP again) with ShardedAdamW and with torch.optim.AdamW: equal bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.testing import run_ranks
from tests.stack_support import as_torchrun, example, parameters, trainer_recorder

pytest.importorskip("transformers", reason="the Hugging Face stack is an optional extra: pip install -e '.[hf]'")
pytest.importorskip("accelerate", reason="the Hugging Face stack is an optional extra: pip install -e '.[hf]'")


def _train_on_four(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    as_torchrun(rank, world_size)
    module = example("train_hf_trainer.py")
    saved: dict[int, Any] = {}
    argv = ["--output-dir", f"{folder}/sharded", "--steps", "3"]
    trainer = module.main(argv, callbacks=[trainer_recorder(saved, {})])
    reference = module.torch_trainer(f"{folder}/torch", 3)
    reference.train()
    names = [n for n, _ in trainer.model.named_parameters()]
    assert names == [n for n, _ in reference.model.named_parameters()]
    loop = example("train_accelerate.py")
    ours, _ = loop.train(loop.sharded_adamw, 3)
    theirs, _ = loop.train(lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2), 3)
    pairs = zip(ours.parameters(), theirs.parameters(), strict=True)
    return {
        "accelerate": [(a.detach().clone(), b.detach().clone()) for a, b in pairs],
        "wrapped": type(trainer.model_wrapped).__name__,
        "sharded": parameters(trainer.model),
        "torch": parameters(reference.model),
        "saved": saved,
    }


def _resume_on_two(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    as_torchrun(rank, world_size)
    module = example("train_hf_trainer.py")
    resumed: dict[str, Any] = {}
    argv = ["--output-dir", f"{folder}/sharded", "--steps", "3", "--resume", f"{folder}/sharded/checkpoint-2"]
    trainer = module.main(argv, callbacks=[trainer_recorder({}, resumed)])
    params = parameters(trainer.model)
    return resumed | {"finished": trainer.state.global_step, "finite": all(p.isfinite().all() for p in params.values())}


@pytest.mark.slow
def test_trainer_with_sharded_adamw_equals_its_adamw_and_resumes_on_two_ranks(tmp_path: Path) -> None:
    four = run_ranks(_train_on_four, 4, (str(tmp_path),), timeout=240)
    for out in four:
        assert out["wrapped"] == "DistributedDataParallel"
        for name, want in out["torch"].items():
            assert torch.equal(out["sharded"][name], want), f"{name} differs from the Trainer's AdamW run"
        for ours, theirs in out["accelerate"]:
            assert torch.equal(ours, theirs), "accelerate: ShardedAdamW differs from torch.optim.AdamW"
    assert sorted(four[0]["saved"]) == [2, 3]  # every 2 steps and at the end
    saved = four[0]["saved"][2]
    assert (tmp_path / "sharded" / "checkpoint-2" / "shardlang" / "metadata.json").is_file()
    two = run_ranks(_resume_on_two, 2, (str(tmp_path),), timeout=240)
    for out in two:
        assert out["global_step"] == 2 and out["finished"] == 3 and out["finite"]
        assert out["lr"] == saved["lr"]
        assert out["states"].keys() == saved["states"].keys() and saved["states"]
        for key, want in saved["states"].items():
            assert torch.equal(out["states"][key], want), key
