"""What a run prints: a line per epoch in a log file, a short block at its end, and none of Lightning's start-up
chatter that helps nobody."""

import logging
import re
import time
import warnings
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback, ProgressBar

from experiments import internals
from experiments.run.log import LOG, say

# Lightning's rank_zero_info lines that tell the user nothing about this run: advertising tips ("💡 Tip: ...
# litlogger", "... litmodels") and the TPU line on machines without one. "GPU available: ..., used: ..." stays:
# it says which accelerator was used.
CHATTER = re.compile(r"💡 Tip: |TPU available: False")


class _DropChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not CHATTER.match(record.getMessage())


# Deprecation warnings that Lightning's own code triggers in torch: the user can do nothing about them.
LIGHTNING_DEPRECATIONS = [
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.pytorch\.utilities\._pytree"),
]


def quiet_lightning() -> None:
    """Silence exactly those messages; every other log line and warning still shows."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropChatter) for f in logger.filters):
        logger.addFilter(_DropChatter())
    for message, module in LIGHTNING_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=module)
    # Lightning's packages print through a handler of their own, and stop there, only when the root logger had no
    # handler as they were imported. The commands import them after Hydra has set up logging: each line would then
    # show twice (the `lightning` package's handler and Hydra's). One line each, as when Lightning comes first.
    for name in ("lightning.pytorch", "lightning.fabric"):
        package = logging.getLogger(name)
        if package.propagate:
            package.addHandler(logging.StreamHandler())
            package.propagate = False


# An optimum's validation MSE below this is an exact fit, at float64 round-off (about 1e-30 for the seed's examples).
EXACT_FIT = 1e-12


def _figure(value, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def summary_lines(metrics: dict, run_dir: Path) -> list[str]:
    val_mse, optimum = metrics.get("val_mse"), metrics.get("optimal_val_mse")
    if val_mse is None:
        fit = "not measured (the run did not complete)"
    elif optimum is not None and optimum > EXACT_FIT:
        fit = f"{val_mse:.6g} = {val_mse / optimum:.4f} x the optimum {optimum:.6g}"
    elif optimum is not None:  # noise-free data (the seed's examples): a ratio to ~0 says nothing
        fit = f"{val_mse:.6g}; the optimum fits exactly ({optimum:.2g})"
    else:
        fit = f"{val_mse:.6g}"
    status = metrics["status"]
    if metrics.get("stop_reason"):
        status += f", stopped early at epoch {metrics['stopped_epoch']}: {metrics['stop_message']}"
    lines = [f"status      {status}", f"val_mse     {fit}"]
    if fitted := metrics.get("batch_fit"):
        ranks = metrics["world_size"]
        lines.append(
            f"batch       {metrics['effective_batch_size']:,} = micro-batch {fitted['micro_batch']:,} x "
            f"{metrics['accumulate_grad_batches']} accumulated x {ranks} rank{'s' if ranks > 1 else ''} "
            f"(batch.effective: the largest that fits {fitted['budget_mb']:,.4g} MiB at "
            f"{fitted['bytes_per_sample']:,.0f} bytes a sample)"
        )
    return [
        *lines,
        f"speed       {_figure(metrics.get('samples_per_sec'), ',.0f')} samples/s, "
        f"{_figure(metrics.get('step_time_ms'), '.3f', ' ms')} a step, "
        f"peak memory {_figure(metrics.get('peak_memory_mb'), ',.0f', ' MB')}",
        f"run dir     {run_dir}",
    ]


def print_summary(metrics: dict, run_dir: Path) -> None:
    """The last lines a run prints, into its train.log too (rank 0 only: the caller checks)."""
    say("\n".join(["", *summary_lines(metrics, run_dir)]))


class EpochLog(Callback):
    """One line as each training epoch ends, with the loss, the validation MSE against the optimum and the speed,
    into the run's train.log (experiments.run.log), beside a terminal's progress bar. It reads the clock as an
    epoch starts and ends and around validation, never on a training step."""

    def __init__(self):
        super().__init__()
        self.enabled = True
        self.epoch_start = self.validation_start = None

    def emit(self, line: str) -> None:
        LOG.info(line)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epoch_start, self.paused, self.first_batch = time.perf_counter(), 0.0, _micro_steps(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.validation_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.epoch_start is not None and self.validation_start is not None:
            self.paused += time.perf_counter() - self.validation_start

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled or self.epoch_start is None:
            return
        seconds = time.perf_counter() - self.epoch_start - self.paused
        samples = (_micro_steps(trainer) - self.first_batch) * trainer.datamodule.batch_size
        self.emit("  ".join(epoch_line(trainer, samples / max(seconds, 1e-9))))


class EpochLines(EpochLog, ProgressBar):
    """The progress of a run whose stdout is not a terminal (a log file: SLURM, nohup, CI): the epoch lines, printed
    and in train.log; never a redraw. A ProgressBar, so that Lightning adds no bar of its own."""

    def emit(self, line: str) -> None:
        say(line)

    def disable(self) -> None:
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True

    @property
    def is_enabled(self) -> bool:
        return self.enabled


def epoch_line(trainer: L.Trainer, samples_per_sec: float) -> list[str]:
    epochs = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""  # -1: steps bound it
    parts = [f"epoch {trainer.current_epoch + 1}{epochs}", f"step {trainer.global_step}"]
    if (loss := getattr(trainer.lightning_module, "last_loss", None)) is not None:  # the epoch's last step's
        parts.append(f"train/loss {loss.item():.6g}")
    if (mse := trainer.callback_metrics.get("val/mse")) is not None:
        optimum = trainer.datamodule.optimal_val_mse
        ratio = f" = {mse.item() / optimum:.4f} x the optimum" if optimum > EXACT_FIT else ""
        parts.append(f"val/mse {mse.item():.6g}{ratio}")
    return [*parts, f"{samples_per_sec:,.0f} samples/s"]


def _micro_steps(trainer: L.Trainer) -> int:
    return internals.micro_batches_completed(trainer)  # training batches of the whole fit
