"""How a run ends early: interrupted by a signal, diverged, or out of memory; and the exit code of each.

Exit codes of `python train.py` (README, "Failures and resuming"):
0 completed; 1 the run failed (divergence, out of memory, a crash); 2 bad input (`ConfigError`);
128 + signal number when interrupted: 130 for SIGINT (Ctrl-C), 143 for SIGTERM (a scheduler's pre-emption).
"""

import math
import os
import signal
import threading
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from experiments.log_steps import is_log_step

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


class RunFailed(RuntimeError):
    """The run cannot go on, for a reason the message explains with what to change."""


class Interrupted(BaseException):
    """A stop asked for by a signal. A BaseException, like KeyboardInterrupt, so that a Hydra sweep stops
    rather than recording a failed job and starting the next one."""

    def __init__(self, signum: int, checkpoint: str):
        self.signum = signum
        self.checkpoint = checkpoint
        super().__init__(f"interrupted by {signal.Signals(signum).name}; resume with ckpt_path={checkpoint}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Interruption(Callback):
    """On SIGTERM or SIGINT: finish the current optimizer step, save the exact position, raise `Interrupted`.

    Why not Lightning's own handling: on SIGTERM Lightning 2.6 raises `SIGTERMException` after whatever
    micro-batch is running, which drops the gradients of a half-accumulated step (they are not in a
    checkpoint), and the process then exits 0; on SIGINT it raises KeyboardInterrupt wherever Python is,
    mid optimizer step included, then exits 1. Here both signals only set a flag, and the run stops at the
    next optimizer-step boundary, in `on_train_batch_end`: the same point where ModelCheckpoint's
    `every_n_train_steps` saves, which Lightning's loops know how to resume from mid-epoch. The data
    loader's position travels in the checkpoint too (`BatchLoader.state_dict`).

    Ranks agree on the step to stop at through one small all-reduce per optimizer step, only when there is
    more than one rank (Lightning itself already broadcasts its SIGTERM flag on every DDP step): a signal
    reaches one rank (`kill` of the launching process) or all of them at slightly different times (Ctrl-C),
    and `save_checkpoint` is a collective that every rank must enter at the same step.
    """

    def __init__(self, checkpoint: str):
        self.checkpoint = checkpoint
        self.signum: int | None = None
        self.previous: dict[int, object] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning registers its SIGTERM handler just before the loops start; replace it here and let its
        # signal connector put the original handlers back when fit ends.
        for signum in (signal.SIGTERM, signal.SIGINT):
            self.previous[signum] = signal.signal(signum, self._record)

    def _record(self, signum: int, frame) -> None:
        self.signum = signum

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        batches = batch_idx + 1
        if batches % trainer.accumulate_grad_batches and batches != trainer.num_training_batches:
            return  # mid accumulation: the gradients gathered so far would not be in a checkpoint
        stop = self.signum is not None
        if trainer.world_size > 1:
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop:
            trainer.save_checkpoint(self.checkpoint)
            raise Interrupted(self.signum or signal.SIGTERM, self.checkpoint)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A signal after the last step asks to stop a run that has already finished: nothing is lost.
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}


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


def out_of_memory(err: torch.OutOfMemoryError, batch_size: int, accumulate: int) -> RunFailed:
    smaller = max(batch_size // 2, 1)
    return RunFailed(
        f"out of device memory with data.batch_size={batch_size} ({str(err).splitlines()[0]}); try a smaller "
        f"data.batch_size, e.g. data.batch_size={smaller} trainer.accumulate_grad_batches={accumulate * 2}, "
        "which keeps the effective batch"
    )


def end_with_parent() -> None:
    """In a rank that a launcher started (Lightning's for ranks > 0, torchrun, srun): end when the launcher does.

    When rank 0 dies, the ranks it started wait in their next collective; gloo notices the closed connection
    at once, but NCCL may wait out its timeout (minutes). Lightning's `_ChildProcessObserver` covers the
    other direction only (rank 0 ends every rank when a child dies, within 5 s). SIGKILL, because a rank
    stuck inside a collective does not run Python signal handlers.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()
