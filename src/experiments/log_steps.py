"""The one notion of "every `trainer.log_every_n_steps` steps": the steps that Lightning's logger writes.

Lightning writes logged values on optimizer step s (counted from 1 over the whole fit, a resume included) when
s % log_every_n_steps == 0, and on the step at which the trainer stops (its logger connector's
`should_update_logs`). `train/loss`, the perf figures, the divergence check on accelerators and the progress
bar all follow it, so that their points fall on the same steps (under accumulation: the same optimizer steps).
"""

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

from experiments import internals


def is_log_step(trainer: L.Trainer) -> bool:
    """Whether the optimizer step now running (under accumulation: each of its micro-steps) is a log step.

    True from `on_train_batch_start` to `on_train_batch_end` of that step: Lightning counts the step only after
    its `on_train_batch_end`.
    """
    return internals.is_log_step(trainer)


def ends_optimizer_step(trainer: L.Trainer) -> bool:
    """Whether the micro-step now running ends with an optimizer step (always, without accumulation); the
    last batch of an epoch steps even when its accumulation is short, as Lightning does."""
    return not internals.accumulating(trainer)


class LogStepProgressBar(TQDMProgressBar):
    """Lightning's progress bar, with its training bar redrawn on log steps and at an epoch's last batch: a
    redraw on every step costs as much as a step of a small model. Validation bars keep Lightning's rule (every
    `refresh_rate` batches)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int):
        bar, n = self.train_progress_bar, batch_idx + 1
        if bar is None or not self.is_enabled:
            return
        if (is_log_step(trainer) and ends_optimizer_step(trainer)) or n == bar.total:
            if not bar.disable:
                bar.n = n
                bar.refresh()
            bar.set_postfix(self.get_metrics(trainer, pl_module))
