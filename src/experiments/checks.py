"""Checks of the composed config, run before any data is made or any rank is started."""

import math
import typing
from pathlib import Path

from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT
from lightning.fabric.utilities.device_parser import _normalize_parse_gpu_string_input
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry
from omegaconf import DictConfig, ListConfig, OmegaConf


class ConfigError(ValueError):
    """A setting the user can fix. The message names the setting, the bad value and what is allowed."""


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _real(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def parse_devices(value) -> str | int | list:
    """`trainer.devices` as Lightning reads it: "auto", an int (-1: every device) or a list of device indices.

    Strings such as "2", "-1" and "0,1" go through Lightning's own parser; anything else raises ValueError.
    """
    if isinstance(value, ListConfig):
        return list(value)
    if isinstance(value, str) and value != "auto":
        return _normalize_parse_gpu_string_input(value)
    return value


def _devices(v) -> bool:
    try:
        v = parse_devices(v)
    except ValueError:
        return False
    if isinstance(v, list):
        return len(v) > 0 and all(_integer(i) and i >= 0 for i in v)
    return v == "auto" or (_integer(v) and (v >= 1 or v == -1))


def _batches(v) -> bool:
    # Lightning's limit_*_batches and val_check_interval: a float is a fraction, an int a count.
    return v is None or (_integer(v) and v >= 0) or (isinstance(v, float) and 0 <= v <= 1)


# Lightning's accepted `precision` values (ints such as 32 and strings such as "bf16-mixed").
PRECISIONS = {value for literal in typing.get_args(_PRECISION_INPUT) for value in typing.get_args(literal)}

# (setting, test, what is allowed). A setting that the chosen config does not have is skipped (data=file
# has no num_samples).
RULES = [
    ("seed", lambda v: _integer(v) and 0 <= v < 2**32, "an integer from 0 to 2**32 - 1"),
    ("data.batch_size", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("data.num_samples", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("data.num_features", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("data.val_fraction", lambda v: _real(v) and 0 <= v < 1, "a number from 0 up to, not including, 1"),
    ("data.noise_std", lambda v: _real(v) and v >= 0, "a finite number >= 0"),
    ("model.out_features", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("trainer.accumulate_grad_batches", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("trainer.devices", _devices, "an integer >= 1, -1 (every device), auto, or a list of device indices"),
    ("trainer.num_nodes", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("trainer.max_epochs", lambda v: v is None or (_integer(v) and v >= -1), "an integer >= 0, or -1 for no limit"),
    ("trainer.max_steps", lambda v: _integer(v) and (v >= 1 or v == -1), "an integer >= 1, or -1 for no limit"),
    ("trainer.limit_train_batches", _batches, "null, a fraction from 0.0 to 1.0, or a number of batches >= 0"),
    ("trainer.limit_val_batches", _batches, "null, a fraction from 0.0 to 1.0, or a number of batches >= 0"),
    ("trainer.val_check_interval", _batches, "null, a fraction of the epoch from 0.0 to 1.0, or a number of batches"),
    ("data.on_device", lambda v: v in ("auto", True, False), "auto, true, false"),
    ("trainer.log_every_n_steps", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("trainer.precision", lambda v: v in PRECISIONS, ", ".join(sorted(map(str, PRECISIONS)))),
    ("optimizer.lr", lambda v: _real(v) and v > 0, "a finite number > 0"),
    ("optimizer.momentum", lambda v: _real(v) and 0 <= v < 1, "a number from 0 up to, not including, 1"),
    ("optimizer.weight_decay", lambda v: _real(v) and v >= 0, "a finite number >= 0"),
]

_ABSENT = object()


def check_config(cfg: DictConfig) -> None:
    """Raise ConfigError for the first setting that cannot work. Cheap: nothing is built or loaded."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"{missing[0]} is required and has no value; set it on the command line: {missing[0]}=...")
    for key, test, allowed in RULES:
        value = OmegaConf.select(cfg, key, default=_ABSENT)
        if value is not _ABSENT and not test(value):
            raise ConfigError(f"{key}={value} is not allowed; allowed: {allowed}")
    _check_accelerator(cfg.trainer.accelerator)
    _check_every_device(cfg.trainer)
    if cfg.get("scheduler") and cfg.trainer.max_epochs == -1 and cfg.trainer.max_steps == -1:
        raise ConfigError(
            "trainer.max_epochs=-1 with trainer.max_steps=-1: a scheduler needs the run's length; "
            "allowed: a max_epochs or a max_steps other than -1 (or scheduler=none)"
        )
    _check_strategy(cfg.trainer.get("strategy", "auto"))
    _check_synthetic_shapes(cfg)


def _check_accelerator(name) -> None:
    names = sorted(AcceleratorRegistry)
    if name == "auto":
        return
    if name not in (*names, "gpu"):
        raise ConfigError(f"trainer.accelerator={name} is not an accelerator; allowed: auto, gpu, {', '.join(names)}")
    candidates = ["cuda", "mps"] if name == "gpu" else [name]
    available = [n for n in names if AcceleratorRegistry[n]["accelerator"].is_available()]
    if not any(n in available for n in candidates):
        raise ConfigError(
            f"trainer.accelerator={name}: there is no {name} device on this machine; "
            f"allowed here: auto, {', '.join(available)}"
        )


def _check_every_device(trainer: DictConfig) -> None:
    # Lightning reads devices=-1 as "every GPU"; on the CPU accelerator it refuses it.
    if parse_devices(trainer.devices) != -1 or trainer.accelerator not in ("auto", "cpu"):
        return
    if trainer.accelerator == "cpu" or not any(
        AcceleratorRegistry[n]["accelerator"].is_available() for n in ("cuda", "mps") if n in AcceleratorRegistry
    ):
        raise ConfigError(
            f"trainer.devices=-1 (every GPU) with trainer.accelerator={trainer.accelerator}: this run is on the CPU; "
            "allowed here: an integer >= 1 (processes), or auto"
        )


def _check_synthetic_shapes(cfg: DictConfig) -> None:
    """What the synthetic data's shapes forbid, known from the config alone (data=file: once it is read)."""
    samples, features = OmegaConf.select(cfg, "data.num_samples"), OmegaConf.select(cfg, "data.num_features")
    if samples is None or features is None:
        return
    train = samples - round(samples * cfg.data.val_fraction)  # as RegressionData.setup splits
    check_shapes(cfg.data.batch_size, train, OmegaConf.select(cfg, "model.in_features"), features)


def check_shapes(batch_size: int, train_samples: int, in_features: int | None, num_features: int) -> None:
    """A global batch must fit in the training split, and the model must take the data's features
    (`in_features` None: it follows the data). From the config for synthetic data, from the data once read."""
    if batch_size > train_samples:
        raise ConfigError(
            f"data.batch_size={batch_size} is larger than the training split ({train_samples} samples); "
            f"allowed: 1 to {train_samples}"
        )
    if in_features is not None and in_features != num_features:
        raise ConfigError(
            f"model.in_features={in_features} does not match the data's {num_features} features; "
            "allowed: null (follow the data) or the data's feature count"
        )


def _check_strategy(strategy) -> None:
    # A node with a `_target_` (conf/strategy/ddp.yaml, dp.yaml) is checked by Hydra when it is built, and
    # by strategies.check_strategy; a name must be one that Lightning's registry knows.
    if not isinstance(strategy, str) or strategy == "auto" or strategy in StrategyRegistry:
        return
    raise ConfigError(
        f"trainer.strategy={strategy} is not a strategy; allowed: auto, {', '.join(sorted(StrategyRegistry))} "
        "(or choose with strategy=auto|single|dp|ddp|ddp_spawn)"
    )


def resolve_checkpoint(ckpt_path: str | None, run_dir: Path) -> str | None:
    """`last` is the newest `checkpoints/last.ckpt` among the other runs beside this one (outputs/runs/)."""
    if ckpt_path != "last":
        return ckpt_path
    found = [p for p in run_dir.parent.glob("*/checkpoints/last.ckpt") if p.parent.parent != run_dir]
    if not found:
        raise ConfigError(
            f"ckpt_path=last: no run in {run_dir.parent} has a checkpoints/last.ckpt yet; "
            "allowed: a checkpoint file, or last once a run has saved one"
        )
    return str(max(found, key=lambda p: p.stat().st_mtime))
