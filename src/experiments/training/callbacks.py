"""The callbacks a run's config asks for (conf/callbacks/), and what EarlyStopping decided, for metrics.json."""

from pathlib import Path

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason
from omegaconf import DictConfig

from experiments.run.layout import RunPaths


def configured_callbacks(cfg: DictConfig, run_dir: Path) -> list[Callback]:
    """One callback per key of `cfg.callbacks` (a key set to null is left out). (`train/lr` is the module's own
    point: Lightning's LearningRateMonitor logs at the start of an iteration of Lightning's loop, which runs a
    window of steps that ends at a log step: experiments.training.windows.)"""
    callbacks = []
    for name, node in (cfg.callbacks or {}).items():
        if node is None:
            continue
        # The checkpoint's dir is part of the run dir's layout (resume and `ckpt_path=last` look there).
        runtime = {"dirpath": str(RunPaths(run_dir).checkpoints)} if name == "best_checkpoints" else {}
        callbacks.append(instantiate(node, **runtime))
    return callbacks


def early_stop_record(trainer: L.Trainer) -> dict:
    """metrics.json's `stopped_epoch` and `stop_reason` (`stop_message`: Lightning's own sentence), as the
    EarlyStopping callback recorded them; null when it did not stop the run or there is none."""
    stopper = trainer.early_stopping_callback
    if stopper is None or stopper.stopping_reason == EarlyStoppingReason.NOT_STOPPED:
        return {"stopped_epoch": None, "stop_reason": None, "stop_message": None}
    return {
        "stopped_epoch": stopper.stopped_epoch,
        "stop_reason": stopper.stopping_reason.name.lower(),  # patience_exhausted, stopping_threshold, ...
        "stop_message": stopper.stopping_reason_message,
    }
