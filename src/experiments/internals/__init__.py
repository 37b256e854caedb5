"""Every touch of Lightning's, Hydra's, torch's and torchmetrics' private API, in one place: the reason
`lightning<2.7` is pinned.

Each function below says why the public API does not do, and `probes.TOUCHES` lists, for each, how to tell that an
installed version still has it; tests/test_internals.py runs those checks, so an upgrade that removes one
fails there, naming it, rather than somewhere deep inside a run. Written against Lightning 2.6 and Hydra 1.3.

One touch acts at import: torchmetrics is imported without matplotlib (the first function), which works only
if this package is the process's first import of Lightning or torchmetrics. That is why every command imports it
first (experiments.commands.entry.load_task, Hydra's callbacks in experiments.sweeps.record): the one ordering a
caller must keep, and tests/test_internals.py checks that each command keeps it.
"""

# ruff: noqa: E402 (torchmetrics is imported before Lightning, which imports it: see the first function)
import sys
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from lightning_utilities.core.imports import RequirementCache


def import_torchmetrics_without_matplotlib() -> None:
    """Import torchmetrics as if matplotlib were not installed: a run never plots a metric, and the import of
    matplotlib (pyplot and its axes) is about 0.3 s of a 3 s start-up (docs/benchmarks.md, "Start-up").

    Why private: torchmetrics has no switch. `torchmetrics.metric` imports `torchmetrics.utilities.plot`, which
    imports matplotlib.pyplot whenever `_MATPLOTLIB_AVAILABLE` (a RequirementCache of lightning_utilities: is
    the package installed?) holds, and Lightning imports torchmetrics at its own import, so no import order
    avoids it. That cache is read once, while torchmetrics is imported: a check that says no to matplotlib
    for that moment only. What changes: `Metric.plot()` asks for matplotlib to be installed; matplotlib itself
    still imports (experiments.sweeps.report). It takes effect when this module is the process's first import of
    Lightning or torchmetrics: every command's (experiments.sweeps.record, experiments.commands.entry.load_task).
    """
    if "torchmetrics" in sys.modules:
        return  # imported already, with its plots
    check = RequirementCache._check_requirement

    def without_matplotlib(cache: RequirementCache) -> None:
        check(cache)
        if cache.requirement == "matplotlib":
            cache.available = False

    RequirementCache._check_requirement = without_matplotlib
    try:
        import torchmetrics  # noqa: F401
    finally:
        RequirementCache._check_requirement = check


import_torchmetrics_without_matplotlib()

import lightning as L
from hydra.core.utils import JobReturn
from lightning.fabric.plugins.precision import precision as fabric_precision
from lightning.fabric.utilities import device_parser
from lightning.fabric.utilities.logger import _add_prefix
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import subprocess_script
from torch.utils import _python_dispatch


def is_log_step(trainer: L.Trainer) -> bool:
    """Whether Lightning's logger writes on the optimizer step now running (`should_update_logs`): the one rule
    of "every log_every_n_steps steps", which Lightning does not expose (experiments.training.log_steps)."""
    return trainer._logger_connector.should_update_logs


def accumulating(trainer: L.Trainer) -> bool:
    """Whether the micro-step now running leaves its gradients for a later optimizer step: Lightning's own
    rule (`_should_accumulate`), which also knows that an epoch's last batch steps."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def write_step_metrics_now(trainer: L.Trainer) -> None:
    """Write the step's logged metrics now, inside `on_train_batch_end`: Lightning writes them only after that
    hook, and a run that stops in it (experiments.training.interruption) would lose the step from its curves."""
    trainer._logger_connector.on_batch_end()
    trainer._logger_connector.update_train_step_metrics()


# The attribute Lightning sets on the module before and after every hook call (about 45 a step); the module
# skips torch's Module.__setattr__ checks for it (experiments.training.module).
HOOK_NAME_ATTRIBUTE = "_current_fx_name"


def optimize_manually(module: L.LightningModule) -> None:
    """Switch `module` to manual optimization once the Trainer has checked its settings (the `setup` hook).

    The module's `training_step` runs a window of several micro-batches (training.windows), which only manual
    optimization allows. Lightning's configuration check (`_verify_loop_configurations`, which runs before the
    `setup` hooks) refuses `accumulate_grad_batches` and `gradient_clip_val` with manual optimization, yet the
    rest of its loop counts with them as with automatic optimization (`_should_accumulate`,
    `estimated_stepping_batches`, the restart bookkeeping of a resume): switching after the check keeps the
    Trainer's settings meaning what they mean, and the module accumulates and clips as Lightning would.
    """
    module.automatic_optimization = False


def checkpoint_period(callback) -> int | None:
    """The optimizer-step period of a checkpoint callback: ModelCheckpoint keeps it private (`_every_n_train_steps`),
    the run's LastCheckpoint (training.last_checkpoint) does not. Windows end where a save is due (training.windows)."""
    return getattr(callback, "_every_n_train_steps", None) or getattr(callback, "every_n_train_steps", None)


