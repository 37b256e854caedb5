"""What TensorBoard shows of a run and of a sweep, beyond the curves (docs/tensorboard.md).

- Run names: a sweep job's TensorBoard run is named for what its sweep varies (`0/tensorboard/batch_size=64`).
- Time Series opens on curves: Lightning's `epoch` staircase is dropped; the final figures go under `whole_run/`,
  a group that sorts after the curves' `perf/`, `train/` and `val/` (Time Series opens its first two groups).
- `val/mse_over_optimum` (written by experiments.training.target): each validation's MSE over the exact optimum's.
- HPARAMS: one row per run. Its columns are the key settings and the swept ones, declared with TensorBoard's
  hparams protos; TensorBoard lists those marked `differs` first, then by name, and shows the first five. Its
  metrics are metrics.json's final figures (`METRICS`, in that order: the first five shown).
- Custom Scalars: one layout that puts every run's curves of a figure in one chart.
"""

import math
import re
import time
from collections.abc import Mapping

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
from tensorboard.plugins.hparams import summary_v2 as hparams_summary

from experiments import internals
from experiments.models.mlp import shape
from experiments.run.metrics import strategy_name


class TensorBoardLogger(LightningTensorBoardLogger):
    """Lightning's TensorBoardLogger (conf/logger/tensorboard.yaml) without the `epoch` scalar that Lightning adds
    to every dict it logs: a staircase that Time Series would show as its first card, before any curve.

    And cheaper at log steps (docs/benchmarks.md): Lightning's writes an event per value, each a trip through the
    writer thread's queue, and its `save()`, which Lightning calls after every write of logged values, flushes the
    event file and looks for its hparams file on disk: together about 1 ms a log step, as much as several steps of
    the seed's model at a small batch. Here the values of a call are one event, and `save()` flushes at most once
    a second: the events are on disk within a second all the same, and `finalize` (a run's end, a failure, an
    interruption) flushes them all.
    """

    FLUSH_EVERY_S = 1.0
    _flushed_at = -math.inf  # (not set in __init__: the constructor stays Lightning's, which the config binds to)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float | torch.Tensor], step: int | None = None) -> None:
        metrics = {k: v for k, v in metrics.items() if k != "epoch"}
        if not all(isinstance(v, int | float) or (torch.is_tensor(v) and v.numel() == 1) for v in metrics.values()):
            return super().log_metrics(metrics, step)  # a dict of values: Lightning's add_scalars
        metrics = internals.tensorboard_prefixed(self, metrics)
        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()]
        internals.summary_file_writer(self.experiment).add_summary(Summary(value=values), step)

    def save(self) -> None:
        now = time.monotonic()
        if now - self._flushed_at >= self.FLUSH_EVERY_S:
            self._flushed_at = now
            super().save()


FIGURES = "whole_run"  # the tag group of the final figures
# The HPARAMS metrics: metrics.json keys, written once at the end as `whole_run/<key>`; the first five are shown.
METRICS = {
    "val_mse": "validation MSE of the final weights",
    "optimum_distance": "relative distance of the weights to the exact least-squares optimum",
    "samples_per_sec": "steady-state training throughput (samples/s)",
    "step_time_ms": "steady-state time of one micro-step (ms)",
    "time_to_target_s": "training time to val_mse <= target_mse (s); empty when never reached",
    "val_r2": "validation R² of the final weights",
}
# The HPARAMS columns every run has, each with the settings that feed it: a sweep over one of those makes it a
# column that differs between the runs.
KEY_SETTINGS = {
    "optimizer": ("optimizer",),
    "lr": ("optimizer", "optimizer.lr"),
    "batch_size": ("data.batch_size",),
    "accumulate_grad_batches": ("trainer.accumulate_grad_batches",),
    "effective_batch_size": ("data.batch_size", "trainer.accumulate_grad_batches"),
    "devices": ("trainer.devices",),
    "strategy": ("strategy", "trainer.devices"),
    "precision": ("trainer.precision",),
    "model": ("model",),
    "width": ("model", "model.hidden"),
    "depth": ("model", "model.hidden"),
    "num_samples": ("data", "data.num_samples", "data.path"),
    "num_features": ("data", "data.num_features", "data.path", "data.features"),
}


