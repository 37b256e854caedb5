"""A trial: one option trained as train.py trains it, long enough for `repeats` timed stretches of its steady state
(experiments.advice.stretches), in a run dir of its own under the advice's (`<advice dir>/trials/<n>/`).

One device: in this process, through `experiments.commands.train.train` itself (the recipe, the Regressor's step,
PerfMonitor's clock, the memory checks: a batch the lab refuses is a batch that does not fit), after the warm-up
that every run pays. Several devices: `python train.py ...` as a command (Lightning starts the ranks from the command
line), in a session of its own, so that an interrupted advice ends it and its ranks (`stopped`).
"""

import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from omegaconf import DictConfig, OmegaConf

from experiments.advice.plan import Option
from experiments.commands.entry import CONFIG_DIR
from experiments.commands.train import train
from experiments.config.errors import ConfigError

TRAIN_PY = Path(CONFIG_DIR).parent / "train.py"
STRETCHES = "experiments.advice.stretches.Stretches"


@dataclass
class Measurement:
    option: Option
    rates: list[float] = field(default_factory=list)  # samples a second of each timed stretch
    warmup_s: float | None = None  # the fit's first steps (and torch.compile's compilation in them)
    metrics: dict = field(default_factory=dict)  # the trial's metrics.json
    error: str | None = None  # why it has no figure: does not fit, out of memory, failed

    @property
    def median(self) -> float | None:
        return statistics.median(self.rates) if self.rates else None

    @property
    def low(self) -> float | None:
        return self._quartiles()[0]

    @property
    def high(self) -> float | None:
        return self._quartiles()[1]

    def _quartiles(self) -> tuple[float | None, float | None]:
        """The spread: the first and third quartiles of the stretches' rates (of 5, the 2nd and 4th), so that one
        stretch that met a burst of other work on a shared machine does not make every option look alike."""
        if len(self.rates) < 2:
            return (self.rates[0], self.rates[0]) if self.rates else (None, None)
        q1, _, q3 = statistics.quantiles(self.rates, n=4, method="inclusive")
        return q1, q3

    def record(self) -> dict:
        keys = ("samples_per_sec", "step_time_ms", "transfer_ms", "compute_ms", "val_mse", "global_step",
                "peak_memory_mb", "global_batch_size", "effective_batch_size", "precision", "mfu")  # fmt: skip
        return {
            "name": self.option.name, "knob": self.option.knob, "settings": self.option.settings,
            "micro_batch": self.option.micro, "accumulate": self.option.accumulate, "devices": self.option.devices,
            "keeps_result": self.option.keeps_result, "samples_per_sec": self.median, "low": self.low,
            "high": self.high, "rates": self.rates, "warmup_s": self.warmup_s, "error": self.error,
            "run": {k: self.metrics.get(k) for k in keys},
        }  # fmt: skip


def trial_config(base: DictConfig, option: Option, stretch: dict, extra: dict) -> DictConfig:
    """The user's config with the option's settings, the stretches' callback, no progress bar (the advice has its
    own), and `extra` (a trial's length, its log interval)."""
    cfg = base.copy()
    if cfg.get("scheduler") is None:  # no schedule over the run's length: the stretches end the trial, not its epochs
        extra = {"trainer.max_epochs": -1, **extra}
    for key, value in {**option.settings, **extra, "trainer.enable_progress_bar": False}.items():
        OmegaConf.update(cfg, key, value, merge=False)
    if option.settings.keys() & {"data.batch_size", "trainer.accumulate_grad_batches"}:
        OmegaConf.update(cfg, "batch.effective", None, merge=False)
    OmegaConf.update(cfg, "callbacks.advice_stretches", {"_target_": STRETCHES, **stretch}, merge=False, force_add=True)
    return cfg


def measure_here(base: DictConfig, option: Option, run_dir: Path, seconds: float, repeats: int,
                 extra: dict | None = None, limit_s: float | None = None,
                 steps: int | None = None) -> Measurement:  # fmt: skip
    """One device, in this process. Its output (Lightning's lines, the run's summary) goes to `<run dir>.log`."""
    found = Measurement(option)
    stretch = {"seconds": seconds, "repeats": repeats, "path": str(run_dir / "stretches.json"), "stop": True,
               "limit_s": limit_s, "steps": steps}  # fmt: skip
    cfg = trial_config(base, option, stretch, extra or {})
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(run_dir.parent / f"{run_dir.name}.log", "w") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        logging.disable(logging.INFO)  # Lightning's lines, once a trial: its handlers hold the terminal's stream
        try:
            found.metrics = train(cfg, run_dir)
        except ConfigError as err:  # the lab's own checks: a batch whose step does not fit in memory
            found.error = f"refused: {err}"
        except torch.OutOfMemoryError as err:
            found.error = f"out of memory: {str(err).splitlines()[0]}"
        except (RuntimeError, SystemExit) as err:
            found.error = f"failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        finally:
            logging.disable(logging.NOTSET)
    if found.error is None and found.metrics.get("status") != "completed":
        found.error = f"failed: the trial ended {found.metrics.get('status')} (its {run_dir}/metrics.json)"
    return _read_stretches(found, run_dir)


def measure_apart(overrides: list[str], option: Option, run_dir: Path, seconds: float, repeats: int,
                  max_steps: int, timeout_s: float) -> Measurement:  # fmt: skip
    """Several devices: `python train.py <the user's overrides> <the option's>` in a session of its own, for
    `max_steps` optimizer steps (every rank stops at the same step). Its output goes to `<run dir>.log`."""
    found = Measurement(option)
    stretch = {"_target_": STRETCHES, "seconds": seconds, "repeats": repeats, "path": str(run_dir / "stretches.json"),
               "stop": False}  # fmt: skip
    callback = "{" + ",".join(f"{k}:{json.dumps(v) if isinstance(v, str) else _yaml(v)}" for k, v in stretch.items())
    command = [
        sys.executable, str(TRAIN_PY), *overrides, *option.overrides(), "trainer.enable_progress_bar=false",
        f"trainer.max_steps={max_steps}", f"+callbacks.advice_stretches={callback}}}", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    if any(o.split("=", 1)[0].lstrip("+~") == "batch.effective" for o in overrides):
        command.insert(-1, "batch.effective=null")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        with stopped(child):
            try:
                code = child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                code, found.error = None, f"failed: still running after {timeout_s:.0f} s (stopped)"
    if code:
        lines = (run_dir.parent / f"{run_dir.name}.log").read_text().strip().splitlines()
        found.error = f"failed (exit {code}): {lines[-1] if lines else ''}"
    try:
        found.metrics = json.loads((run_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        found.error = found.error or "failed: the run wrote no metrics.json"
    return _read_stretches(found, run_dir)


@contextlib.contextmanager
def stopped(child: subprocess.Popen):
    """On the way out (an interrupt, the end of the budget), the child's whole session ends: SIGTERM (a run saves its
    position and stops; its ranks end with it), then SIGKILL after 10 s."""
    try:
        yield
    finally:
        if child.poll() is None:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, sig)
                try:
                    child.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # a rank that outlived its launcher


def _read_stretches(found: Measurement, run_dir: Path) -> Measurement:
    try:
        timed = json.loads((run_dir / "stretches.json").read_text())
    except (OSError, ValueError):
        return found
    found.rates, found.warmup_s = timed["rates"], timed["warmup_s"]
    if not found.rates and found.error is None:
        found.error = "no timing: the run ended before a stretch of steady-state steps"
    return found


def _yaml(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...")