def validates_by_time(trainer: L.Trainer) -> bool:
    """Whether validation is due by time (`val_check_interval` as a duration), which Lightning keeps private
    (`_val_check_time_interval`) and checks between iterations of its loop."""
    return getattr(trainer, "_val_check_time_interval", None) is not None


def count_window(trainer: L.Trainer, micro_batches: int, optimizer_steps: int) -> None:
    """Count a window's micro-batches and optimizer steps in Lightning's loop, as if it had run them one an
    iteration: Lightning counts the window itself as one batch and, in manual optimization, only the steps of its
    own optimizer wrapper, which the module bypasses (it costs more than a step of a small model).

    Then `batch_idx`, `num_training_batches`, `val_check_interval`, `limit_train_batches`, the mid-epoch position
    of a checkpoint and `global_step` mean what they mean with a batch an iteration, and `_batches_that_stepped`
    (the step at which Lightning writes logged values, and its notion of a log step) counts optimizer steps.
    """
    loop = trainer.fit_loop.epoch_loop
    # Lightning counts the window's first batch (ready and started before the step, processed and completed after).
    ends_epoch = loop.batch_progress.current.ready + micro_batches - 1 >= trainer.num_training_batches
    loop.batch_progress.increment_by(micro_batches - 1, is_last_batch=ends_epoch)
    loop.manual_optimization.optim_step_progress.increment_by(optimizer_steps)
    # Lightning adds 1 itself after a window that ends at an optimizer step (`on_advance_end`).
    loop._batches_that_stepped += optimizer_steps - (0 if loop._should_accumulate() else 1)


def skip_sigterm_broadcast(trainer: L.Trainer) -> None:
    """Drop the broadcast of rank 0's `received_sigterm` that Lightning 2.6 runs under DDP before every iteration of
    its training loop (`_TrainingEpochLoop._broadcast_sigterm_tensor`): one collective a window, about 0.5 ms on
    gloo between two CPU processes, and no setting turns it off. Only Lightning's own SIGTERM handler sets that
    flag, and experiments.training.interruption replaces the handler when training starts (the ranks agree on every
    signal at a log step's window end instead), so the broadcast would always say "no signal"."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _no_broadcast


def _no_broadcast() -> None:
    pass


def save_checkpoint_without_barrier(trainer: L.Trainer, path: str, storage_options=None) -> None:
    """`trainer.save_checkpoint(path, weights_only=False)` less its closing barrier: every rank builds the
    checkpoint (its hooks agree on the weights: training.divergence), rank 0 writes it, and the others go on at
    once rather than wait for the write in one more collective (about 0.5 ms on gloo); they wait at their next
    all-reduce anyway. Nothing they do before it reads the file (a lost rank's line reads the step from the file
    on disk). Lightning's `save_checkpoint` has no option to leave the barrier out. `storage_options` go to the
    checkpoint's writer (experiments.run.files.AtomicCheckpointIO), as Lightning's own `save_checkpoint` passes
    them."""
    with trainer.profiler.profile("save_checkpoint"):
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        trainer.strategy.save_checkpoint(checkpoint, path, storage_options=storage_options)


def micro_batches_done(trainer: L.Trainer) -> tuple[int, int]:
    """Training micro-batches done (in this epoch, in the whole fit, a resume included), from the loop's own
    counters; from a window's `on_train_batch_end` on, they include the window's."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return progress.current.processed, progress.total.processed


def micro_batches_completed(trainer: L.Trainer) -> int:
    """Training micro-batches completed in the whole fit (a resume included): the loop's own counter, which counts
    a window's micro-batches once it has ended (count_window)."""
    return trainer.fit_loop.epoch_loop.batch_progress.total.completed


