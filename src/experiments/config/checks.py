"""The one home of config rules: every check of the composed config, run before any data is made or any rank is
started. `experiments.config.rules.RULES` checks one setting at a time (and runs first, before the commands import
torch); the functions below check what several settings allow together (the accelerator and devices, the strategy
and the batch, the data's shapes).
"""

import torch
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry
from omegaconf import DictConfig, OmegaConf

from experiments.config.errors import ConfigError
from experiments.config.rules import RULES, check_rules  # noqa: F401 (RULES: the search's space check reads it here)
from experiments.config.sizes import check_model_memory, check_synthetic_memory
from experiments.config.topology import device_count, parse_devices, strategy_class, world_size
from experiments.distributed.dp import DataParallelStrategy
from experiments.distributed.single import SingleDevice


def check_config(cfg: DictConfig) -> None:
    """Raise ConfigError for the first setting that cannot work. Cheap: nothing is built or loaded."""
    check_rules(cfg)
    _check_accelerator(cfg.trainer.accelerator)
    _check_every_device(cfg.trainer)
    if cfg.get("scheduler") and cfg.trainer.max_epochs == -1 and cfg.trainer.max_steps == -1:
        raise ConfigError(
            "trainer.max_epochs=-1 with trainer.max_steps=-1: a scheduler needs the run's length; "
            "allowed: a max_epochs or a max_steps other than -1 (or scheduler=none)"
        )
    _check_strategy_name(cfg.trainer.get("strategy", "auto"))
    _check_synthetic_shapes(cfg)
    check_strategy(cfg)
    check_synthetic_memory(cfg)
    _check_model_on_the_host(cfg)


def _check_model_on_the_host(cfg: DictConfig) -> None:
    """A model too large for host memory, before the trainer is built, where the data's width is known from the
    config (synthetic data) and the run is on the CPU; elsewhere the recipe checks it once the data is read."""
    features = OmegaConf.select(cfg, "data.num_features")
    on_cpu = cfg.trainer.accelerator == "cpu" or (cfg.trainer.accelerator == "auto" and not torch.cuda.is_available())
    if features is not None and on_cpu and "model" in cfg:
        check_model_memory(cfg, features, torch.device("cpu"))


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
    effective = OmegaConf.select(cfg, "batch.effective")
    in_features = OmegaConf.select(cfg, "model.in_features")
    if effective is not None:  # it chooses data.batch_size and the accumulation (experiments.training.batch_fit)
        check_effective(effective, world_size(cfg.trainer) or 1, train)
        check_shapes(1, train, in_features, features)
    else:
        check_shapes(cfg.data.batch_size, train, in_features, features, cfg.trainer.accumulate_grad_batches)


def check_shapes(
    batch_size: int, train_samples: int, in_features: int | None, num_features: int, accumulate: int = 1
) -> None:
    """A global batch, and an optimizer step's `accumulate` of them, must fit in the training split, and the model
    must take the data's features (`in_features` None: it follows the data). From the config for synthetic data,
    from the data once read."""
    if batch_size > train_samples:
        raise ConfigError(
            f"data.batch_size={batch_size} is larger than the training split ({train_samples} samples); "
            f"allowed: 1 to {train_samples}"
        )
    if batch_size * accumulate > train_samples:
        raise ConfigError(
            f"data.batch_size={batch_size} x trainer.accumulate_grad_batches={accumulate} = {batch_size * accumulate} "
            f"samples an optimizer step is more than the training split ({train_samples} samples): an epoch would "
            f"hold no whole step; allowed: trainer.accumulate_grad_batches from 1 to {train_samples // batch_size}"
        )
    if in_features is not None and in_features != num_features:
        raise ConfigError(
            f"model.in_features={in_features} does not match the data's {num_features} features; "
            "allowed: null (follow the data) or the data's feature count"
        )


def check_splits(setting: str, batch: int, ranks: int, why: str = "") -> None:
    """A batch of `setting` must split evenly over the ranks (each takes batch / ranks)."""
    if batch % ranks:
        lower, upper = batch // ranks * ranks, (batch // ranks + 1) * ranks
        raise ConfigError(
            f"{setting}={batch} does not split over {ranks} ranks{why}; allowed: a multiple of {ranks}, e.g. "
            f"{' or '.join(str(b) for b in (lower, upper) if b)}"
        )


def check_effective(effective: int, ranks: int, train_samples: int | None = None) -> None:
    """batch.effective must split over the ranks and fit in the training split (when known: from the config for
    synthetic data, from the data once read, experiments.training.batch_fit)."""
    check_splits("batch.effective", effective, ranks)
    if train_samples is not None and effective > train_samples:
        raise ConfigError(
            f"batch.effective={effective} is larger than the training split ({train_samples} samples): no optimizer "
            f"step would fit in an epoch; allowed: {ranks} to {train_samples // ranks * ranks}"
        )


def _check_strategy_name(strategy) -> None:
    # A node with a `_target_` (conf/strategy/ddp.yaml, dp.yaml) is checked by Hydra when it is built, and
    # by check_strategy; a name must be one that Lightning's registry knows.
    if not isinstance(strategy, str) or strategy == "auto" or strategy in StrategyRegistry:
        return
    raise ConfigError(
        f"trainer.strategy={strategy} is not a strategy; allowed: auto, {', '.join(sorted(StrategyRegistry))} "
        "(or choose with strategy=auto|single|dp|ddp|ddp_spawn)"
    )


def check_strategy(cfg: DictConfig) -> None:
    """Settings that would fail only after data is built or ranks are started: refuse them now."""
    trainer = cfg.trainer
    devices = device_count(trainer)
    strategy = trainer.get("strategy", "auto")
    cls = strategy_class(strategy)
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
    single = strategy == "single_device" or (cls and issubclass(cls, SingleDevice))
    if single and (trainer.devices not in (1, "1") or trainer.num_nodes != 1):
        raise ConfigError(
            f"strategy=single: trainer.devices={trainer.devices}, trainer.num_nodes={trainer.num_nodes}; "
            "allowed: trainer.devices=1 on 1 node (the first device), or strategy=auto with trainer.devices=[i] "
            "for another GPU, or strategy=ddp for several"
        )
    ranks = world_size(trainer)
    batch = OmegaConf.select(cfg, "data.batch_size")  # None for eval.py's check of its trainer alone
    effective = OmegaConf.select(cfg, "batch.effective")
    if ranks and effective is not None:  # the fit chooses data.batch_size, a multiple of the ranks
        check_effective(effective, ranks)
    elif ranks and batch:
        check_splits("data.batch_size", batch, ranks, f" (trainer.devices={trainer.devices} x "
                     f"trainer.num_nodes={trainer.num_nodes})")  # fmt: skip
