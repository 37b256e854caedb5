"""A loss that is not finite stops the run before the bad step reaches the weights."""

import math

import lightning as L
import torch

from experiments.run.exits import RunFailed


def check_loss(loss: torch.Tensor, trainer: L.Trainer, step: int, batch_idx: int) -> None:
    """Raise `RunFailed` when the loss is not finite at the micro-batch `batch_idx` of the epoch, in optimizer step
    `step` (counted from 0; the module checks before the backward pass, experiments.training.module).

    On the CPU reading the loss costs well under a microsecond, so every micro-batch is checked and the run stops
    at the step that diverged. On an accelerator `.item()` waits for the device, so the loss is read once a
    window (experiments.training.windows: a window ends at least at every log step): a diverged model stays non-finite,
    so the run still stops, at most `trainer.log_every_n_steps` optimizer steps late.
    """
    value = loss.item()
    if not math.isfinite(value):
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        raise RunFailed(
            f"training diverged: the loss is {value} at step {step} "
            f"(epoch {trainer.current_epoch}, batch {batch_idx}); try a lower optimizer.lr (now {lr:g})"
        )


def check_before_saving(trainer: L.Trainer, module: L.LightningModule) -> None:
    """Raise `RunFailed` rather than save weights that diverged: every checkpoint (the periodic last.ckpt, a
    signal's, a ModelCheckpoint's top-k) passes here first (experiments.training.last_checkpoint).

    On an accelerator `check_loss` reads the loss only at a window's last micro-batch, before its backward pass, so
    a window's steps (its last one included, or a signal's shortened window) can make the weights non-finite
    unseen; here the last step's loss and the weights themselves are checked (one device sync a save). The
    checkpoint already on disk, the last finite one, is kept.

    Every rank reaches the same verdict with no collective (a save is entered by every rank, so one rank raising
    alone would leave the others waiting): under DDP the ranks hold the same weights, bit for bit (the same
    all-reduced gradients, the same update), and each rank's own last loss was checked before its backward pass
    (`check_loss`: a rank with a non-finite one has already stopped the run).
    """
    loss = getattr(module, "last_loss", None)
    finite = [torch.isfinite(t).all() for t in [*module.parameters(), *([] if loss is None else [loss])]]
    ok = bool(torch.stack([f.to(finite[0].device) for f in finite]).all()) if finite else True
    if ok:
        return
    lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else float("nan")
    value = None if loss is None else loss.item()
    what = "the weights are not finite" if value is None or math.isfinite(value) else f"the loss is {value}"
    raise RunFailed(
        f"training diverged: {what} at step {trainer.global_step} (epoch {trainer.current_epoch}), found before "
        f"saving a checkpoint, which was not saved (the last one on disk keeps finite weights); try a lower "
        f"optimizer.lr (now {lr:g})"
    )
