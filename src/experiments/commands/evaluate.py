"""The eval recipe: `python eval.py ckpt_path=PATH [data.path=F]` scores a checkpoint
(docs/using-a-model.md). `evaluate` checks everything and computes, and writes nothing; `main` writes the run
dir on success."""

import json
from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from experiments.commands.outputs import rows, run_into_own_dir, scoring_trainer, write_hydra_record
from experiments.config.checks import check_config
from experiments.config.errors import ConfigError
from experiments.data.least_squares import least_squares
from experiments.run import provenance
from experiments.run.files import write_atomic
from experiments.training.checkpoint import Checkpoint, check_fits, load_checkpoint


def override_keys(overrides: list[str]) -> list[str]:
    """The keys (`data.path`) and groups (`data`) that command-line overrides set, as Hydra parses them."""
    return [o.key_or_group for o in OverridesParser.create().parse_overrides(overrides)]


def eval_config(stored: DictConfig, cfg: DictConfig, overrides: list[str]) -> tuple[DictConfig, bool]:
    """The config that eval.py scores with, and whether it scores every row of new data.

    The run's config is the base. The trainer is eval.py's own (how to score, not how the run trained). A
    group or a key set on the command line replaces the run's. Selecting data (`data=...`) or a data file
    (`data.path=...`) scores every row of that data with the checkpoint's statistics; otherwise the run's
    data is rebuilt and its validation split scored.
    """
    merged = OmegaConf.create(OmegaConf.to_container(stored, resolve=False))
    merged.trainer = cfg.trainer
    merged.ckpt_path = cfg.ckpt_path
    keys = override_keys(overrides)
    every_row = any(key in ("data", "data.path") for key in keys)
    if every_row:
        merged.data = cfg.data
    for key in keys:
        if key not in ("ckpt_path", "data") and not key.startswith("trainer"):
            OmegaConf.update(merged, key, OmegaConf.select(cfg, key), merge=False, force_add=True)
    return merged, every_row


def evaluate(cfg: DictConfig, overrides: list[str]) -> dict:
    """Score `cfg.ckpt_path` (eval.py): the figures and a description of what was scored (eval.json)."""
    check_config(OmegaConf.masked_copy(cfg, ["ckpt_path", "trainer"]))
    checkpoint = load_checkpoint(cfg.ckpt_path)
    run, every_row = eval_config(checkpoint.config, cfg, overrides)
    if every_row and "features" in run.data and run.data.features is None and checkpoint.feature_names:
        run.data.features = checkpoint.feature_names  # match the file's columns by name
    if every_row and "target" in run.data and run.data.target is None and checkpoint.target_name:
        run.data.target = checkpoint.target_name
    check_config(run)
    L.seed_everything(run.seed, verbose=False)
    data = instantiate(run.data)
    if every_row:
        x, y = data.load()
        check_fits(checkpoint, x.shape[1], y.shape[1])
        x = (x - checkpoint.module.feature_mean) / checkpoint.module.feature_std  # never refit on new data
        w, b = least_squares(x, y)
        optimal_mse = torch.mean((x.double() @ w + b - y.double()) ** 2).item()
    else:
        data.setup("validate")
        x, y = data.x_val, data.y_val
        check_fits(checkpoint, x.shape[1], y.shape[1])
        _check_same_statistics(checkpoint, data, run)
        optimal_mse = data.optimal_val_mse
    if len(x) < 2:
        raise ConfigError(f"data.path={run.data.get('path')}: {len(x)} row to score; allowed: at least 2 (for R²)")

    trainer = scoring_trainer(run.trainer)
    [logged] = trainer.validate(checkpoint.module, dataloaders=rows(x, y, run.data.batch_size), verbose=False)
    return {
        "checkpoint": str(checkpoint.path.resolve()),
        "checkpoint_provenance": checkpoint.provenance,  # what trained it (experiments.run.provenance)
        "scored": "every row" if every_row else "validation split",
        "data": {
            **OmegaConf.to_container(run.data, resolve=True),
            "rows": len(x),
            "feature_names": getattr(data, "feature_names", None),
            "target_name": getattr(data, "target_name", None),
            "fingerprint": provenance.data_fingerprint(run.data),
        },
        "mse": logged["val/mse"],
        "mae": logged["val/mae"],
        "r2": logged["val/r2"],
        "optimal_mse": optimal_mse,
        "device": str(trainer.strategy.root_device),
    }


def _check_same_statistics(checkpoint: Checkpoint, data, run: DictConfig) -> None:
    # The rebuilt training split gives the statistics the run trained with, unless its data changed.
    module = checkpoint.module
    if not (
        torch.allclose(data.feature_mean, module.feature_mean, rtol=1e-5, atol=1e-6)
        and torch.allclose(data.feature_std, module.feature_std, rtol=1e-5, atol=1e-6)
    ):
        where = f"data.path={run.data.path}" if "path" in run.data else "the data"
        raise ConfigError(
            f"{where} is not the data the run trained on: its training split's mean and standard deviation "
            f"differ from the checkpoint's (was the file changed?); allowed: the run's data unchanged, or "
            "data.path=... to score every row of other data"
        )


def eval_summary(result: dict) -> str:
    data = result["data"]
    source = data.get("path") or data["_target_"].rsplit(".", 1)[-1]
    return (
        f"{result['checkpoint']}: {result['scored']} of {source} ({data['rows']} rows) on {result['device']}\n"
        f"mse {result['mse']:.6g}  mae {result['mae']:.6g}  r2 {result['r2']:.6g}  "
        f"optimal_mse {result['optimal_mse']:.6g}"
    )


def _evaluate_into(cfg: DictConfig, run_dir: Path) -> None:
    result = evaluate(cfg, list(HydraConfig.get().overrides.task))
    write_hydra_record(run_dir, cfg)
    write_atomic(run_dir / "eval.json", json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"{eval_summary(result)}\n{run_dir / 'eval.json'}")


def main(cfg: DictConfig) -> None:
    run_into_own_dir(_evaluate_into, cfg)
