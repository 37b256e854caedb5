"""`checkpoints/last.ckpt`, the position a run resumes from: written at every epoch's end by default, every N
optimizer steps or M minutes when asked (`checkpoint.*` in conf/config.yaml), at a signal (run.interruption) and
when training ends; always whole (run.files.AtomicCheckpointIO), and never with diverged weights.

Lightning 2.6's `ModelCheckpoint(save_last=True, save_top_k=0)` writes `last` only in a step where it also saved
a top-k checkpoint (`on_train_epoch_end` and `on_validation_end` save it only when `_last_global_step_saved ==
global_step`), so it never does at an epoch's end, and a hard kill lost the whole run. The user's ModelCheckpoint
(conf/callbacks/) stays Lightning's own, for top-k copies; last.ckpt is this callback's.

It is also the one callback that adds the run's record to every checkpoint (config, column names, provenance)
and checks the weights before any save. One callback for the three: Lightning calls every hook of every callback
on every step, so each callback costs each step, and this one adds nothing per step unless every_n_train_steps
or every_n_minutes is set (then a comparison a step).
"""

import dataclasses
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Checkpoint
from omegaconf import DictConfig, OmegaConf

from experiments import internals
from experiments.run.files import IN_PLACE_LATER
from experiments.training.checkpoint import RECORD_KEY
from experiments.training.divergence import check_before_saving
from experiments.training.log_steps import ends_optimizer_step, is_log_step


class LastCheckpoint(Checkpoint):
    """A `Checkpoint` (Lightning's base class), so that Lightning runs its epoch-end hook after EarlyStopping's
    and the saved position includes that epoch's stopping decision: resumed, the run stops where an
    uninterrupted one does."""

    def __init__(
        self,
        path: Path,
        cfg: DictConfig,
        every_n_epochs: int = 1,
        every_n_train_steps: int | None = None,
        every_n_minutes: float | None = None,
    ):
        self.path = str(path)
        self.every_n_epochs = every_n_epochs
        self.every_n_train_steps = every_n_train_steps
        self.every_n_seconds = None if every_n_minutes is None else 60.0 * every_n_minutes
        # What eval.py and predict.py need and the weights do not say: the run's composed config (unresolved, as
        # in .hydra/config.yaml, so eval can rebuild the run's data), the data's feature and target names (None
        # without names), and what produced the run. Plain values only: it loads with weights_only=True.
        self.record = {
            "config": OmegaConf.to_container(cfg, resolve=False),
            "feature_names": None,
            "target_name": None,
            "batch_fit": None,
            "provenance": None,
        }
        self.saved_step: int | None = None
        self.save_seconds: list[float] = []  # each periodic save's wall time (metrics.json's checkpoint_save_ms)
        self.seconds_saving = 0.0  # every save's, the final one's too: the training clock leaves it out (perf)
        self._last_save_time = time.monotonic()

    def describe_data(self, cfg: DictConfig, feature_names: list[str] | None, target_name: str | None, batch_fit=None):
        """Once the data is read: the config as the run trains with it (batch.effective may have chosen its batch),
        the data's column names (None without names), and batch.effective's fit (None when off), which a resumed
        run keeps."""
        self.record["config"] = OmegaConf.to_container(cfg, resolve=False)
        self.record["feature_names"] = None if feature_names is None else list(feature_names)
        self.record["target_name"] = target_name
        self.record["batch_fit"] = None if batch_fit is None else dataclasses.asdict(batch_fit)

    def describe_origin(self, provenance: dict | None) -> None:
        self.record["provenance"] = provenance

    @property
    def summary(self) -> dict:
        seconds = self.save_seconds
        return {
            "checkpoints_saved": len(seconds),
            "checkpoint_save_ms": 1000 * sum(seconds) / len(seconds) if seconds else None,
        }

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_save_time = time.monotonic()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        if self.every_n_train_steps is None and self.every_n_seconds is None:
            return
        if not ends_optimizer_step(trainer):  # mid accumulation, the gradients gathered so far would be lost
            return
        due = bool(self.every_n_train_steps) and trainer.global_step % self.every_n_train_steps == 0
        if not due and self.every_n_seconds is not None and is_log_step(trainer):
            # The clock is read on log steps only, and rank 0's verdict taken, so that every rank saves together.
            due = time.monotonic() - self._last_save_time >= self.every_n_seconds
            if trainer.world_size > 1:
                due = trainer.strategy.broadcast(due)
        if due:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer, timed=False)  # the final position, for eval.py, predict.py and ckpt_path=last

    def _save(self, trainer: L.Trainer, timed: bool = True) -> None:
        if self.saved_step == trainer.global_step:
            return
        started = time.perf_counter()
        if timed:
            # The periodic save: the ranks go on while rank 0 writes (they meet again at the next all-reduce), and
            # rank 0 while a thread puts the written file in place (the next save and the fit's end wait for it).
            internals.save_checkpoint_without_barrier(trainer, self.path, storage_options=IN_PLACE_LATER)
        else:
            # The final position: every rank leaves the fit only once it is on disk.
            trainer.save_checkpoint(self.path, weights_only=False)  # said, or Lightning logs that it assumed it
        self.saved_step = trainer.global_step
        self._last_save_time = time.monotonic()
        seconds = time.perf_counter() - started
        self.seconds_saving += seconds
        if timed:
            self.save_seconds.append(seconds)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        check_before_saving(trainer, pl_module)  # every save passes here: ours, a signal's, ModelCheckpoint's
        checkpoint[RECORD_KEY] = self.record
