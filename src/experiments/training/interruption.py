"""A signal stops a run at an optimizer-step boundary and saves the exact position there."""

import signal
from contextlib import AbstractContextManager

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from experiments import internals
from experiments.distributed import comm
from experiments.run.signals import Interrupted, handling_signals, install
from experiments.training.log_steps import ends_optimizer_step, is_log_step


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

    Ranks agree on the step to stop at, and on the signal, through one small all-reduce at each log step's window
    end and at the end of training (experiments.training.windows: the hook runs once a window), only when there is
    more than one rank (the same all-reduce agrees on the windows' pace, the slowest rank's step time: windows.Pace):
    a signal reaches one rank (`kill` of the launching process) or all of them at slightly different times (Ctrl-C,
    SLURM's signals to each node), and `save_checkpoint` is a collective that every rank must enter. With one rank
    the module ends its window at the next optimizer step (experiments.training.module); with several every rank
    runs its window to the end, the same optimizer step on each, so a stop waits at most a window: about `window_s`
    seconds of steps, or one log interval when that is longer (0: an epoch). Not at the windows that end at an
    epoch's end or a save between two log steps: at a large batch an epoch is a few steps, and an all-reduce there
    costs about one step's compute every few steps. A rank stops on what the all-reduce returned, never on what its
    handler recorded since: a signal that lands while the all-reduce runs is handled when it returns, on that rank only,
    and a rank that stopped on it would wait in the checkpoint's barrier for ranks gone on to the next window (a
    hang until SLURM's KillWait killed the job, nothing saved). Such a signal is agreed on at the next window.
    """

    def __init__(self, checkpoint: str):
        self.checkpoint = checkpoint
        self.signum: int | None = None  # the first signal this rank received; once stopped, the one agreed on
        self.phase = "setup"  # setup, training, finished

    def handling(self) -> AbstractContextManager:
        return handling_signals(self._record)

    def _record(self, signum: int, frame) -> None:
        if self.phase == "setup":
            raise Interrupted(signum, None)
        self.signum = self.signum or signum

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        install(self._record)  # over Lightning's own SIGTERM handler (see above)
        if trainer.world_size > 1:
            internals.skip_sigterm_broadcast(trainer)  # that handler's flag, broadcast every window: never set now
        self.phase = "training"

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        if not ends_optimizer_step(trainer):  # mid accumulation, the gradients gathered so far would not be saved
            return
        if trainer.world_size == 1 or is_log_step(trainer) or not trainer.log_every_n_steps:
            self._stop_if_asked(trainer, pl_module, mid_step=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_if_asked(trainer, pl_module)  # a signal during the last validation
        self.phase = "finished"

    def agree(self, strategy, pace=None) -> int | None:
        """The signal every rank stops on (None: none yet), from one all-reduce of each rank's; SIGUSR1 first: a
        SLURM warning reaches each node's ranks at its own time, and rank 0, which asks SLURM for the requeue
        (`slurm.requeue_after`), may stop on another rank's SIGUSR1 before its own arrives. In the same all-reduce,
        the windows' `pace` (windows.Pace): the slowest rank's time a step, settled on every rank."""
        received = self.signum  # once: the handler may set it while the all-reduce runs (see the class)
        step_s = pace.step_s if pace is not None else 0.0
        seen = torch.tensor([received or 0, received == signal.SIGUSR1, step_s], dtype=torch.float64,
                            device=strategy.root_device)  # fmt: skip
        comm.agree(seen, torch.distributed.ReduceOp.MAX)
        signum, usr1, step_s = seen.tolist()
        if pace is not None:
            pace.settle(step_s)
        if signum == 0:
            return None
        return signal.SIGUSR1 if usr1 else int(signum)

    def _stop_if_asked(self, trainer: L.Trainer, pl_module: L.LightningModule, mid_step: bool = False) -> None:
        pace = getattr(pl_module, "pace", None)
        stop = self.agree(trainer.strategy, pace) if trainer.world_size > 1 else self.signum
        if stop is not None:
            self.signum = stop
            self.phase = "finished"
            if mid_step:
                # Lightning writes this step's logged metrics only after this hook: write them now, or the step
                # would be missing from the curves of the resumed run (it starts at the next step).
                internals.write_step_metrics_now(trainer)
            trainer.save_checkpoint(self.checkpoint, weights_only=False)
            raise Interrupted(self.signum, self.checkpoint)

    def raise_if_signalled(self) -> None:
        """After the run's records are written: a signal that came after training ends the command now."""
        if self.signum is not None:
            raise Interrupted(self.signum, self.checkpoint)
