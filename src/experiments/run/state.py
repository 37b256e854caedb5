"""A run dir's state, read from what the run itself wrote: fresh, unfinished, completed, or another config's.

This is the one record of a run's state that a reused `hydra.run.dir`, a requeued SLURM job and a re-run sweep
all go through. A dir holds a run when it holds the run's checkpoint (`checkpoints/last.ckpt`) or its
metrics.json; Hydra's `.hydra/` does not count, since Hydra writes it before any check runs. The config a run
trains with is the run's own record, `run.yaml`, written when training starts (after every check), so a start
that was refused or failed before training leaves no run behind.

Same config: the composed config (Hydra's own `hydra.*` is never part of it) without the settings in `IGNORED`,
which say how a run is started, shown or how often it saves its position, never what it computes.
"""

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments.config.errors import ConfigError
from experiments.run.files import write_atomic
from experiments.run.layout import RunPaths

IGNORED = ("ckpt_path", "trainer.enable_progress_bar", "trainer.enable_model_summary", "checkpoint",
           "trainer.log_every_n_steps", "window_s")  # how often it is shown: its windows of steps give the same weights
# (tests/test_strategies.py); its default went from 50 to 10 in issue 42, and runs before it are the same runs.
# With batch.effective set, the batch and accumulation that it chose (and run.yaml records) are not the user's.
FITTED = ("data.batch_size", "trainer.accumulate_grad_batches")
# Classes that moved (issue 39's layout, 2026-12): a run.yaml written before names them by their old path, and
# is still the same run. Their old modules are gone, so this maps names only; nothing old is imported.
MOVED = {
    "experiments.perf.NoProfiler": "experiments.training.perf.NoProfiler",
    "experiments.dashboard.TensorBoardLogger": "experiments.training.dashboard.TensorBoardLogger",
}
# Settings added since runs were first recorded, at the value that computes what a run without them computed: a
# run.yaml written before has not got them, and is still the same run.
ADDED = {"compile": False}


class State(Enum):
    FRESH = "fresh"  # no run here: train from the start (or from ckpt_path)
    UNFINISHED = "unfinished"  # interrupted, failed or killed: resume from its last checkpoint
    COMPLETED = "completed"  # nothing to do
    OTHER_CONFIG = "other config"  # refused


@dataclass(frozen=True)
class RunDir:
    path: Path
    state: State
    checkpoint: Path | None = None  # where an unfinished run resumes from; None: from the start
    metrics: dict | None = None  # its metrics.json, when there is one


def identity(cfg: DictConfig) -> dict:
    """What makes two configs the same run: the composed config, resolved, without `IGNORED` (nor `FITTED` when
    batch.effective chooses them)."""
    tree = _reshaped(_renamed(OmegaConf.to_container(cfg, resolve=True)))
    tree.pop("hydra", None)
    for key, default in ADDED.items():
        if tree.get(key, default) == default:
            tree.pop(key, None)
    fitted = (tree.get("batch") or {}).get("effective") is not None
    for key in IGNORED + (FITTED if fitted else ()):
        *parents, leaf = key.split(".")
        node = tree
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return tree


def _reshaped(tree: dict) -> dict:
    """A config composed before `callbacks.model_checkpoint` (Lightning's ModelCheckpoint, `save_last: false`,
    `save_top_k: 0`: read as "no checkpoints", though last.ckpt is the run's own, `checkpoint.*`) became
    `callbacks.best_checkpoints` without `save_last` (issue 42, 2026-12), in the new shape: the same callback, built
    with the same arguments (Lightning's save_last default, None, saves no `last` either)."""
    callbacks = tree.get("callbacks")
    if isinstance(callbacks, dict) and isinstance(callbacks.get("model_checkpoint"), dict):
        callbacks = dict(callbacks)
        old = dict(callbacks.pop("model_checkpoint"))
        if old.get("save_last") is False:
            old.pop("save_last")
        tree = {**tree, "callbacks": {**callbacks, "best_checkpoints": old}}
    return tree


