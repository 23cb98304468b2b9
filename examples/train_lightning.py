"""A small model trained by PyTorch Lightning with ShardedAdamW (docs/stacks/lightning.md).

    torchrun --standalone --nproc-per-node 4 examples/train_lightning.py --output-dir out/lightning --steps 3
    torchrun --standalone --nproc-per-node 2 examples/train_lightning.py --output-dir out/lightning --steps 5 \\
        --resume out/lightning/epoch=0-step=2.ckpt

Lightning wraps the model in DDP, which averages the gradients, so the spec is ZeRO-1: whole
gradients (already reduced), each rank keeping 1/N of every state, and a step all-gathers the
updated parameters. ``configure_optimizers`` runs after the wrapping, on the LightningModule
itself, so the names carry no ``module.``. ShardedDDPStrategy saves the optimizer's pieces
with runtime.checkpoint beside each checkpoint file (one per epoch, of 2 steps), so that
``--resume`` goes on from it on any number of ranks; each rank's batch is the global batch
over the number of ranks, so that a step sees the same samples on 2 ranks as on 4.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, TensorDataset

import shardlang
from runtime.optim import ShardedAdamW
from runtime.stacks.lightning import ShardedDDPStrategy

GLOBAL_BATCH, SAMPLES = 16, 32  # 2 steps an epoch, on any number of ranks


def warm_up(step: int) -> float:
    return min(1.0, (step + 1) / 3)


class Regression(pl.LightningModule):
    def __init__(self, sharded: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        self.sharded = sharded
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        if not self.sharded:
            return torch_optimizers(self)
        mesh = f"world = [dp={self.trainer.world_size}]"
        spec = shardlang.spec_for(self.named_parameters(), mesh, "zero1")  # DDP averages the gradients
        optimizer = ShardedAdamW(self.named_parameters(), spec, lr=1e-2, weight_decay=1e-2)
        scheduler = LambdaLR(optimizer, warm_up)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def torch_optimizers(model: pl.LightningModule) -> dict[str, Any]:
    """The same with torch's AdamW: the reference tests/test_stack_lightning.py compares with."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)
    scheduler = LambdaLR(optimizer, warm_up)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def data(world_size: int) -> DataLoader:
    """The same samples on every rank (Lightning's sampler splits them), GLOBAL_BATCH a step."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 16, generator=generator)
    y = torch.randn(SAMPLES, 4, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // world_size)


def trainer(output_dir: str, steps: int, sharded: bool = True, callbacks: Sequence[Any] = ()) -> pl.Trainer:
    """A Trainer on the ranks torchrun started: ShardedDDPStrategy, checkpointing every epoch
    (with ``sharded=False``: Lightning's own DDPStrategy and no checkpoints)."""
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    strategy = ShardedDDPStrategy if sharded else DDPStrategy
    saving = [ModelCheckpoint(dirpath=output_dir, every_n_epochs=1, save_top_k=-1)] if sharded else []
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // devices,
        strategy=strategy(process_group_backend="gloo"),
        max_steps=steps,
        callbacks=[*saving, *callbacks],
        enable_checkpointing=sharded,
        default_root_dir=output_dir,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def main(argv: Sequence[str] | None = None, callbacks: Sequence[Any] = ()) -> tuple[pl.Trainer, Regression]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--resume", default=None, help="a checkpoint file to go on from")
    parser.add_argument("--torch", action="store_true", help="torch.optim.AdamW and DDPStrategy (the reference)")
    args = parser.parse_args(argv)
    model = Regression(sharded=not args.torch)
    fit = trainer(args.output_dir, args.steps, sharded=not args.torch, callbacks=callbacks)
    fit.fit(model, data(fit.world_size), ckpt_path=args.resume)
    if fit.is_global_zero:
        first = fit.global_step - len(model.losses)
        for step, loss in enumerate(model.losses, start=first + 1):
            print(f"step {step}: loss {loss:.4f}")
    return fit, model


if __name__ == "__main__":
    main()
