"""The Hugging Face Trainer's ``fsdp=`` option (FSDP2) with ShardedAdamW
(examples/train_hf_trainer_fsdp.py, runtime/stacks/hf.py: ``ShardedTrainer(make_optimizer=...)``).

Four gloo ranks train a tiny GPT-2 for 3 steps with ``TrainingArguments(fsdp=True,
fsdp_config={"version": 2})``: once with ShardedAdamW on a ZeRO-3 spec built by
``make_optimizer`` from the model FSDP2 sharded, once with the Trainer's own AdamW
(``optim="adamw_torch"``), the same linear warm-up schedule and gradient clipping in both.
FSDP2 reduce-scatters the gradients in both runs, so the parameters must be equal bit for bit.
On CPU accelerate takes no FSDP plugin (the Trainer would run DDP); the example's ``FSDPOnCPU``
sets what accelerate sets on GPUs, and the test checks that FSDP2 ran (the model an FSDP
module, its parameters DTensors sharded by rows). FSDP1 (``version: 1``, flat parameters) is
refused with our error. The sharded run checkpoints at step 2 (the Trainer's FSDP model file
and the optimizer's pieces); two ranks resume from it: the whole optimizer states, step counts,
learning rate and parameters must be those saved, and training goes on to step 3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.testing import run_ranks
from tests.stack_support import as_torchrun, example, parameters, trainer_recorder, whole_states

pytest.importorskip("transformers", reason="the Hugging Face stack is an optional extra: pip install -e '.[hf]'")
pytest.importorskip("accelerate", reason="the Hugging Face stack is an optional extra: pip install -e '.[hf]'")

EXAMPLE = "train_hf_trainer_fsdp.py"


def _train(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from runtime.optim import OptimizerError
    from runtime.testing import attempt

    as_torchrun(rank, world_size)
    module = example(EXAMPLE)
    saved: dict[int, Any] = {}
    initial = parameters(module.tiny_gpt2())
    argv = ["--output-dir", f"{folder}/sharded", "--steps", "3"]
    trainer = module.main(argv, callbacks=[trainer_recorder(saved, {})])
    reference = module.torch_trainer(f"{folder}/torch", 3)
    reference.train()
    # FSDP1: the process's accelerate state (shared) holds the runs' FSDP2 plugin; make it version 1.
    fsdp1 = module.ShardedFSDPTrainer(
        model=module.tiny_gpt2(),
        args=module.arguments(f"{folder}/fsdp1", 1),
        train_dataset=module.Tokens(),
        make_optimizer=module.sharded_adamw,
    )
    fsdp1.accelerator.state.fsdp_plugin.fsdp_version = 1
    refused = attempt(fsdp1.create_optimizer)
    return {
        "kinds": (type(trainer.model).__name__, type(reference.model).__name__),
        "placements": {n: str(p.placements) for n, p in trainer.model.named_parameters()},
        "initial": initial,
        "sharded": parameters(trainer.model),
        "torch": parameters(reference.model),
        "states": len(whole_states(trainer.optimizer)),
        "saved": saved[2],
        "lrs": (trainer.lr_scheduler.get_last_lr(), reference.lr_scheduler.get_last_lr()),
        "refused": refused[:2],
        "error_type": OptimizerError.__name__,
    }


def _resume_on_two(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    as_torchrun(rank, world_size)
    module = example(EXAMPLE)
    resumed: dict[str, Any] = {}
    argv = ["--output-dir", f"{folder}/sharded", "--steps", "3", "--resume", f"{folder}/sharded/checkpoint-2"]
    trainer = module.main(argv, callbacks=[trainer_recorder({}, resumed)])
    after = [h.step for h in trainer.optimizer.optimizer.held_tensors()]
    finite = all(p.isfinite().all() for p in parameters(trainer.model).values())
    return resumed | {"finished": trainer.state.global_step, "after": after, "finite": finite}


@pytest.mark.slow
def test_trainer_fsdp_with_sharded_adamw_equals_its_adamw_and_resumes_on_two_ranks(tmp_path: Path) -> None:
    four = run_ranks(_train, 4, (str(tmp_path),), timeout=300)
    for out in four:
        assert all(kind.startswith("FSDP") for kind in out["kinds"]), out["kinds"]  # FSDP2 ran, not DDP
        assert set(out["placements"].values()) == {"(Shard(dim=0),)"}, out["placements"]
        assert out["states"] > 0 and set(out["lrs"][0]) == set(out["lrs"][1])  # the Trainer has two groups
        assert out["sharded"].keys() == out["torch"].keys() == out["initial"].keys()
        for name, want in out["torch"].items():
            assert not torch.equal(want, out["initial"][name]), f"{name} did not train"
            assert torch.equal(out["sharded"][name], want), f"{name} differs from the Trainer's FSDP2 + AdamW"
        name, message = out["refused"]
        assert name == out["error_type"] and "fsdp_config version 2" in message, out["refused"]
    saved = four[0]["saved"]
    assert saved["states"] and all(torch.equal(v, four[1]["saved"]["states"][k]) for k, v in saved["states"].items())

    for out in run_ranks(_resume_on_two, 2, (str(tmp_path),), timeout=300):
        assert out["global_step"] == 2 and out["finished"] == 3 and out["finite"]
        assert set(out["steps"]) == {2} and set(out["after"]) == {3}, (out["steps"], out["after"])
        assert out["lr"] == saved["lr"]
        assert out["states"].keys() == saved["states"].keys()
        for key, want in saved["states"].items():
            assert torch.equal(out["states"][key], want), key
        for name, want in saved["parameters"].items():  # the Trainer's FSDP model file, loaded on 2 ranks
            assert torch.equal(out["parameters"][name], want), name