def short_names(keys) -> dict[str, str]:
    """Each key's last part (`data.batch_size` -> `batch_size`), or the whole key where two would share one."""
    last = {key: re.split(r"[./]", key)[-1] for key in keys}
    shared = {name for name in last.values() if list(last.values()).count(name) > 1}
    return {key: key if name in shared else name for key, name in last.items()}


def run_name(swept: dict[str, str]) -> str:
    """A sweep job's TensorBoard run name: its swept settings, short (`batch_size=64,lr=0.01`); "" for none."""
    names = short_names(swept)
    return ",".join(f"{names[key]}={_short(value)}" for key, value in swept.items())


def _short(value: str) -> str:
    # Optuna's floats (0.012345678901) to 4 significant digits; a "/" would nest the run's folder.
    if re.fullmatch(r"-?(\d*\.\d+|\d+\.?\d*e-?\d+)", value):
        value = f"{float(value):.4g}"
    return value.replace("/", "_")


def _summary(tag: str, data: plugin_data_pb2.HParamsPluginData) -> Summary:
    summary = Summary()
    summary.value.add(tag=tag, metadata=metadata.create_summary_metadata(data), tensor=metadata.NULL_TENSOR)
    return summary


def experiment_summary(columns: dict, differs: set[str]) -> Summary:
    """The HPARAMS table's declaration: its columns and metrics. Without one, TensorBoard makes every scalar tag
    a metric; `hparams_summary.hparams_config_pb` cannot mark a column `differs`, hence the plugin's protos."""
    types = {bool: api_pb2.DATA_TYPE_BOOL, int: api_pb2.DATA_TYPE_FLOAT64, float: api_pb2.DATA_TYPE_FLOAT64}
    experiment = api_pb2.Experiment(
        hparam_infos=[
            api_pb2.HParamInfo(name=name, type=types.get(type(v), api_pb2.DATA_TYPE_STRING), differs=name in differs)
            for name, v in columns.items()
        ],
        metric_infos=[
            api_pb2.MetricInfo(name=api_pb2.MetricName(tag=f"{FIGURES}/{key}"), display_name=key, description=meaning)
            for key, meaning in METRICS.items()
        ],
        time_created_secs=time.time(),
    )
    return _summary(metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(experiment=experiment))


def session_end_summary(status: str) -> Summary:
    statuses = {"completed": api_pb2.STATUS_SUCCESS, "failed": api_pb2.STATUS_FAILURE}
    end = plugin_data_pb2.SessionEndInfo(status=statuses.get(status, api_pb2.STATUS_UNKNOWN), end_time_secs=time.time())
    return _summary(metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=end))


def layout(scheduler: bool) -> dict:
    """The Custom Scalars tab (torch's `add_custom_scalars` format): per chart, regexes over the scalar tags; every
    run's matching curves share the chart."""
    charts = {
        "val MSE / exact optimum (1 = the optimum)": ["Multiline", [r"^val/mse_over_optimum$"]],
        "training loss": ["Multiline", [r"^train/loss$"]],
        "throughput (samples/s)": ["Multiline", [r"^perf/samples_per_sec$"]],
        "step time (ms)": ["Multiline", [r"^perf/step_time_ms$"]],
        "step-time parts (ms): data, transfer, compute, framework": [
            "Multiline",
            [r"^perf/(data|transfer|compute|framework)_ms$"],
        ],
    }
    if scheduler:
        charts["learning rate"] = ["Multiline", [r"^train/lr$"]]
    return {"compare runs": charts}


def writers(trainer: L.Trainer) -> list:
    """The SummaryWriters of the run's TensorBoard loggers (call it on rank 0, where they write)."""
    return [logger.experiment for logger in trainer.loggers if isinstance(logger, LightningTensorBoardLogger)]


