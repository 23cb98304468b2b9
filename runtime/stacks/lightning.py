"""A sharded optimizer inside PyTorch Lightning (docs/stacks/lightning.md).

    class Model(lightning.pytorch.LightningModule):
        def configure_optimizers(self):
            mesh = f"world = [dp={self.trainer.world_size}]"
            spec = shardlang.spec_for(self.named_parameters(), mesh, "zero1")   # DDP averages the gradients
            return ShardedAdamW(self.named_parameters(), spec, lr=1e-3)

    trainer = Trainer(accelerator="cpu", devices=4, strategy=ShardedDDPStrategy(process_group_backend="gloo"))

Lightning's checkpoint holds ``optimizer.state_dict()`` as process 0 has it, which for a
sharded optimizer is rank 0's pieces only (another rank loading them would take rank 0's).
:class:`ShardedDDPStrategy` is Lightning's ``DDPStrategy`` whose checkpoints hold each sharded
optimizer through ``runtime.checkpoint`` instead: every rank saves its pieces into a folder
beside the checkpoint file (``epoch=0-step=2.ckpt.shardlang/0`` for the first optimizer), the
file keeps only a note naming that folder and the SHA-256 of its metadata (a folder that a
later save replaced is refused), and loading reads the folder on any number of ranks.
The rest of the checkpoint (weights, loops, lr schedulers, callbacks) is Lightning's.
Other optimizers are saved and loaded as ``DDPStrategy`` does.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from torch.optim import Optimizer

from runtime.checkpoint import CheckpointError
from runtime.checkpoint import load as load_pieces
from runtime.checkpoint import save as save_pieces
from runtime.checkpoint.metadata import METADATA_FILE
from runtime.optim import ShardedOptimizer

# The note a Lightning checkpoint holds in place of a sharded optimizer's state: its folder,
# relative to the checkpoint file's, and the SHA-256 of the metadata saved there.
NOTE = "shardlang"
SUFFIX = ".shardlang"  # the folder beside ``epoch=0-step=2.ckpt``: ``epoch=0-step=2.ckpt.shardlang``


def sharded_optimizer(optimizer: Any) -> ShardedOptimizer | None:
    """The sharded optimizer inside ``optimizer`` (Lightning wraps it), or ``None``."""
    inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    return inner if isinstance(inner, ShardedOptimizer) else None


def shardlang_folder(filepath: str | Path) -> Path:
    """Where :class:`ShardedDDPStrategy` keeps the sharded optimizers of the checkpoint file
    ``filepath`` (one subfolder per optimizer, by its index)."""
    text = str(filepath)
    if "://" in text and not text.startswith("file://"):
        raise CheckpointError(
            f"{text}: runtime.checkpoint writes to a file system every rank sees, not to a remote store"
        )
    return Path(text.removeprefix("file://") + SUFFIX)


class ShardedDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` whose checkpoints hold sharded optimizers through
    ``runtime.checkpoint`` (module docstring). Saving is collective: every rank must call
    ``trainer.save_checkpoint`` (``ModelCheckpoint`` does)."""

    strategy_name = "shardlang_ddp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loaded_from: Path | None = None  # the checkpoint file being resumed from

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if sharded_optimizer(optimizer) is not None:
            return {NOTE: None}  # the folder is named by save_checkpoint, which knows the file
        return super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        states = checkpoint.get("optimizer_states")  # absent from a weights-only save
        if states is not None:
            folder = shardlang_folder(filepath)
            for index, optimizer in enumerate(self.optimizers):
                sharded = sharded_optimizer(optimizer)
                if sharded is None:
                    continue
                save_pieces(folder / str(index), optimizer=sharded)
                states[index] = {NOTE: f"{folder.name}/{index}", "metadata_sha256": digest(folder / str(index))}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            shutil.rmtree(shardlang_folder(filepath), ignore_errors=True)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self._loaded_from = Path(str(checkpoint_path))
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        for index, (optimizer, state) in enumerate(zip(self.optimizers, states, strict=False)):
            sharded = sharded_optimizer(optimizer)
            noted = isinstance(state, Mapping) and NOTE in state
            if sharded is not None and noted:
                self._load_sharded(index, sharded, state)
            elif sharded is not None:
                raise CheckpointError(
                    f"{self._source()}: optimizer {index} is a {type(sharded).__name__}, but the checkpoint holds a "
                    "state dict saved by process 0 alone (its pieces only); save with ShardedDDPStrategy "
                    "(docs/stacks/lightning.md)"
                )
            elif noted:
                raise CheckpointError(
                    f"{self._source()}: optimizer {index} was saved as a sharded optimizer "
                    f"({state[NOTE]}), but now it is {type(optimizer).__name__}"
                )
            else:  # as DDPStrategy loads it
                optimizer.load_state_dict(state)
                _optimizer_to_device(optimizer, self.root_device)

    def _load_sharded(self, index: int, optimizer: ShardedOptimizer, note: Mapping[str, Any]) -> None:
        if self._loaded_from is None:
            raise CheckpointError(
                f"optimizer {index}: the checkpoint names {note[NOTE]!r} but not which file it came from "
                "(load it with trainer.fit(ckpt_path=...))"
            )
        folder = self._loaded_from.parent / note[NOTE]
        found = digest(folder)  # the same on every rank: one file
        if found is None:
            raise CheckpointError(
                f"{folder}: no runtime.checkpoint checkpoint there, where {self._loaded_from.name} keeps its "
                f"sharded optimizer {index} (moved without its folder?)"
            )
        if found != note.get("metadata_sha256"):
            raise CheckpointError(
                f"{folder}: not the sharded optimizer {index} that {self._loaded_from.name} was saved with "
                "(a save interrupted after this folder was written and before the file; resume from an earlier one)"
            )
        load_pieces(folder, optimizer=optimizer)

    def _source(self) -> str:
        return str(self._loaded_from) if self._loaded_from is not None else "the checkpoint"


def digest(folder: Path) -> str | None:
    """The SHA-256 of the metadata of the ``runtime.checkpoint`` checkpoint in ``folder``
    (``None`` where there is none)."""
    try:
        return hashlib.sha256((folder / METADATA_FILE).read_bytes()).hexdigest()
    except FileNotFoundError:
        return None