def _renamed(node):
    """`node` with every `_target_` that `MOVED` names at its new path."""
    if isinstance(node, dict):
        return {k: MOVED.get(v, v) if k == "_target_" else _renamed(v) for k, v in node.items()}
    return [_renamed(v) for v in node] if isinstance(node, list) else node


def inspect(run_dir: Path, cfg: DictConfig) -> RunDir:
    paths = RunPaths(run_dir)
    metrics_file, checkpoint = paths.metrics, paths.last_checkpoint
    if not metrics_file.exists() and not checkpoint.exists():
        return RunDir(run_dir, State.FRESH)
    stored = paths.run_config
    if not stored.exists() or identity(OmegaConf.load(stored)) != identity(cfg):
        return RunDir(run_dir, State.OTHER_CONFIG)
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else None
    if metrics and metrics.get("status") == "completed":
        return RunDir(run_dir, State.COMPLETED, metrics=metrics)
    return RunDir(run_dir, State.UNFINISHED, checkpoint if checkpoint.exists() else None, metrics)


def settle(run_dir: Path, cfg: DictConfig, writer: bool = True) -> RunDir:
    """Decide what a start in `run_dir` does, before anything is built: raise `ConfigError` for a dir that holds
    another config's run; for a completed one, put Hydra's files back as the run left them, so the dir is as it was.
    Only the `writer` (rank 0) puts files back.
    """
    run = inspect(run_dir, cfg)
    if run.state is State.OTHER_CONFIG:
        if writer:
            restore_hydra_files(run_dir)
        stored = RunPaths(run_dir).run_config
        what = "a run of another config" if stored.exists() else "a run whose config is unrecorded"
        raise ConfigError(
            f"hydra.run.dir={run_dir} holds {what} (its metrics.json or checkpoint); allowed: the same config "
            f"(see {stored}) to resume or keep it, or another hydra.run.dir"
        )
    if run.state is State.COMPLETED and writer:
        restore_hydra_files(run_dir)
    return run


def claim(run: RunDir, cfg: DictConfig) -> None:
    """As a run starts training from the beginning (fresh, or unfinished with nothing saved): record the config it
    trains with and a copy of Hydra's `.hydra/` files (rank 0 only). A run that resumes keeps the record it started
    with (the same config, and batch.effective's fit from its checkpoint)."""
    if run.state is not State.FRESH and run.checkpoint is not None:
        return
    paths = RunPaths(run.path)
    write_atomic(paths.run_config, OmegaConf.to_yaml(cfg, resolve=True))
    for source in sorted(paths.hydra.glob("*.yaml")) if paths.hydra.is_dir() else []:
        write_atomic(paths.hydra_copy / source.name, source.read_text())


def restore_hydra_files(run_dir: Path) -> None:
    # Hydra rewrites `.hydra/*.yaml` on every start, before the task runs; a start that changes nothing puts
    # back the run's own copy wherever the content differs (a different order of overrides, another launcher).
    paths = RunPaths(run_dir)
    for saved in sorted(paths.hydra_copy.glob("*.yaml")) if paths.hydra_copy.is_dir() else []:
        target = paths.hydra / saved.name
        if not target.exists() or target.read_bytes() != saved.read_bytes():
            write_atomic(target, saved.read_text())


def logger_options(logger_cfg: DictConfig | None, resume_step: int | None) -> dict:
    """Keyword arguments for the logger of a run that resumes at `resume_step` in its own dir.

    TensorBoardLogger appends a new event file beside the old ones; `purge_step` (torch's SummaryWriter) marks
    where the new one restarts, and TensorBoard's reader then drops the old file's events from that step on, so
    each step is there once, including the steps a killed run logged after its last checkpoint.
    """
    if resume_step is None or not logger_cfg or not str(logger_cfg.get("_target_", "")).endswith("TensorBoardLogger"):
        return {}
    return {"purge_step": resume_step}
