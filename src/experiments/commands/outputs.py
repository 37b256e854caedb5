"""What eval.py and predict.py share: a one-device trainer, batches of every row, and a run dir that is written
only when the command succeeds."""

from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from experiments.config.errors import ConfigError
from experiments.data.loader import BatchLoader, EpochShuffle
from experiments.run.files import write_atomic
from experiments.run.layout import RunPaths
from experiments.run.refused import remove_empty_run_dir


def scoring_trainer(trainer_cfg: DictConfig) -> L.Trainer:
    devices = trainer_cfg.devices
    if not (devices == 1 or (OmegaConf.is_list(devices) and len(devices) == 1)) or trainer_cfg.num_nodes != 1:
        raise ConfigError(
            f"trainer.devices={devices} trainer.num_nodes={trainer_cfg.num_nodes}: scoring runs on one device; "
            "allowed: trainer.devices=1 (or one device index, e.g. [1]) and trainer.num_nodes=1"
        )
    return instantiate(
        trainer_cfg,
        logger=False,
        callbacks=[],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def rows(x: torch.Tensor, y: torch.Tensor, batch_size: int) -> BatchLoader:
    """Every row once, in order, in batches (the last one partial)."""
    return BatchLoader(x, y, batch_size, EpochShuffle(len(x), seed=0, shuffle=False), drop_last=False)


def write_hydra_record(run_dir: Path, cfg: DictConfig) -> None:
    """What Hydra writes into `.hydra/` itself, written here only once the command has passed every check
    (eval.yaml and predict.yaml set `hydra.output_subdir: null`)."""
    hydra_cfg = HydraConfig.get()
    for name, node in [("config", cfg), ("hydra", {"hydra": hydra_cfg}), ("overrides", hydra_cfg.overrides.task)]:
        write_atomic(RunPaths(run_dir).hydra / f"{name}.yaml", OmegaConf.to_yaml(OmegaConf.create(node)))


def run_into_own_dir(work, cfg: DictConfig) -> None:
    """Run `work(cfg, run_dir)`; when it fails (refused, out of space, interrupted), the files it wrote are
    removed again, and the run dir too when it is left empty."""
    # experiments.commands.entry turns a refusal into its one `error:` line and exit 2.
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    before = set(run_dir.rglob("*")) if run_dir.is_dir() else set()
    try:
        work(cfg, run_dir)
    except BaseException:
        written = set(run_dir.rglob("*")) - before if run_dir.is_dir() else set()
        for path in sorted(written, key=lambda p: len(p.parts), reverse=True):  # files before their dirs
            if path.is_dir():
                path.rmdir() if not any(path.iterdir()) else None
            else:
                path.unlink(missing_ok=True)
        remove_empty_run_dir(run_dir)
        raise
