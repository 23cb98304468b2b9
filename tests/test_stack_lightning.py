"""PyTorch Lightning with ShardedAdamW (examples/train_lightning.py, runtime/stacks/lightning.py).

Four gloo ranks (with the environment torchrun would give them) run the example's ``main``:
Lightning wraps the model in DDP and trains it for 3 steps, once with ShardedAdamW on a ZeRO-1
spec, a warm-up schedule and ShardedDDPStrategy, once with torch.optim.AdamW, the same schedule
and Lightning's own DDPStrategy. The gradients are DDP's in both, so the parameters must be
equal bit for bit. The sharded run checkpoints at the end of its first epoch (step 2); two
ranks resume from it: the optimizer's whole states, its step count and the learning rate must
be those saved, the checkpoint file must hold no optimizer tensors (only the note naming the
folder), and step 3 on 2 ranks (the same global batch, summed in another order) must give the
4-rank run's parameters to rounding. The same 2 ranks check the errors of a checkpoint that
does not fit the optimizer.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.testing import run_ranks
from tests.conftest import EXAMPLES, REPO
from tests.stack_support import as_torchrun, example, parameters, whole_states

pytest.importorskip("lightning", reason="the Lightning stack is an optional extra: pip install -e '.[lightning]'")

CHECKPOINT = "epoch=0-step=2.ckpt"


def _train_on_four(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from lightning.pytorch import Callback

    as_torchrun(rank, world_size)
    module = example("train_lightning.py")
    saved: dict[int, Any] = {}
    wrapped: list[str] = []

    class Watch(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            wrapped.append(type(trainer.strategy.model).__name__)

        def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
            saved[trainer.global_step] = {
                "states": whole_states(trainer.optimizers[0]),
                "lr": trainer.lr_scheduler_configs[0].scheduler.get_last_lr(),
            }

    fit, model = module.main(["--output-dir", f"{folder}/sharded", "--steps", "3"], callbacks=[Watch()])
    reference, theirs = module.main(["--output-dir", f"{folder}/torch", "--steps", "3", "--torch"])
    return {
        "strategy": type(fit.strategy).__name__,
        "wrapped": wrapped,
        "steps": (fit.global_step, reference.global_step),
        "sharded": parameters(model),
        "torch": parameters(theirs),
        "saved": saved,
    }


def _resume_on_two(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from lightning.pytorch import Callback

    from runtime.checkpoint import CheckpointError
    from runtime.testing import attempt

    as_torchrun(rank, world_size)
    module = example("train_lightning.py")
    resumed: dict[str, Any] = {}

    class AtStart(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            resumed["states"] = whole_states(trainer.optimizers[0])
            resumed["lr"] = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()
            resumed["global_step"] = trainer.global_step

    argv = ["--output-dir", f"{folder}/resumed", "--steps", "3", "--resume", f"{folder}/sharded/{CHECKPOINT}"]
    fit, model = module.main(argv, callbacks=[AtStart()])
    # What does not fit: rank 0's pieces as Lightning's DDPStrategy saves them, a folder another
    # save replaced, a note where the optimizer is torch's.
    strategy = fit.strategy
    note = torch.load(f"{folder}/sharded/{CHECKPOINT}", weights_only=True)["optimizer_states"][0]
    pieces = {"optimizer_states": [fit.optimizers[0].state_dict()]}
    stale = {"optimizer_states": [note | {"metadata_sha256": "0" * 64}]}
    errors = {
        "pieces": attempt(lambda: strategy.load_optimizer_state_dict(pieces)),
        "stale": attempt(lambda: strategy.load_optimizer_state_dict(stale)),
    }
    strategy.optimizers = [torch.optim.AdamW(model.parameters())]
    errors["torch"] = attempt(lambda: strategy.load_optimizer_state_dict({"optimizer_states": [note]}))
    return resumed | {
        "finished": fit.global_step,
        "parameters": parameters(model),
        "errors": {k: (name, message) for k, (name, message, _) in errors.items()},
        "error_type": CheckpointError.__name__,
    }


@pytest.mark.slow
def test_lightning_with_sharded_adamw_equals_its_adamw_and_resumes_on_two_ranks(tmp_path: Path) -> None:
    four = run_ranks(_train_on_four, 4, (str(tmp_path),), timeout=240)
    for out in four:
        assert out["strategy"] == "ShardedDDPStrategy" and out["wrapped"] == ["DistributedDataParallel"]
        assert out["steps"] == (3, 3)
        assert out["sharded"].keys() == out["torch"].keys()
        for name, want in out["torch"].items():
            assert torch.equal(out["sharded"][name], want), f"{name} differs from Lightning's AdamW run"
    assert sorted(four[0]["saved"]) == [2, 3]  # every epoch (2 steps) and where max_steps ends the third step
    saved = four[0]["saved"][2]
    note = torch.load(tmp_path / "sharded" / CHECKPOINT, weights_only=True)["optimizer_states"]
    assert note == [{"shardlang": f"{CHECKPOINT}.shardlang/0", "metadata_sha256": note[0]["metadata_sha256"]}]
    assert (tmp_path / "sharded" / f"{CHECKPOINT}.shardlang" / "0" / "metadata.json").is_file()

    two = run_ranks(_resume_on_two, 2, (str(tmp_path),), timeout=240)
    for out in two:
        assert out["global_step"] == 2 and out["finished"] == 3
        assert out["lr"] == saved["lr"]
        assert out["states"].keys() == saved["states"].keys() and saved["states"]
        for key, want in saved["states"].items():
            assert torch.equal(out["states"][key], want), key
        for name, want in four[0]["sharded"].items():  # step 3 on 2 ranks as on 4, but for the sums' order
            torch.testing.assert_close(out["parameters"][name], want, rtol=1e-5, atol=1e-6, msg=name)
        errors = out["errors"]
        assert all(name == out["error_type"] for name, _ in errors.values()), errors
        assert "saved by process 0 alone" in errors["pieces"][1]
        assert "resume from an earlier one" in errors["stale"][1]
        assert "now it is AdamW" in errors["torch"][1]


def test_the_page_shows_the_examples_configure_optimizers() -> None:
    """docs/stacks/lightning.md includes the recipe by line numbers: they must still frame it."""
    page = (REPO / "docs" / "stacks" / "lightning.md").read_text(encoding="utf-8")
    found = re.search(r'--8<-- "examples/train_lightning.py:(\d+):(\d+)"', page)
    assert found, "the page no longer includes the recipe's lines"
    lines = (EXAMPLES / "train_lightning.py").read_text(encoding="utf-8").splitlines()
    shown = [line.strip() for line in lines[int(found[1]) - 1 : int(found[2])]]
    assert shown[0].startswith("def configure_optimizers(self)"), shown[0]
    assert shown[-1].startswith('return {"optimizer": optimizer'), shown[-1]
    assert any("ShardedAdamW(self.named_parameters()" in line for line in shown)
