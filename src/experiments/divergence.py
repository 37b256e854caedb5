"""A loss that is not finite stops the run before the bad step reaches the weights."""

import lightning as L
import torch

from experiments.run.exits import RunFailed


def diverged(loss: torch.Tensor, trainer: L.Trainer, step: int, batch_idx: int) -> RunFailed:
    """The failure of a run whose loss is not finite at the micro-batch `batch_idx` of the epoch, in optimizer step
    `step` (counted from 0; the module checks before the backward pass, experiments.module).

    On the CPU reading the loss costs well under a microsecond, so every micro-batch is checked and the run stops
    at the step that diverged. On an accelerator `.item()` waits for the device, so the loss is read once a
    window (experiments.windows: a window ends at least at every log step): a diverged model stays non-finite,
    so the run still stops, at most `trainer.log_every_n_steps` optimizer steps late.
    """
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    return RunFailed(
        f"training diverged: the loss is {loss.item()} at step {step} "
        f"(epoch {trainer.current_epoch}, batch {batch_idx}); try a lower optimizer.lr (now {lr:g})"
    )
