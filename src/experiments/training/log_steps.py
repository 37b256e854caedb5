"""The one notion of "every `trainer.log_every_n_steps` steps": the steps that Lightning's logger writes.

Lightning writes logged values on optimizer step s (counted from 1 over the whole fit, a resume included) when
s % log_every_n_steps == 0, and on the step at which the trainer stops (its logger connector's
`should_update_logs`). `train/loss`, the perf figures, the divergence check on accelerators and the progress
bar all follow it, so that their points fall on the same steps (under accumulation: the same optimizer steps).
A log step ends a window of the module's training steps (experiments.training.windows), where Lightning's hooks run.
"""

import math
import time

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

from experiments import internals


def is_log_step(trainer: L.Trainer) -> bool:
    """Whether the optimizer step now running (under accumulation: each of its micro-steps) is a log step; in a
    window's `on_train_batch_end`, whether the window's last step is (experiments.training.windows).

    Lightning counts the step only after its `on_train_batch_end`.
    """
    return internals.is_log_step(trainer)


def every_n_steps(step: int, log_every: int) -> bool:
    """Whether optimizer step `step` (counted from 1 over the fit) is one of Lightning's every
    `log_every_n_steps` steps (the rule of `is_log_step` without the stop's step): for the log steps inside a
    window, which the trainer does not see one by one."""
    return log_every > 0 and step % log_every == 0


def ends_optimizer_step(trainer: L.Trainer) -> bool:
    """Whether the micro-step now running ends with an optimizer step (always, without accumulation); the
    last batch of an epoch steps even when its accumulation is short, as Lightning does."""
    return not internals.accumulating(trainer)


class LogStepProgressBar(TQDMProgressBar):
    """Lightning's progress bar, its training bar redrawn on log steps at most every `REDRAW_EVERY_S` seconds
    (tqdm's own interval) and at an epoch's last batch: a redraw with its metrics costs as much as several steps
    of a small model, and at a small batch log steps come a hundred times a second. Validation bars keep
    Lightning's rule (every `refresh_rate` batches)."""

    REDRAW_EVERY_S = 0.1

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._drawn_at = -math.inf

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        bar, n = self.train_progress_bar, internals.micro_batches_done(trainer)[0]  # a window's last batch
        if bar is None or not self.is_enabled:
            return
        now = time.monotonic()
        due = is_log_step(trainer) and ends_optimizer_step(trainer) and now - self._drawn_at >= self.REDRAW_EVERY_S
        if due or n == bar.total:
            self._drawn_at = now
            bar.n = n
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # and redraws
