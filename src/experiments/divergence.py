"""A loss that is not finite stops the run before the bad step reaches the weights."""

import math

import lightning as L
import torch

from experiments.log_steps import is_log_step
from experiments.run.exits import RunFailed


def check_loss(loss: torch.Tensor, trainer: L.Trainer, batch_idx: int) -> None:
    """Raise `RunFailed` when the loss is not finite.

    On the CPU reading the loss costs well under a microsecond, so every step is checked and the run stops
    at the step that diverged. On an accelerator, `.item()` waits for the device, so the loss is read only on
    log steps (experiments.log_steps, where Lightning syncs to log anyway): a diverged model stays non-finite,
    so the run still stops, at most `trainer.log_every_n_steps` optimizer steps late.
    """
    if loss.device.type != "cpu" and not is_log_step(trainer):
        return
    value = loss.item()
    if not math.isfinite(value):
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        raise RunFailed(
            f"training diverged: the loss is {value} at step {trainer.global_step} "
            f"(epoch {trainer.current_epoch}, batch {batch_idx}); try a lower optimizer.lr (now {lr:g})"
        )