def instantiation_failure(err) -> tuple[str, str]:
    """(the config node, the target) that Hydra's InstantiationException names only in its text: "Error in call to
    target 'lightning.pytorch.trainer.trainer.Trainer':\n<cause>\nfull_key: trainer"; ("", "") where it does not."""
    text = err.args[0] if err.args else ""
    node = text.rsplit("full_key: ", 1)[-1].strip() if "full_key: " in text else ""
    return node, text.split("'")[1] if "'" in text else node


def tensorboard_prefixed(logger, metrics: dict) -> dict:
    """The metric names a Lightning logger writes: with its `prefix`, which Lightning keeps private."""
    return _add_prefix(dict(metrics), logger._prefix, logger.LOGGER_JOIN_CHAR)


def rebuild_train_loader(trainer: L.Trainer) -> None:
    """Drop a training loader built before a checkpoint's restore (counting the run's steps builds it): Lightning
    2.6 hands the saved mid-epoch position only to a loader it builds after the restore (`_FitLoop.setup_data`
    skips a built one)."""
    trainer.fit_loop._combined_loader = None


@contextmanager
def rank_command(builder: Callable) -> Iterator[None]:
    """While the block runs, Lightning's DDP launcher builds the command of ranks > 0 with `builder`.

    Lightning 2.6 has no public hook for that command: `_SubprocessScriptLauncher._call_children_scripts` calls
    the module-level `_hydra_subprocess_cmd` whenever Hydra is initialized. A launcher subclass would have to
    copy that method whole, and a DDPStrategy subclass would not reach `strategy=auto` with devices > 1, for
    which Lightning builds its own DDPStrategy (experiments.distributed.launcher).
    """
    original = subprocess_script._hydra_subprocess_cmd
    subprocess_script._hydra_subprocess_cmd = builder
    try:
        yield
    finally:
        subprocess_script._hydra_subprocess_cmd = original


def precisions() -> set:
    """Every `trainer.precision` value Lightning accepts: the literals of its private `_PRECISION_INPUT` type,
    the only list of them it keeps (its registry-free precision plugins are chosen by string)."""
    literals = typing.get_args(fabric_precision._PRECISION_INPUT)
    return {value for literal in literals for value in typing.get_args(literal)}


def parse_device_string(value: str) -> int | list[int]:
    """`trainer.devices` given as a string ("2", "-1", "0,1"), read as Lightning reads it, so that the config
    check and the Trainer agree; Lightning's parser of these strings is private."""
    return device_parser._normalize_parse_gpu_string_input(value)


def ddp_start_method(strategy: DDPStrategy) -> str:
    """How a DDPStrategy starts its ranks (popen, spawn, fork): one class serves ddp, ddp_spawn and ddp_fork, and
    only its private `_start_method` tells them apart."""
    return getattr(strategy, "_start_method", "popen")


def job_error(job_return: JobReturn) -> BaseException:
    """The exception a failed Hydra job raised: the public `return_value` re-raises it instead of returning it."""
    return job_return._return_value


def optuna_trial(study, frozen):
    """The `optuna.Trial` of a trial that is still RUNNING in `study` (a FrozenTrial from `study.get_trials`), to set
    its user attributes while its job runs again: a search stopped or killed left it running (the sweeper runs it
    again with the same parameters and tells its result). Why private: Optuna makes a Trial for the trials that
    `ask` starts; for one that another process started there is only its FrozenTrial, whose storage id is private."""
    import optuna  # a search's dependency: loaded by a search only

    return optuna.Trial(study, frozen._trial_id)


def summary_file_writer(writer):
    """The event file writer behind torch's `SummaryWriter`, to add a ready-made Summary proto (TensorBoard's hparams
    plugin summaries, and a log step's scalars as one event: training.dashboard) to the run's own event file:
    torch has no public call for that (its `add_hparams` writes into a new sub-run); Lightning's
    TensorBoardLogger.log_hyperparams does the same. Opened again if the writer was closed, as `add_scalar` does."""
    return writer._get_file_writer()


# Documented in "Extending PyTorch" (a dispatch mode sees every op, autograd's backward included), but it lives in
# the private torch.utils._python_dispatch: training.allocations counts CPU allocations with it.
TorchDispatchMode = _python_dispatch.TorchDispatchMode


def epochs_trained(checkpoint: dict) -> int:
    """The epochs a Lightning checkpoint's run has trained, as its fit loop counts them when it decides whether
    `max_epochs` is reached (`epoch_progress.current.processed`; the checkpoint's `epoch` lags by one when it was saved
    at an epoch's end). Why private: the layout of the loops' state inside a checkpoint."""
    return int(checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"])
