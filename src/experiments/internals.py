"""Every touch of Lightning's, Hydra's and torch's private API, in one place: the reason `lightning<2.7` is pinned.

Each function below says why the public API does not do, and `TOUCHES` lists, for each, how to tell that an
installed version still has it; tests/test_internals.py runs those checks, so an upgrade that removes one
fails there, naming it, rather than somewhere deep inside a run. Written against Lightning 2.6 and Hydra 1.3.
"""

import dataclasses
import inspect
import typing
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import lightning as L
import torch
from hydra.core.utils import JobReturn
from lightning.fabric.plugins.precision import precision as fabric_precision
from lightning.fabric.utilities import device_parser
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import subprocess_script
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
from torch.utils import _python_dispatch


def is_log_step(trainer: L.Trainer) -> bool:
    """Whether Lightning's logger writes on the optimizer step now running (`should_update_logs`): the one rule
    of "every log_every_n_steps steps", which Lightning does not expose (experiments.log_steps)."""
    return trainer._logger_connector.should_update_logs


def accumulating(trainer: L.Trainer) -> bool:
    """Whether the micro-step now running leaves its gradients for a later optimizer step: Lightning's own
    rule (`_should_accumulate`), which also knows that an epoch's last batch steps."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def write_step_metrics_now(trainer: L.Trainer) -> None:
    """Write the step's logged metrics now, inside `on_train_batch_end`: Lightning writes them only after that
    hook, and a run that stops in it (experiments.run.interruption) would lose the step from its curves."""
    trainer._logger_connector.on_batch_end()
    trainer._logger_connector.update_train_step_metrics()


# The attribute Lightning sets on the module before and after every hook call (about 45 a step); the module
# skips torch's Module.__setattr__ checks for it (experiments.module).
HOOK_NAME_ATTRIBUTE = "_current_fx_name"


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


def summary_file_writer(writer):
    """The event file writer behind torch's `SummaryWriter`, to add a ready-made Summary proto (TensorBoard's hparams
    plugin summaries, experiments.dashboard) to the run's own event file: torch has no public call for that (its
    `add_hparams` writes into a new sub-run); Lightning's TensorBoardLogger.log_hyperparams does the same."""
    return writer._get_file_writer()


def _summary_writer_has_file_writer() -> bool:
    from torch.utils.tensorboard import SummaryWriter  # here, not at the top: only runs that log import it

    return callable(getattr(SummaryWriter, "_get_file_writer", None))


class CpuAllocations(_python_dispatch.TorchDispatchMode):
    """While active (`with counter:`), the bytes of the CPU tensors that torch allocates in this thread: `live`
    now, `peak` the most at once (experiments.batch_fit measures a training step on the CPU with it).

    Why: torch keeps no statistics of its CPU allocator (CUDA has `max_memory_allocated`), and the process's
    resident set (VmHWM) does not see memory that glibc hands out again from its own heap: a second probe of the
    same size grows it by 0 bytes. A dispatch mode sees every op, autograd's backward included, and each new
    storage is counted once until it is freed (a weakref's finalizer). `TorchDispatchMode` is documented in
    "Extending PyTorch" but lives in the private `torch.utils._python_dispatch`.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._counted: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in _tensors(out):
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if tensor.device.type == "cpu" and key and key not in self._counted:
                self._counted.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self._counted.discard(key)
        self.live -= nbytes


def _tensors(out) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, list | tuple):
        for item in out:
            yield from _tensors(item)


def _counts_cpu_allocations() -> bool:
    with CpuAllocations() as counter:
        kept = torch.ones(256)  # 1 KiB, kept
        torch.ones(1024).sum()  # 4 KiB, freed at once
    return (counter.peak, counter.live) == (4096 + 1024 + 4, 1024) and kept.numel() == 256


def _has_rank_command() -> bool:
    source = inspect.getsource(subprocess_script._SubprocessScriptLauncher._call_children_scripts)
    return hasattr(subprocess_script, "_hydra_subprocess_cmd") and "_hydra_subprocess_cmd(" in source


def _module_sets_hook_name() -> bool:
    return HOOK_NAME_ATTRIBUTE in vars(L.LightningModule())


def _fit_loop_keeps_loader() -> bool:
    return "self._combined_loader" in inspect.getsource(_FitLoop.__init__)


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
    ("torch.utils._python_dispatch.TorchDispatchMode", _counts_cpu_allocations),
]
