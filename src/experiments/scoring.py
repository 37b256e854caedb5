"""Using a trained model: `evaluate` scores a checkpoint on data, `predict` applies it to raw inputs.

Both are plain functions that check everything (the checkpoint, the data, the settings) and compute, and
write nothing; `eval_main` and `predict_main` add Hydra and write the run dir only when they succeed.
"""

import csv
import io
import json
from pathlib import Path

import lightning as L
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from experiments.checkpoints import Checkpoint, check_fits, load_checkpoint
from experiments.checks import ConfigError, check_config
from experiments.data import BatchLoader, EpochShuffle, Table, least_squares, read_table
from experiments.entry import entry_point
from experiments.records import write_atomic


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


# ------------------------------------------------------------------------------------------------- eval.py


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
        "scored": "every row" if every_row else "validation split",
        "data": {
            **OmegaConf.to_container(run.data, resolve=True),
            "rows": len(x),
            "feature_names": getattr(data, "feature_names", None),
            "target_name": getattr(data, "target_name", None),
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


# ---------------------------------------------------------------------------------------------- predict.py


def feature_columns(table: Table, checkpoint: Checkpoint) -> list[int]:
    """A CSV's columns by name when the model knows its features' names, else every column in order."""
    if table.columns is not None and checkpoint.feature_names is not None:
        return table.find(checkpoint.feature_names)
    if table.width != checkpoint.in_features:
        raise table.error(
            f"has {table.width} columns and the model takes {checkpoint.in_features} features (unnamed: it was "
            f"trained on data without column names); allowed: exactly {checkpoint.in_features} feature columns"
        )
    return list(range(table.width))


def prediction_names(out_features: int) -> list[str]:
    return ["prediction"] if out_features == 1 else [f"prediction_{i}" for i in range(out_features)]


def predict(cfg: DictConfig) -> tuple[Table, np.ndarray, str]:
    """Apply `cfg.ckpt_path` to the raw inputs of `cfg.data.path` (predict.py): (table, predictions, device)."""
    check_config(cfg)
    checkpoint = load_checkpoint(cfg.ckpt_path)
    table = read_table(cfg.data.path)
    x = torch.from_numpy(table.numbers(feature_columns(table, checkpoint))).float()
    check_fits(checkpoint, x.shape[1])
    names = prediction_names(checkpoint.out_features)
    if table.columns is not None and (taken := [n for n in names if n in table.columns]):
        raise table.error(f"already has a column {taken[0]!r}; allowed: a file without it (it is the output's)")
    trainer = scoring_trainer(cfg.trainer)
    # The batches carry no targets: predict_step applies predict_raw to the raw features.
    batches = trainer.predict(checkpoint.module, dataloaders=rows(x, x.new_empty(len(x), 0), cfg.data.batch_size))
    return table, torch.cat(batches).float().cpu().numpy(), str(trainer.strategy.root_device)


def write_predictions(run_dir: Path, table: Table, predictions: np.ndarray) -> Path:
    """The input's columns followed by the predictions, one row per input row, in input order."""
    if table.columns is None:
        path = run_dir / "predictions.npy"
        array = np.hstack([table.rows, predictions]).astype(np.result_type(table.rows.dtype, np.float32))
        buffer = io.BytesIO()
        np.save(buffer, array)
        write_atomic(path, buffer.getvalue())
        return path
    path = run_dir / "predictions.csv"
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(table.columns + prediction_names(predictions.shape[1]))
    for row, values in zip(table.rows, predictions, strict=True):
        writer.writerow(row + [format(v, ".9g") for v in values])  # 9 digits: a float32 read back exactly
    write_atomic(path, text.getvalue())
    return path


# ------------------------------------------------------------------------------------------ entry points


def write_hydra_record(run_dir: Path, cfg: DictConfig) -> None:
    """What Hydra writes into `.hydra/` itself, written here only once the command has passed every check
    (eval.yaml and predict.yaml set `hydra.output_subdir: null`)."""
    hydra_cfg = HydraConfig.get()
    for name, node in [("config", cfg), ("hydra", {"hydra": hydra_cfg}), ("overrides", hydra_cfg.overrides.task)]:
        write_atomic(run_dir / ".hydra" / f"{name}.yaml", OmegaConf.to_yaml(OmegaConf.create(node)))


def remove_empty_run_dir(run_dir: Path) -> None:
    """A refused command leaves nothing: Hydra made the run dir, empty, before the checks ran. Remove it, and
    the parents it made for it (empty too), up to the working directory. Never a dir with anything in it."""
    run_dir, cwd = run_dir.resolve(), Path.cwd().resolve()
    for path in [run_dir, *run_dir.parents]:
        if path != run_dir and cwd not in path.parents:
            break
        try:
            path.rmdir()
        except OSError:  # not empty (or not there): stop
            break


def _run(work, cfg: DictConfig) -> None:
    # experiments.entry turns a refusal into its one `error:` line and exit 2.
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        work(cfg, run_dir)
    except BaseException:
        remove_empty_run_dir(run_dir)
        raise


def _evaluate_into(cfg: DictConfig, run_dir: Path) -> None:
    result = evaluate(cfg, list(HydraConfig.get().overrides.task))
    write_hydra_record(run_dir, cfg)
    write_atomic(run_dir / "eval.json", json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"{eval_summary(result)}\n{run_dir / 'eval.json'}")


def _predict_into(cfg: DictConfig, run_dir: Path) -> None:
    table, predictions, device = predict(cfg)
    write_hydra_record(run_dir, cfg)
    path = write_predictions(run_dir, table, predictions)
    print(f"{len(predictions)} rows x {predictions.shape[1]} outputs predicted on {device}: {path}")


@entry_point("eval")
def eval_main(cfg: DictConfig) -> None:
    _run(_evaluate_into, cfg)


@entry_point("predict")
def predict_main(cfg: DictConfig) -> None:
    _run(_predict_into, cfg)
