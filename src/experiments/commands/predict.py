"""The predict recipe: `python predict.py ckpt_path=PATH data.path=F` applies a checkpoint to raw inputs
(docs/using-a-model.md). `predict` checks everything and computes, and writes nothing; `main` writes the run
dir on success."""

import csv
import io
import json
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from experiments.commands.outputs import rows, run_into_own_dir, scoring_trainer, write_hydra_record
from experiments.config.checks import check_config
from experiments.data.files import Table, read_table
from experiments.run import provenance
from experiments.run.files import write_atomic
from experiments.training.checkpoint import Checkpoint, check_fits, load_checkpoint


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


def predict(cfg: DictConfig) -> tuple[Table, np.ndarray, str, Checkpoint]:
    """Apply `cfg.ckpt_path` to the raw inputs of `cfg.data.path` (predict.py): (table, predictions, device, the
    checkpoint)."""
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
    return table, torch.cat(batches).float().cpu().numpy(), str(trainer.strategy.root_device), checkpoint


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


def prediction_record(cfg: DictConfig, checkpoint: Checkpoint, predictions: Path, rows: int, device: str) -> dict:
    """predict.json, beside the predictions: which checkpoint made them (and what trained it), from which input."""
    return {
        "checkpoint": str(checkpoint.path.resolve()),
        "checkpoint_provenance": checkpoint.provenance,
        "input": provenance.file_fingerprint(cfg.data.path),
        "rows": rows,
        "predictions": predictions.name,
        "device": device,
    }


def _predict_into(cfg: DictConfig, run_dir: Path) -> None:
    table, predictions, device, checkpoint = predict(cfg)
    write_hydra_record(run_dir, cfg)
    path = write_predictions(run_dir, table, predictions)
    record = prediction_record(cfg, checkpoint, path, len(predictions), device)
    write_atomic(run_dir / "predict.json", json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"{len(predictions)} rows x {predictions.shape[1]} outputs predicted on {device}: {path}")


def main(cfg: DictConfig) -> None:
    run_into_own_dir(_predict_into, cfg)
