"""The Hydra entry point: seed, build, fit, record.

`train(cfg, run_dir)` is a plain function that tests call with a composed config; `main` adds Hydra.
"""

import os
import signal
import sys
import time
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

from experiments.callbacks import configured_callbacks, early_stop_record
from experiments.checks import ConfigError, check_config, resolve_checkpoint
from experiments.failures import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    Interrupted,
    Interruption,
    RunFailed,
    end_with_parent,
    out_of_memory,
)
from experiments.module import Regressor
from experiments.perf import PerfMonitor
from experiments.records import AtomicCheckpointIO, final_figures, run_record, write_metrics
from experiments.strategies import check_strategy, ranks_join_this_job
from experiments.summary import print_summary, quiet_lightning


def train(cfg: DictConfig, run_dir: Path) -> dict:
    started = time.perf_counter()
    quiet_lightning()
    check_config(cfg)
    check_strategy(cfg)
    if "LOCAL_RANK" in os.environ:  # started by a launcher, not by the user
        end_with_parent()
    ckpt_path = resolve_checkpoint(cfg.ckpt_path, run_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    data = instantiate(cfg.data)
    data.setup("fit")
    in_features = cfg.model.in_features or data.num_features
    if in_features != data.num_features:
        raise ConfigError(
            f"model.in_features={in_features} does not match the data's {data.num_features} features; "
            "allowed: null (follow the data) or the data's feature count"
        )
    net = instantiate(cfg.model, in_features=in_features)
    module = Regressor(
        net, instantiate(cfg.optimizer), data.feature_mean, data.feature_std, scheduler=instantiate(cfg.scheduler)
    )

    perf = PerfMonitor(global_batch_size=cfg.data.batch_size)
    # A signal saves the exact position over last.ckpt, so that `ckpt_path=last` resumes from it.
    interruption = Interruption(str(run_dir / "checkpoints" / "last.ckpt"))
    logger = instantiate(cfg.logger, save_dir=str(run_dir)) if cfg.logger else False
    callbacks = [perf, interruption, *configured_callbacks(cfg, run_dir)]
    if cfg.trainer.enable_progress_bar:
        # Lightning's default bar redraws on every step, which costs as much as a step of a small model:
        # redraw when the logger writes.
        callbacks.append(TQDMProgressBar(refresh_rate=cfg.trainer.log_every_n_steps))
    trainer = instantiate(
        cfg.trainer, callbacks=callbacks, logger=logger, plugins=[AtomicCheckpointIO()], default_root_dir=run_dir
    )

    status = "failed"
    try:
        with ranks_join_this_job():
            trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        status = "completed"
    except Interrupted:
        status = "interrupted"
        raise
    except torch.OutOfMemoryError as err:
        raise out_of_memory(err, cfg.data.batch_size, cfg.trainer.accumulate_grad_batches) from None
    finally:
        train_loss = getattr(module, "last_loss", None)  # the last step's, logged or not
        # A failed run's weights may be unusable (diverged), and after running out of memory, measuring
        # them could run out again: its fit is left blank.
        unmeasured = {"val_mse": None, "val_r2": None, "optimal_val_mse": data.optimal_val_mse}
        metrics = {
            **run_record(trainer, status, cfg.data.batch_size),
            **(final_figures(module.net, data) if status != "failed" else unmeasured),
            "train_loss": None if train_loss is None else train_loss.item(),
            **perf.summary,
            **early_stop_record(trainer),
            "data_device": str(data.x_train.device),
            "wall_time_s": time.perf_counter() - started,
        }
        if trainer.is_global_zero:
            write_metrics(run_dir / "metrics.json", metrics)
            log_hparams(trainer, cfg, metrics)
            print_summary(metrics, run_dir)
    return metrics


def log_hparams(trainer: L.Trainer, cfg: DictConfig, metrics: dict) -> None:
    """The run's config with its final figures, for TensorBoard's hparams tab."""
    params = OmegaConf.to_container(cfg, resolve=True)
    final = {f"final/{k}": v for k, v in metrics.items() if isinstance(v, float)}
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.log_hyperparams(params, final)
        else:
            logger.log_hyperparams(params)
        logger.finalize(metrics["status"])


def run_sweep_job(cfg: DictConfig) -> dict:
    """One job of a multirun. It raises, never exits: Hydra records a job that raises as failed and runs the
    others (a SystemExit would end the whole sweep), then re-raises the first failure, so the sweep exits 1."""
    hydra_cfg = HydraConfig.get()
    if cfg.logger and cfg.logger._target_.endswith("TensorBoardLogger"):
        # Name the job's TensorBoard run after its overrides, so `tensorboard --logdir <sweep dir>` tells
        # the jobs apart (`<job num>/tensorboard/data.batch_size=64,...`).
        cfg.logger.version = hydra_cfg.job.override_dirname
    metrics = train(cfg, Path(hydra_cfg.runtime.output_dir))
    if metrics["status"] != "completed":
        raise RuntimeError(f"the run ended {metrics['status']} (see its metrics.json)")
    return metrics


# conf/ sits at the repository root, beside train.py (the project is installed editable).
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "conf")


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float:
    # Exit codes (experiments.failures, README "Failures and resuming"): 0 completed, 1 failed, 2 bad input,
    # 128 + the signal's number when interrupted.
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        if multirun:
            metrics = run_sweep_job(cfg)
        else:
            metrics = train(cfg, Path(HydraConfig.get().runtime.output_dir))
    except Interrupted as stop:  # a sweep stops too: the user or the scheduler asked for it
        print(stop, file=sys.stderr)
        sys.exit(stop.exit_code)
    except KeyboardInterrupt:  # Ctrl-C before training started: there is nothing to save
        sys.exit(128 + signal.SIGINT)
    except (ConfigError, RunFailed) as err:
        if multirun:
            raise  # Hydra records the job as failed and runs the others
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT if isinstance(err, ConfigError) else EXIT_FAILED)
    return metrics["val_mse"]  # the objective that a search minimizes (hparams_search=optuna)
