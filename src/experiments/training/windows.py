"""Windows: the micro-batches that one iteration of Lightning's training loop runs.

Lightning's loop costs about 0.3-0.6 ms an iteration on a CPU (hooks, progress tracking, callbacks), as much as two
whole steps of the seed's model at a small batch. So the module's `training_step` runs a window of several
micro-batches, in plain PyTorch, and Lightning's loop runs once a window. A window ends wherever Lightning would do
something between two batches, so that everything it does happens where it would with one batch an iteration: at
an epoch's end, at `max_steps`, where validation or a checkpoint every n steps is due, and during the first
`WARMUP_BATCHES` micro-batches of a fit, which PerfMonitor leaves out of the steady state
(experiments.training.perf). And at a log step: the `intervals`-th from where the window starts, as many log
intervals as run in about `window_s` seconds (the top-level setting, 0.1 by default; `Pace`), at least one. With
the default log interval, 10 steps, a window of the seed's model at B=64 is 40 intervals; one of an MLP whose step
takes 10 ms is one. The log steps inside a window have their train/loss written at its end, with their own steps
(experiments.training.module); what Lightning's hooks do at a log step (perf/*, the progress bar, the ranks'
agreement on a signal) happens at the log steps that end a window, at most about `window_s` apart, or a log
interval when that is longer. `window_s=0`: a window ends at every log step.

Several ranks run the same windows with no collective of their own to agree on them: each computes the window from
the same Position (Lightning's counters, the same on every rank, and the same `intervals`: a rank's measured pace is
agreed in the one all-reduce that the ranks make at a log step's window end anyway, for a signal's stop,
experiments.training.interruption). What the ranks must agree on (a signal's stop, a target, validation's figures)
is agreed where Lightning's hooks run, at some windows' ends; inside a window the only collective is the gradients'
all-reduce of each optimizer step, as in a plain DDP loop.
"""

from dataclasses import dataclass

from experiments import internals

WARMUP_BATCHES = 5  # micro-batches at the start of a fit run one optimizer step a window


@dataclass(frozen=True)
class Position:
    """Where training stands when a window starts, and what ends one: all counted as Lightning counts them."""

    step: int  # optimizer steps done (trainer.global_step)
    batch: int  # micro-batches done in this epoch
    batches: int  # micro-batches in this epoch (trainer.num_training_batches)
    accumulate: int = 1  # micro-batches per optimizer step
    log_every: int = 50  # trainer.log_every_n_steps; 0: never
    max_steps: int = -1  # -1: no limit
    every_steps: tuple[int, ...] = ()  # optimizer-step periods that something is due at (a checkpoint)
    val_every: int | None = None  # validation every this many micro-batches of `val_count`
    val_count: int = 0  # the micro-batches that `val_every` counts: this epoch's, or the whole run's
    one_step: bool = False  # warming up, or validation by time (checked between iterations)
    intervals: int = 1  # the log steps ahead that end the window (Pace)


def window_batches(at: Position) -> int:
    """The number of micro-batches of the next window (at least 1)."""

    def end_of_step(ahead: int) -> int:
        """The epoch position at which the `ahead`-th optimizer step from here ends (the epoch's last may be
        short: Lightning steps on an epoch's last batch)."""
        return min((at.batch // at.accumulate + ahead) * at.accumulate, at.batches)

    end = at.batches
    if at.one_step:
        end = min(end, end_of_step(1))
    if at.log_every:
        # to the `intervals`-th log step ahead, included
        end = min(end, end_of_step(at.intervals * at.log_every - at.step % at.log_every))
    if at.max_steps >= 0:
        end = min(end, end_of_step(max(at.max_steps - at.step, 1)))
    for period in at.every_steps:
        end = min(end, end_of_step(period - at.step % period))
    if at.val_every:
        end = min(end, at.batch + at.val_every - at.val_count % at.val_every)
    return max(end - at.batch, 1)


class Pace:
    """How many log intervals a window runs: as many as last at most `window_s` seconds, at least one, from the
    latest window's time a step. With several ranks, each rank's time is agreed on (the slowest's) before it counts
    (`settle`), so that every rank runs the same windows; with one, each window's counts at once."""

    def __init__(self, window_s: float, log_every: int, agreed: bool):
        self.window_s, self.log_every, self.agreed = window_s, log_every, agreed
        self.intervals = 1
        self.step_s = 0.0  # this rank's latest window: seconds an optimizer step (0: none measured yet)

    def window_done(self, seconds: float, steps: int) -> None:
        if steps:
            self.step_s = seconds / steps
            if not self.agreed:
                self.settle(self.step_s)

    def settle(self, step_s: float) -> None:
        """The next windows' intervals, from an optimizer step's seconds (every rank's the same)."""
        if self.window_s > 0 and self.log_every > 0 and step_s > 0:
            self.intervals = max(1, int(self.window_s / (step_s * self.log_every)))


def position(trainer, warming_up: bool = False, intervals: int = 1) -> Position:
    """Where training stands at the start of a window, and what ends one, from Lightning's loop counters: its
    `batch_idx`, the checkpoints' periods and validation's schedule."""
    loop = trainer.fit_loop.epoch_loop
    every_steps = tuple(p for p in map(internals.checkpoint_period, trainer.checkpoint_callbacks) if p)
    val_every = trainer.val_check_batch
    if not isinstance(val_every, int) or val_every >= trainer.num_training_batches or not trainer.enable_validation:
        val_every = None  # validation at the epoch's end only, or never
    # Time-based validation is checked after each iteration of Lightning's loop. Several ranks need no step a
    # window: each computes the same window from the same counters, and a signal is agreed at a log step's end.
    return Position(
        step=trainer.global_step,
        batch=loop.batch_idx,  # the window's first batch, which Lightning has counted as `ready`
        batches=trainer.num_training_batches,
        accumulate=trainer.accumulate_grad_batches,
        log_every=trainer.log_every_n_steps,
        max_steps=trainer.max_steps,
        every_steps=every_steps,
        val_every=val_every,
        val_count=loop.batch_idx if trainer.check_val_every_n_epoch is not None else loop.total_batch_idx,
        one_step=warming_up or internals.validates_by_time(trainer),
        intervals=intervals,
    )
