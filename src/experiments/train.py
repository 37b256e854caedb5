"""The Hydra entry point: seed, build, fit, record.

`train(cfg, run_dir)` is a plain function that tests call with a composed config; `main` adds Hydra.
"""

import sys
import time
from pathlib import Path

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

from experiments.checks import ConfigError
from experiments.module import Regressor
from experiments.perf import PerfMonitor
from experiments.records import final_figures, run_record, write_metrics
from experiments.strategies import check_strategy, ranks_join_this_job


def train(cfg: DictConfig, run_dir: Path) -> dict:
    started = time.perf_counter()
    check_strategy(cfg)
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
    module = Regressor(net, instantiate(cfg.optimizer), data.feature_mean, data.feature_std)

    perf = PerfMonitor(global_batch_size=cfg.data.batch_size)
    checkpoint = ModelCheckpoint(dirpath=run_dir / "checkpoints", save_last=True, save_top_k=0)
    logger = instantiate(cfg.logger, save_dir=str(run_dir)) if cfg.logger else False
    trainer = instantiate(cfg.trainer, callbacks=[perf, checkpoint], logger=logger, default_root_dir=run_dir)

    status = "failed"
    try:
        with ranks_join_this_job():
            trainer.fit(module, datamodule=data, ckpt_path=cfg.ckpt_path)
        status = "interrupted" if trainer.interrupted else "completed"
    finally:
        train_loss = trainer.callback_metrics.get("train/loss")
        metrics = {
            **run_record(trainer, status, cfg.data.batch_size),
            **final_figures(module.net, data),
            "train_loss": None if train_loss is None else train_loss.item(),
            **perf.summary,
            "wall_time_s": time.perf_counter() - started,
        }
        if trainer.is_global_zero:
            write_metrics(run_dir / "metrics.json", metrics)
            log_hparams(trainer, cfg, metrics)
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


def run_sweep_job(cfg: DictConfig) -> None:
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


# conf/ sits at the repository root, beside train.py (the project is installed editable).
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "conf")


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        run_sweep_job(cfg)
        return
    try:
        train(cfg, Path(HydraConfig.get().runtime.output_dir))
    except ConfigError as err:
        sys.exit(f"error: {err}")
