"""Repeated timings inside one run: the run's steady state cut into stretches of about `seconds` each, timed on
PerfMonitor's own clock (experiments.training.perf: validation and checkpoint saves left out, as metrics.json's
`samples_per_sec` leaves them out), so that a figure is a median with its spread, not one number.

A stretch ends at the end of a window of steps (experiments.training.windows) at least `seconds` after its start
(or `steps` micro-steps: a trial of a fixed length, whose val_mse another trial's is compared with, cut in as many):
the callback runs once a window, at no cost a step. With `stop`, the run ends once `repeats` stretches are timed
(or, past `limit_s` seconds of training, once 3 are: a machine far busier than the budget foresaw) (one process:
several ranks each time their own stretches, and one rank alone must not stop, so a DDP trial runs to
its `trainer.max_steps`). The warm-up (the first steps, and torch.compile's compilation in them) is timed apart:
from the fit's start to PerfMonitor's steady state. Rank 0 writes what it timed to `path` (JSON) at the end.
"""

import json
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback

from experiments.run.files import write_atomic
from experiments.training.clocks import synchronized_clock
from experiments.training.perf import PerfMonitor


class Stretches(Callback):
    def __init__(self, seconds: float, repeats: int, path: str | None = None, stop: bool = True,
                 limit_s: float | None = None, steps: int | None = None):  # fmt: skip
        self.seconds, self.repeats, self.path, self.stop, self.limit_s = seconds, repeats, path, stop, limit_s
        self.steps = steps  # micro-steps a stretch, instead of `seconds`: a trial of a fixed length, cut in `repeats`
        self.rates: list[float] = []  # samples a second of each stretch
        self.warmup_s: float | None = None
        self._start: tuple[float, int] | None = None  # (training seconds, micro-steps) where this stretch began

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        perf = next(c for c in trainer.callbacks if isinstance(c, PerfMonitor))
        if perf.steady_start is None:
            return
        if self.warmup_s is None:
            self.warmup_s = perf.steady_start["time"] - perf.fit_start["time"]
        now = _training_clock(perf)
        if self._start is None:
            self._start = (perf.steady_start["time"], perf.steady_start["steps"])
        if (perf.steps - self._start[1] < self.steps) if self.steps else (now - self._start[0] < self.seconds):
            return
        synchronized_clock(pl_module.device)  # a GPU's queued steps are part of the stretch
        now = _training_clock(perf)
        steps = perf.steps - self._start[1]
        self.rates.append(perf.global_batch_size * steps / (now - self._start[0]))
        self._start = (now, perf.steps)
        over = self.limit_s is not None and now - perf.fit_start["time"] > self.limit_s and len(self.rates) >= 3
        if self.stop and ((len(self.rates) >= self.repeats and not self.steps) or over):  # steps: max_steps ends it
            trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.path and trainer.is_global_zero:
            write_atomic(Path(self.path), json.dumps({"rates": self.rates, "warmup_s": self.warmup_s}) + "\n")


def _training_clock(perf: PerfMonitor) -> float:
    """PerfMonitor's training clock now (the host's, less validation and saves), on the scale of its marks."""
    return perf.fit_start["time"] + perf.training_seconds()
