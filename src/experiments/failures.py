"""How a run ends early: interrupted by a signal, diverged, or out of memory; and the exit code of each.

Exit codes of `python train.py` (README, "Failures and resuming"):
0 completed; 1 the run failed (divergence, out of memory, a crash); 2 bad input (`ConfigError`);
128 + signal number when interrupted: 130 for SIGINT (Ctrl-C), 143 for SIGTERM (a scheduler's stop), 138 for
SIGUSR1 (a scheduler's pre-emption warning).
"""

import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from experiments.log_steps import is_log_step

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


class RunFailed(RuntimeError):
    """The run cannot go on, for a reason the message explains with what to change."""


# The signals that stop a run: Ctrl-C, a scheduler's stop (SIGTERM), and a scheduler's pre-emption warning
# (SIGUSR1, e.g. SLURM's `--signal=USR1@60`), which is treated like SIGTERM.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Interrupted(BaseException):
    """A stop asked for by a signal. A BaseException, like KeyboardInterrupt, so that a Hydra sweep stops
    rather than recording a failed job and starting the next one. `checkpoint` is None when the signal came
    before training started: there was nothing to save."""

    def __init__(self, signum: int, checkpoint: str | None):
        self.signum = signum
        self.checkpoint = checkpoint
        name = signal.Signals(signum).name
        if checkpoint is None:
            message = f"interrupted by {name} before training started; nothing was saved"
        else:
            message = f"interrupted by {name}; resume with ckpt_path={checkpoint}"
        super().__init__(message)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _stop_now(signum: int, frame) -> None:
    raise Interrupted(signum, None)


@contextmanager
def handling_signals(handler: Callable[[int, object], None]) -> Iterator[None]:
    """`handler` for every signal of SIGNALS while the block runs, then the previous handlers again."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def stopping_at_once() -> AbstractContextManager:
    """While a command starts (Hydra composes, the run sets up), a signal ends it at once: nothing to save."""
    return handling_signals(_stop_now)


class Interruption(Callback):
    """A signal of SIGNALS stops the run at the next optimizer-step boundary, saves the exact position there
    and raises `Interrupted` (exit 128 + the signal's number); at every moment of the run:

    - before training starts (the data is made, the ranks start): the run stops at once, nothing saved;
    - while training, validation included: at the next optimizer-step boundary; when the signal comes in
      the last validation, after it, when training ends (the saved position is the end);
    - after training (the final figures are written): the records are completed, then the run stops.

    `handling()` installs the handlers for the whole run; Lightning registers its own SIGTERM handler just
    before its loops start (keeping ours inside its chain, but its own raises `SIGTERMException` after
    whatever micro-batch is running, dropping the gradients of a half-accumulated step, and exits 0), so
    `on_train_start` puts ours back, and Lightning's teardown restores ours when fit ends. SIGINT would
    otherwise be a KeyboardInterrupt anywhere, mid optimizer step included, which Lightning turns into
    exit 1. The stop point is `on_train_batch_end`, where ModelCheckpoint's `every_n_train_steps` saves
    and Lightning's loops know how to resume mid-epoch; the data loader's position travels in the
    checkpoint too (`BatchLoader.state_dict`).

    Ranks agree on the step to stop at through one small all-reduce per optimizer step, only when there is
    more than one rank: a signal reaches one rank (`kill` of the launching process) or all of them at
    slightly different times (Ctrl-C), and `save_checkpoint` is a collective that every rank must enter.
    """

    def __init__(self, checkpoint: str):
        self.checkpoint = checkpoint
        self.signum: int | None = None
        self.phase = "setup"  # setup, training, finished

    def handling(self) -> AbstractContextManager:
        return handling_signals(self._record)

    def _record(self, signum: int, frame) -> None:
        if self.phase == "setup":
            raise Interrupted(signum, None)
        self.signum = self.signum or signum

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for signum in SIGNALS:
            signal.signal(signum, self._record)
        self.phase = "training"

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        batches = batch_idx + 1
        if batches % trainer.accumulate_grad_batches and batches != trainer.num_training_batches:
            return  # mid accumulation: the gradients gathered so far would not be in a checkpoint
        self._stop_if_asked(trainer, mid_step=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_if_asked(trainer)  # a signal during the last validation
        self.phase = "finished"

    def _stop_if_asked(self, trainer: L.Trainer, mid_step: bool = False) -> None:
        stop = self.signum is not None
        if trainer.world_size > 1:
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop:
            self.phase = "finished"
            if mid_step:
                # Lightning writes this step's logged metrics only after this hook: write them now, or the step
                # would be missing from the curves of the resumed run (it starts at the next step).
                trainer._logger_connector.on_batch_end()
                trainer._logger_connector.update_train_step_metrics()
            trainer.save_checkpoint(self.checkpoint)
            raise Interrupted(self.signum or signal.SIGTERM, self.checkpoint)

    def raise_if_signalled(self) -> None:
        """After the run's records are written: a signal that came after training ends the command now."""
        if self.signum is not None:
            raise Interrupted(self.signum, self.checkpoint)


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