class Dashboard:
    """What a run writes for TensorBoard beyond its curves: the HPARAMS row and the Custom Scalars layout as
    training starts (`start`), the final figures and how the run ended (`finish`). Not a callback: Lightning calls
    every callback's hooks on every step, and this has nothing to do there."""

    def __init__(self, cfg: DictConfig, swept: dict[str, str], trial_id: str):
        self.cfg, self.swept = cfg, swept  # swept: experiments.sweeps.record.swept_overrides ({} outside a sweep)
        self.trial_id = trial_id  # HPARAMS' first column, "Trial ID"

    def columns(self, trainer: L.Trainer, data) -> dict:
        """The HPARAMS columns of this run: the key settings, as the run resolved them, and the swept settings
        that feed none of them. Settings that are None are left out."""
        cfg = self.cfg
        with torch.device("meta"):  # the model's shape, counted without allocating it
            net = shape(instantiate(cfg.model, in_features=data.num_features))
        columns = {
            "optimizer": cfg.optimizer._target_.rsplit(".", 1)[-1].lower(),  # sgd, adam
            "lr": cfg.optimizer.get("lr"),
            "batch_size": cfg.data.batch_size,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "effective_batch_size": cfg.data.batch_size * trainer.accumulate_grad_batches,
            "devices": trainer.num_devices,
            "strategy": strategy_name(trainer.strategy),
            "precision": str(trainer.precision),
            "model": cfg.model._target_.rsplit(".", 1)[-1].lower(),  # linear, mlp
            "width": net["width"],  # the widest hidden layer (0: none)
            "depth": net["depth"],  # hidden layers
            "num_samples": len(data.x_train) + len(data.x_val),
            "num_features": data.num_features,
        }
        for key, name in self._own_columns().items():
            value = OmegaConf.select(cfg, key)  # a config group's choice (scheduler=cosine) is a node: its name
            columns[name] = value if isinstance(value, bool | int | float | str) else self.swept[key]
        return {name: value for name, value in columns.items() if value is not None}

    def _own_columns(self) -> dict[str, str]:
        """Swept settings that feed no key setting (seed, optimizer.momentum, ...): a column each."""
        fed = {source for sources in KEY_SETTINGS.values() for source in sources}
        names = short_names(self.swept)
        return {key: key if names[key] in KEY_SETTINGS else names[key] for key in self.swept if key not in fed}

    def differs(self) -> set[str]:
        """The columns a swept setting feeds: TensorBoard lists them first."""
        fed = {column for column, sources in KEY_SETTINGS.items() if set(sources) & set(self.swept)}
        return fed | set(self._own_columns().values())

    def start(self, trainer: L.Trainer, data) -> None:
        """Before `trainer.fit`, on rank 0: the layout, the table's declaration and this run's row."""
        columns = self.columns(trainer, data)
        for writer in writers(trainer):
            writer.add_custom_scalars(layout(scheduler=self.cfg.scheduler is not None))
            events = internals.summary_file_writer(writer)
            events.add_summary(experiment_summary(columns, self.differs()), trainer.global_step)
            events.add_summary(hparams_summary.hparams_pb(columns, trial_id=self.trial_id), trainer.global_step)

    def finish(self, trainer: L.Trainer, metrics: dict) -> None:
        """On rank 0: the final figures (metrics.json's; null ones left out) and how the run ended, at its last
        step: a resumed run's event file purges an interrupted start's from there on."""
        for writer in writers(trainer):
            for key in METRICS:
                if isinstance(metrics.get(key), int | float):
                    writer.add_scalar(f"{FIGURES}/{key}", metrics[key], trainer.global_step)
            if metrics["status"] != "interrupted":  # an interrupted run resumes, and ends later
                internals.summary_file_writer(writer).add_summary(
                    session_end_summary(metrics["status"]), trainer.global_step
                )
            writer.flush()
