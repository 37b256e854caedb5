"""How many devices and ranks a config starts, read as Lightning will read it: shared by the checks
(experiments.config.checks) and the sizes (experiments.config.sizes), which are neither's."""

import torch
from hydra.utils import get_class
from omegaconf import DictConfig

from experiments.config.rules import parse_devices  # light: the rules check trainer.devices before torch loads
from experiments.distributed.dp import DataParallelStrategy
from experiments.distributed.single import SingleDevice


def strategy_class(strategy) -> type | None:
    target = strategy.get("_target_") if isinstance(strategy, DictConfig) else None
    return get_class(target) if target else None


def device_count(trainer: DictConfig) -> int | None:
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
    strategy = trainer.get("strategy", "auto")  # eval.py's and predict.py's trainers have none
    cls = strategy_class(strategy)
    if strategy in ("single_device", "dp") or (cls and issubclass(cls, (SingleDevice, DataParallelStrategy))):
        return 1
    devices = device_count(trainer)
    return None if devices is None else devices * trainer.num_nodes




def local_processes(cfg) -> int:
    """Processes on this node that each hold the data: the devices of a DDP run, else 1 (one device, dp)."""
    ranks = world_size(cfg.trainer)
    return max(1, ranks // max(1, cfg.trainer.num_nodes)) if ranks else 1
