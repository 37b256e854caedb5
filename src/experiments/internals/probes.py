"""For each private touch of experiments.internals, how to tell that the installed versions still have it:
`TOUCHES`, (the touch, a check), which tests/test_internals.py runs, so that an upgrade that removes one fails
there, naming it, rather than somewhere deep inside a run."""

import dataclasses
import inspect
from collections.abc import Callable

import lightning as L
import torch
from hydra.core.utils import JobReturn
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.optimization.manual import _ManualOptimization
from lightning.pytorch.loops.progress import _BatchProgress
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import subprocess_script
from lightning.pytorch.trainer import configuration_validator
from lightning.pytorch.trainer import setup as trainer_setup
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
from lightning_utilities.core.imports import RequirementCache

from experiments.internals import (
    HOOK_NAME_ATTRIBUTE,
    TorchDispatchMode,
    ddp_start_method,
    instantiation_failure,
    optuna_trial,
    parse_device_string,
    precisions,
)


def _optuna_trial_of_frozen() -> bool:
    import optuna

    study = optuna.create_study()
    trial = study.ask()
    frozen = study.get_trials(deepcopy=False)[0]
    optuna_trial(study, frozen).set_user_attr("probe", 1)
    return study.get_trials(deepcopy=False)[0].user_attrs == {"probe": 1} and trial.number == frozen.number


def _names_node_and_target() -> bool:
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        instantiate({"trainer": {"_target_": "datetime.timedelta", "nope": 1}})
    except InstantiationException as err:
        return instantiation_failure(err) == ("trainer", "datetime.timedelta")
    return False


def _summary_writer_has_file_writer() -> bool:
    from torch.utils.tensorboard import SummaryWriter  # here, not at the top: only runs that log import it

    return callable(getattr(SummaryWriter, "_get_file_writer", None))




def _dispatch_mode_sees_every_op() -> bool:
    """A mode's __torch_dispatch__ gets each op with its outputs (training.allocations counts their storages)."""
    seen = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.append((str(func), out))
            return out

    with Seen():
        torch.ones(256).sum()
    ops = [op for op, out in seen if isinstance(out, torch.Tensor)]
    return "aten.ones.default" in ops and "aten.sum.default" in ops


def _has_rank_command() -> bool:
    source = inspect.getsource(subprocess_script._SubprocessScriptLauncher._call_children_scripts)
    return hasattr(subprocess_script, "_hydra_subprocess_cmd") and "_hydra_subprocess_cmd(" in source


def _module_sets_hook_name() -> bool:
    return HOOK_NAME_ATTRIBUTE in vars(L.LightningModule())


def _fit_loop_keeps_loader() -> bool:
    return "self._combined_loader" in inspect.getsource(_FitLoop.__init__)


def _checks_manual_optimization_before_setup() -> bool:
    """The Trainer checks its settings against manual optimization before the `setup` hooks (optimize_manually)."""
    run = inspect.getsource(L.Trainer._run)
    checked, setup = run.find("_verify_loop_configurations(self)"), run.find("call._call_setup_hook(self)")
    source = inspect.getsource(configuration_validator._verify_loop_configurations)
    return 0 <= checked < setup and "__verify_manual_optimization_support" in source


def _loop_counts_windows() -> bool:
    """The counters that count_window and window_position read and advance."""
    loop = inspect.getsource(_TrainingEpochLoop.__init__) + inspect.getsource(_ManualOptimization.__init__)
    return (
        all(f"self.{name}" in loop for name in ("batch_progress", "_batches_that_stepped", "optim_step_progress"))
        and callable(getattr(_BatchProgress, "increment_by", None))
        and isinstance(_TrainingEpochLoop.batch_idx, property)
        and isinstance(_TrainingEpochLoop.total_batch_idx, property)
        and "trainer._val_check_time_interval" in inspect.getsource(trainer_setup)
    )


def _has_sigterm_broadcast() -> bool:
    advance = inspect.getsource(_TrainingEpochLoop.advance)
    return "self._broadcast_sigterm_tensor()" in advance and callable(
        getattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", None)
    )


