"""How the devices share the work: a DataParallel strategy for Lightning 2, the checks that run before any
rank starts, and the glue that lets Lightning's DDP ranks join a Hydra job instead of starting their own.
"""

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class
from lightning.pytorch.strategies import ParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.strategies.launchers import subprocess_script
from omegaconf import DictConfig
from torch.nn import DataParallel

from experiments.checks import ConfigError, parse_devices

# The repository's `train.py`: what ranks > 0 run, whatever process started the job (a joblib worker's own
# `sys.argv` and `__main__` belong to joblib, not to this program).
ENTRY = Path(__file__).resolve().parents[2] / "train.py"


class _ReplicaStep(torch.nn.Module):
    """What each DataParallel replica runs: the module's `training_step` on its share of the batch.

    Replicas run in threads and are thrown away after the step, so `self.log` inside them is captured and
    returned, and the strategy logs each value once: the mean over replicas, weighted by their shares.
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        # Keyword arguments of each captured `log` call; one dict shared by all replicas, since `replicate`
        # copies a module's attributes shallowly.
        self.log_options: dict[str, dict] = {}

    def forward(self, batch, *args, **kwargs):
        module = self.module
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
        module._device = first.device  # a replica's `self.device` is its GPU, not the root device
        logged = {}

        def capture(name: str, value, **options) -> None:
            logged[name] = torch.as_tensor(value, device=first.device).float().reshape(1)
            self.log_options[name] = options

        module.log = capture
        try:
            output = module.training_step(batch, *args, **kwargs)
        finally:
            del module.log
        # Scalars become length-1 vectors so that `gather` stacks them, one entry per replica.
        if isinstance(output, dict):
            output = {**output, "loss": output["loss"].reshape(1)}
        else:
            output = output.reshape(1)
        return output, torch.tensor([len(first)], device=first.device), logged


class DataParallelStrategy(ParallelStrategy):
    """`torch.nn.DataParallel` in one process: each training batch is scattered over `trainer.devices` GPUs,
    the replicas' losses are gathered on the first and averaged, and metrics are logged once.

    Lightning 2.0 removed its own (`strategy="dp"`); this follows the design of Lightning 1.9's
    `DataParallelStrategy`. Validation, test and predict steps run on the first GPU alone: torchmetrics
    states must update in the module itself, not in replicas that are discarded after each step.
    """

    strategy_name = "dp"

    # One process: there are no ranks to tell apart.
    global_rank = property(lambda self: 0)
    local_rank = property(lambda self: 0)
    node_rank = property(lambda self: 0)
    world_size = property(lambda self: 1)

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[0]

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    def _setup_model(self, model: torch.nn.Module) -> DataParallel:
        return DataParallel(_ReplicaStep(model), device_ids=[d.index for d in self.parallel_devices])

    def training_step(self, *args, **kwargs):
        with self.precision_plugin.train_step_context():
            output, sizes, logged = self.model(*args, **kwargs)
        # Each replica's loss is the mean over its share; weighting by the shares gives the mean over the
        # whole batch even when the batch does not split evenly.
        weights = sizes.to(self.root_device, torch.float32) / sizes.sum()

        def mean(per_replica: torch.Tensor) -> torch.Tensor:
            return (per_replica * weights.to(per_replica.dtype)).sum()

        for name, values in logged.items():
            self.lightning_module.log(name, mean(values), **self.model.module.log_options[name])
        if isinstance(output, dict):
            return {**output, "loss": mean(output["loss"])}
        return mean(output)

    def validation_step(self, *args, **kwargs):
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    def test_step(self, *args, **kwargs):
        with self.precision_plugin.test_step_context():
            return self.lightning_module.test_step(*args, **kwargs)

    def predict_step(self, *args, **kwargs):
        with self.precision_plugin.predict_step_context():
            return self.lightning_module.predict_step(*args, **kwargs)

    # Collectives of a single process: the values are already complete.
    def reduce(self, tensor, group=None, reduce_op="mean"):
        return tensor

    def all_gather(self, tensor, group=None, sync_grads=False):
        return tensor

    def broadcast(self, obj, src=0):
        return obj

    def barrier(self, name=None) -> None:
        pass

    def teardown(self) -> None:
        if isinstance(self.model, DataParallel):
            self.model = self.lightning_module
        super().teardown()


class SingleDevice(SingleDeviceStrategy):
    """Exactly one device: the first of the accelerator the Trainer picks (CPU, CUDA or MPS).

    Lightning's registered `strategy="single_device"` is built with its default `device="cpu"`, which fails
    on a GPU; `strategy="auto"` finds the right device but turns into DDP when `devices` > 1.
    """

    def __init__(self):
        super().__init__(device="cpu")  # replaced as soon as the Trainer sets the accelerator

    @property
    def accelerator(self):
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator) -> None:
        self._accelerator = accelerator
        if accelerator is not None:
            self._root_device = accelerator.get_parallel_devices(accelerator.parse_devices(1))[0]


def _strategy_class(strategy) -> type | None:
    target = strategy.get("_target_") if isinstance(strategy, DictConfig) else None
    return get_class(target) if target else None


def _device_count(trainer: DictConfig) -> int | None:
    """Devices per node as Lightning will read `trainer.devices`; None when it cannot be told here."""
    try:
        devices = parse_devices(trainer.devices)
    except ValueError:
        return None
    if isinstance(devices, list):  # device ids
        return len(devices)
    if devices in ("auto", -1):
        gpu = trainer.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
        return torch.cuda.device_count() if gpu else 1
    return devices if isinstance(devices, int) and devices > 0 else None


def world_size(trainer: DictConfig) -> int | None:
    """The number of ranks the trainer config will start: devices x nodes, or 1 for single and dp."""
    strategy = trainer.strategy
    cls = _strategy_class(strategy)
    if strategy in ("single_device", "dp") or (cls and issubclass(cls, (SingleDevice, DataParallelStrategy))):
        return 1
    devices = _device_count(trainer)
    return None if devices is None else devices * trainer.num_nodes


def check_strategy(cfg: DictConfig) -> None:
    """Settings that would fail only after data is built or ranks are started: refuse them now."""
    trainer = cfg.trainer
    devices = _device_count(trainer)
    cls = _strategy_class(trainer.strategy)
    if cls and issubclass(cls, DataParallelStrategy):
        if trainer.accelerator not in ("auto", "gpu", "cuda") or not torch.cuda.is_available():
            raise ConfigError(
                f"strategy=dp needs CUDA GPUs (trainer.accelerator={trainer.accelerator}, "
                f"CUDA available: {torch.cuda.is_available()}); use strategy=ddp for several CPU processes"
            )
        if devices is None or devices > torch.cuda.device_count() or trainer.num_nodes != 1:
            raise ConfigError(
                f"strategy=dp: trainer.devices={trainer.devices} x trainer.num_nodes={trainer.num_nodes}, but "
                f"this machine has {torch.cuda.device_count()} CUDA GPU(s); allowed: 1 to "
                f"{torch.cuda.device_count()} devices on one node, or strategy=ddp"
            )
    single = trainer.strategy == "single_device" or (cls and issubclass(cls, SingleDevice))
    if single and (trainer.devices not in (1, "1") or trainer.num_nodes != 1):
        raise ConfigError(
            f"strategy=single: trainer.devices={trainer.devices}, trainer.num_nodes={trainer.num_nodes}; "
            "allowed: trainer.devices=1 on 1 node (the first device), or strategy=auto with trainer.devices=[i] "
            "for another GPU, or strategy=ddp for several"
        )
    ranks = world_size(trainer)
    batch = cfg.data.batch_size
    if ranks and batch % ranks:
        lower, upper = batch // ranks * ranks, (batch // ranks + 1) * ranks
        raise ConfigError(
            f"data.batch_size={batch} does not split over {ranks} ranks (trainer.devices={trainer.devices} x "
            f"trainer.num_nodes={trainer.num_nodes}); allowed: a multiple of {ranks}, e.g. "
            f"{' or '.join(str(b) for b in (lower, upper) if b)}"
        )


class Rank(NamedTuple):
    zero: bool  # global rank 0: the process that writes the run's files
    started_by_launcher: bool  # a launcher started it as a rank and waits for it: it should end with it


def this_rank() -> Rank:
    """Which rank this process is, as the launcher that started it announced it in the environment; the one
    reading of rank for the whole project, before any process group exists (Lightning's own, `trainer.
    global_rank`, is known only once the Trainer is built).

    - torchrun sets RANK (the global rank) and LOCAL_RANK for every rank, 0 included; it is their parent.
    - Lightning's DDP launcher re-runs train.py for ranks > 0 with LOCAL_RANK and NODE_RANK set; rank 0 is
      the user's own process. Inside a one-task SLURM job its children inherit SLURM_PROCID=0.
    - srun sets SLURM_PROCID (the global rank) for each task; slurmstepd, not a rank, is their parent.
    - By hand on several nodes (Lightning's launcher on each), NODE_RANK > 0 says the node is not the first.
    A process that none of them started (the user's `python train.py`) is rank 0.
    """
    env = os.environ
    if "RANK" in env:
        zero = int(env["RANK"]) == 0
    else:
        zero = all(int(env.get(key, 0)) == 0 for key in ("SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))
    return Rank(zero=zero, started_by_launcher="LOCAL_RANK" in env)


def silent_rank_overrides(args: list[str]) -> list[str]:
    """Hydra overrides that keep a rank > 0 from writing: no `.hydra/`, no log file, no run dir of its own.

    Under torchrun or SLURM every rank runs Hydra, and each would make its own timestamped run dir. Rank 0's
    dir is the run's: ranks > 0 write nothing there (Lightning loggers and checkpoints write on rank 0, and
    `ModelCheckpoint` broadcasts rank 0's dir), so they stay in the working directory unless told a dir.
    """
    if this_rank().zero:
        return []
    overrides = ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
    if not any(a.startswith("hydra.run.dir=") for a in args):
        overrides.append("hydra.run.dir=.")
    return overrides


def _rank_command(local_rank: int) -> tuple[list[str], str]:
    """The command Lightning's launcher runs for rank `local_rank` of the current Hydra job.

    Lightning's own version re-runs `sys.argv`: inside a multirun that is `-m` and the whole sweep, so each
    rank starts a sweep of its own and the job hangs (Lightning #11300, Hydra #2070). Here the rank runs
    this job alone: its config name, its own overrides, its output dir, as a single run.
    """
    hydra = HydraConfig.get()
    output_dir = hydra.runtime.output_dir.replace("\\", "\\\\").replace('"', '\\"')
    command = [sys.executable, str(ENTRY)]
    if hydra.job.config_name:
        command.append(f"--config-name={hydra.job.config_name}")
    command += [*hydra.overrides.task, f'hydra.run.dir="{output_dir}"']
    return command, hydra.runtime.cwd


@contextmanager
def ranks_join_this_job() -> Iterator[None]:
    """While a job runs, Lightning's DDP launcher starts its ranks into this job; afterwards the process is as
    it was, so that the next job of a sweep (in this process or the same joblib worker) starts its own ranks.

    The launcher leaves MASTER_ADDR, MASTER_PORT, NODE_RANK, LOCAL_RANK and WORLD_SIZE in `os.environ`, and a
    set LOCAL_RANK tells Lightning that the ranks were started externally; the process group also outlives
    `trainer.fit`.

    Lightning 2.6 has no public hook for the command its launcher runs: `_SubprocessScriptLauncher.
    _call_children_scripts` calls the module-level `_hydra_subprocess_cmd` whenever Hydra is initialized, so
    a launcher subclass would have to copy that method whole (the ranks' environment, PL_GLOBAL_SEED, the
    Popen), and a DDPStrategy subclass installing it through `_configure_launcher` would not reach
    `strategy=auto` with `trainer.devices` > 1, for which Lightning builds its own DDPStrategy. Replacing
    the builder for the duration of one job, and putting Lightning's back after it, reaches every DDP run.
    """
    environment = dict(os.environ)
    original = subprocess_script._hydra_subprocess_cmd
    subprocess_script._hydra_subprocess_cmd = _rank_command
    try:
        yield
    finally:
        subprocess_script._hydra_subprocess_cmd = original
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for key in set(os.environ) - set(environment):
            del os.environ[key]
        os.environ.update(environment)
