"""The Hydra entry point: seed, build, fit, record.

`train(cfg, run_dir)` is a plain function that tests call with a composed config; `main` adds Hydra.
"""

import time
from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

from experiments import rundir, slurm
from experiments.callbacks import configured_callbacks, early_stop_record
from experiments.checkpoints import RunRecord, check_fits, load_checkpoint
from experiments.checks import check_config, check_shapes, resolve_checkpoint
from experiments.entry import CONFIG_DIR, entry_point  # noqa: F401 (CONFIG_DIR: tests compose with it)
from experiments.failures import Interrupted, Interruption, end_with_parent, out_of_memory
from experiments.log_steps import LogStepProgressBar
from experiments.module import Regressor
from experiments.perf import PerfMonitor, run_start_time
from experiments.records import AtomicCheckpointIO, final_figures, run_record, write_metrics
from experiments.strategies import check_strategy, ranks_join_this_job, this_rank
from experiments.summary import print_summary, quiet_lightning
from experiments.target import TimeToTarget


def train(cfg: DictConfig, run_dir: Path) -> dict:
    started = run_start_time()
    quiet_lightning()
    check_config(cfg)
    check_strategy(cfg)
    rank = this_rank()
    if rank.started_by_launcher:
        end_with_parent()
    run = rundir.settle(run_dir, cfg, writer=rank.zero)  # refuses a dir that holds another config's run
    if run.state is rundir.State.COMPLETED:
        print(f"nothing to do: {run_dir} holds this config's completed run (its metrics.json)")
        return run.metrics
    ckpt_path = run.checkpoint or resolve_checkpoint(cfg.ckpt_path, run_dir)  # an unfinished run resumes itself
    # A signal saves the exact position over last.ckpt, so that `ckpt_path=last` resumes from it.
    interruption = Interruption(str(run_dir / "checkpoints" / "last.ckpt"))
    try:
        with interruption.handling():
            metrics = fit(cfg, run, started, ckpt_path, interruption, writer=rank.zero)
        interruption.raise_if_signalled()
    except Interrupted as stop:
        slurm.requeue_after(stop.signum)  # a SLURM pre-emption warning: the job starts again and resumes
        raise
    return metrics


def fit(
    cfg: DictConfig, run: rundir.RunDir, started: float, ckpt_path: str | None, interruption: Interruption, writer: bool
) -> dict:
    run_dir = run.path
    resumed = load_checkpoint(ckpt_path) if ckpt_path else None  # the checks of eval.py and predict.py
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    perf = PerfMonitor(global_batch_size=cfg.data.batch_size, started_at=started)
    target = TimeToTarget(perf, **cfg.target)
    # Curves restart where the checkpoint does, when the run resumes in its own dir.
    logger_options = rundir.logger_options(cfg.logger, resumed.global_step if run.checkpoint else None)
    logger = instantiate(cfg.logger, save_dir=str(run_dir), **logger_options) if cfg.logger else False
    callbacks = [target, perf, interruption, *configured_callbacks(cfg, run_dir)]
    if cfg.trainer.enable_progress_bar:
        callbacks.append(LogStepProgressBar(refresh_rate=cfg.trainer.log_every_n_steps))
    # The constructors check their settings (experiments.entry reports what they refuse): build them before
    # the data is made.
    trainer = instantiate(
        cfg.trainer,
        callbacks=callbacks,
        logger=logger,
        plugins=[AtomicCheckpointIO(), *slurm.plugins()],
        default_root_dir=run_dir,
    )
    data = instantiate(cfg.data)
    data.setup("fit")
    check_shapes(cfg.data.batch_size, len(data.x_train), cfg.model.in_features, data.num_features)  # data=file
    in_features = data.num_features
    if resumed:
        check_fits(resumed, in_features, cfg.model.out_features)
    # The checkpoint carries the run's config and column names, for eval.py and predict.py.
    trainer.callbacks.append(RunRecord(cfg, data.feature_names, data.target_name))
    net = instantiate(cfg.model, in_features=in_features)
    module = Regressor(
        net, instantiate(cfg.optimizer), data.feature_mean, data.feature_std, scheduler=instantiate(cfg.scheduler)
    )

    if writer:
        rundir.claim(run, cfg)
    status = "failed"
    try:
        with ranks_join_this_job():
            trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        status = "completed"
    except Interrupted as stop:
        if stop.checkpoint is None:
            status = None  # before training started: nothing to record
        else:
            status = "interrupted"
        raise
    except torch.OutOfMemoryError as err:
        raise out_of_memory(err, cfg.data.batch_size, cfg.trainer.accumulate_grad_batches) from None
    finally:
        if status is not None:
            train_loss = getattr(module, "last_loss", None)  # the last step's, logged or not
            # A failed run's weights may be unusable (diverged), and after running out of memory, measuring
            # them could run out again: its fit is left blank.
            unmeasured = {"val_mse": None, "val_mae": None, "val_r2": None, "optimum_distance": None,
                          "optimal_val_mse": data.optimal_val_mse}  # fmt: skip
            metrics = {
                **run_record(trainer, status, cfg.data.batch_size),
                **(final_figures(module.net, data) if status != "failed" else unmeasured),
                "train_loss": None if train_loss is None else train_loss.item(),
                **perf.summary,
                **target.summary,
                **early_stop_record(trainer),
                "data_device": str(data.x_train.device),
                "data_pinned": data.pins_batches,
                "wall_time_s": time.time() - started,
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
            # At the last step, not 0: a resumed run's TensorBoard file purges the interrupted one's from there on.
            logger.log_hyperparams(params, final, step=trainer.global_step)
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


@entry_point("config")
def main(cfg: DictConfig) -> float:
    # Exit codes (experiments.failures, README "Failures and resuming"): 0 completed, 1 failed, 2 bad input,
    # 128 + the signal's number when interrupted; experiments.entry turns errors and signals into them.
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        metrics = run_sweep_job(cfg)
    else:
        metrics = train(cfg, Path(HydraConfig.get().runtime.output_dir))
    return metrics["val_mse"]  # the objective that a search minimizes (hparams_search=optuna)