def _save_is_dump_write_barrier() -> bool:
    """Trainer.save_checkpoint is still: dump, the strategy's write, a barrier (save_checkpoint_without_barrier)."""
    source = inspect.getsource(L.Trainer.save_checkpoint)
    dump = source.find("self._checkpoint_connector.dump_checkpoint(")
    write = source.find("self.strategy.save_checkpoint(")
    return 0 <= dump < write < source.find("self.strategy.barrier(")


def _torchmetrics_plots_need_matplotlib_cache() -> bool:
    """torchmetrics decides on its plots, and on importing matplotlib, from one RequirementCache that asks once
    (import_torchmetrics_without_matplotlib)."""
    from torchmetrics.utilities import imports, plot

    cache = imports._MATPLOTLIB_AVAILABLE
    return (
        isinstance(cache, RequirementCache)
        and cache.requirement == "matplotlib"
        and plot._MATPLOTLIB_AVAILABLE is cache
        and "if _MATPLOTLIB_AVAILABLE:" in inspect.getsource(plot)
        and "self._check_requirement()" in inspect.getsource(RequirementCache._check_available)
    )


def _fit_loop_stops_on_processed_epochs() -> bool:
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    return (
        "epoch_progress.current.processed, self.max_epochs" in inspect.getsource(_FitLoop.done.fget)
        and '"fit_loop": ' in inspect.getsource(_CheckpointConnector._get_loops_state_dict)
        and "self.epoch_progress = _Progress()" in inspect.getsource(_FitLoop.__init__)  # a loop's state_dict has it
    )


def _job_return_keeps_error() -> bool:
    return "_return_value" in {f.name for f in dataclasses.fields(JobReturn)}


# (the touch, a check that the installed versions still have it): tests/test_internals.py runs each.
TOUCHES: list[tuple[str, Callable[[], bool]]] = [
    (
        "_LoggerConnector.should_update_logs",
        lambda: isinstance(getattr(_LoggerConnector, "should_update_logs", None), property),
    ),
    (
        "_TrainingEpochLoop._should_accumulate",
        lambda: callable(getattr(_TrainingEpochLoop, "_should_accumulate", None)),
    ),
    ("_LoggerConnector.on_batch_end", lambda: callable(getattr(_LoggerConnector, "on_batch_end", None))),
    (
        "_LoggerConnector.update_train_step_metrics",
        lambda: callable(getattr(_LoggerConnector, "update_train_step_metrics", None)),
    ),
    (f"LightningModule.{HOOK_NAME_ATTRIBUTE}", _module_sets_hook_name),
    ("_FitLoop._combined_loader", _fit_loop_keeps_loader),
    ("subprocess_script._hydra_subprocess_cmd", _has_rank_command),
    ("fabric precision._PRECISION_INPUT", lambda: len(precisions()) > 0 and "bf16-mixed" in precisions()),
    ("device_parser._normalize_parse_gpu_string_input", lambda: parse_device_string("0,1") == [0, 1]),
    ("DDPStrategy._start_method", lambda: ddp_start_method(DDPStrategy(start_method="spawn")) == "spawn"),
    ("hydra JobReturn._return_value", _job_return_keeps_error),
    ("torch SummaryWriter._get_file_writer", _summary_writer_has_file_writer),
    ("torch.utils._python_dispatch.TorchDispatchMode", _dispatch_mode_sees_every_op),
    ("manual optimization checked before setup", _checks_manual_optimization_before_setup),
    ("_TrainingEpochLoop's batch_progress (processed, completed), _batches_that_stepped, optim_step_progress",
     _loop_counts_windows),
    ("ModelCheckpoint._every_n_train_steps", lambda: ModelCheckpoint(every_n_train_steps=3)._every_n_train_steps == 3),
    ("TensorBoardLogger._prefix", lambda: TensorBoardLogger(".", prefix="p")._prefix == "p"),
    ("_TrainingEpochLoop._broadcast_sigterm_tensor", _has_sigterm_broadcast),
    ("Trainer._checkpoint_connector.dump_checkpoint in save_checkpoint", _save_is_dump_write_barrier),
    ("torchmetrics _MATPLOTLIB_AVAILABLE", _torchmetrics_plots_need_matplotlib_cache),
    ("hydra InstantiationException's text: target and full_key", _names_node_and_target),
    ("optuna FrozenTrial._trial_id", _optuna_trial_of_frozen),
    ("checkpoint loops.fit_loop.epoch_progress.current.processed", _fit_loop_stops_on_processed_epochs),
]
