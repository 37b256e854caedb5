"""`batch.effective=E` (conf/batch/, docs/batch_fit.md): the largest micro-batch whose training step fits the memory
budget, and the accumulation that makes micro-batch x accumulation x ranks = E exactly.

Measured, not guessed, and never by running out of memory (on the CPU that kills the process rather than raising):
probe steps of the run's own model (experiments.training.probe) give the bytes one more sample adds to a step and the
step's fixed part (model, gradients, optimizer state); the data counts too when it will be kept on the GPU. The
largest micro-batch that divides E / ranks and fits is then run for real before training; if it does not fit after
all, the next smaller one is tried. Rank 0 measures on its device; the other ranks take its choice when the Trainer
sets up (`ShareFit`).
"""

import copy
import math
from dataclasses import dataclass, fields

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig, OmegaConf

from experiments.config.checks import check_effective
from experiments.config.errors import ConfigError
from experiments.config.sizes import host_available
from experiments.data.datamodule import RegressionData, keep_on_device
from experiments.run.exits import RunFailed
from experiments.training.probe import MiB, Probe


@dataclass(frozen=True)
class Fit:
    """What `batch.effective` chose, and the measurements it chose from."""

    effective: int  # E: samples per optimizer step over all ranks
    ranks: int
    micro_batch: int  # samples per rank per micro-step
    accumulate: int  # micro-steps per optimizer step
    memory_mb: float | None  # the batch.memory_mb it was asked for (None: the measured default)
    budget_mb: float  # one rank's budget
    budget_from: str  # how the budget was set, in words
    bytes_per_sample: float  # what one more sample adds to a step
    fixed_mb: float  # the step's part that does not grow with the batch (and the data kept on the GPU)
    step_mb: float  # the chosen micro-batch's step, run before training

    @property
    def global_batch(self) -> int:  # data.batch_size: the global batch of one micro-step
        return self.micro_batch * self.ranks

    @property
    def record(self) -> dict:  # metrics.json's batch_fit
        return {"budget_mb": self.budget_mb, "bytes_per_sample": self.bytes_per_sample, "micro_batch": self.micro_batch}


def fit_batch(cfg: DictConfig, trainer: L.Trainer, data: RegressionData, resumed, rank_zero: bool) -> Fit | None:
    """The run's fit (None when `batch.effective` is null): measured on rank 0 before training; a resumed run
    keeps its checkpoint's (its saved data position counts micro-batches); ranks > 0 take rank 0's (`ShareFit`)."""
    spec = cfg.get("batch")
    if not spec or spec.effective is None:
        return None
    effective, ranks = spec.effective, trainer.world_size
    check_effective(effective, ranks, len(data.x_train))
    stored = getattr(resumed, "batch_fit", None) or {}  # the checkpoint's (run.last_checkpoint.LastCheckpoint)
    same = [stored.get(k) for k in ("effective", "ranks", "memory_mb")] == [effective, ranks, spec.memory_mb]
    if same and all(f.name in stored for f in fields(Fit)):
        return Fit(**{f.name: stored[f.name] for f in fields(Fit)})
    if not rank_zero:  # a placeholder that trains nothing: ShareFit replaces it before the loaders are built
        return Fit(effective, ranks, 1, effective // ranks, spec.memory_mb, 0.0, "rank 0's", 0.0, 0.0, 0.0)
    return measure(cfg, trainer, data, effective, spec)


def rounded_up(x: float, digits: int = 4) -> float:
    """x rounded up to `digits` significant digits: a bound that `:.4g` prints without falling below x."""
    unit = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    return math.ceil(x / unit) * unit


def divisors(n: int) -> list[int]:
    """Every divisor of n, largest first."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


def largest_micro_batch(per_rank: int, limit: int) -> int | None:
    """The largest divisor of `per_rank` (E / ranks) that is at most `limit`; None when limit < 1."""
    return next((d for d in divisors(per_rank) if d <= limit), None)


def measure(cfg: DictConfig, trainer: L.Trainer, data: RegressionData, effective: int, spec: DictConfig) -> Fit:
    device, ranks = trainer.strategy.root_device, trainer.world_size
    per_rank = effective // ranks
    probe = Probe(cfg, trainer, data, device)
    probe.step_bytes(1)  # warm-up: CUDA's context, cuBLAS's workspace and autograd's first allocations
    resident = resident_data_bytes(data, device)
    budget, budget_from = budget_bytes(spec, device, trainer.num_devices, host_data_bytes(data))
    if (measured := probe.slope(per_rank, budget)) is None:
        raise ConfigError(
            f"batch.effective={effective}: its probe steps ran out of CUDA memory on {device} "
            f"({torch.cuda.mem_get_info(device)[0] / MiB:.0f} MiB free); allowed: a GPU with memory free"
        )
    per_sample, fixed = measured
    fixed += resident
    limit = math.floor((budget - fixed) / per_sample)
    while (micro := largest_micro_batch(per_rank, limit)) is not None:
        step = probe.step_bytes(micro)  # the chosen size, run for real before training
        if step is not None and resident + step <= budget:
            return Fit(
                effective, ranks, micro, per_rank // micro, spec.memory_mb, budget / MiB, budget_from,
                per_sample, fixed / MiB, (resident + step) / MiB,
            )  # fmt: skip
        # Over the budget after all (or out of CUDA memory): below this size, at the slope it showed.
        limit = micro - 1
        if step is not None:
            limit = min(limit, math.floor((budget - fixed) * micro / (resident + step - fixed)))
    one = fixed + per_sample
    data_part = f", of which the data's {resident / MiB:.4g} MiB" if resident else ""
    setting = f"batch.memory_mb={spec.memory_mb}" if spec.memory_mb is not None else f"batch.effective={effective}"
    raise ConfigError(
        f"{setting}: a budget of {budget / MiB:.4g} MiB ({budget_from}) does not hold a training step of one "
        f"sample, which needs {one / MiB:.4g} MiB (fixed part {fixed / MiB:.4g} MiB{data_part}, plus "
        f"{per_sample:.4g} bytes a sample); allowed: batch.memory_mb of at least {rounded_up(one / MiB):.4g}"
    )


def budget_bytes(spec: DictConfig, device: torch.device, local_ranks: int, host_data: int) -> tuple[float, str]:
    """One rank's budget, and how it was set: batch.memory_mb; else a GPU's free memory less `gpu_margin` of its
    total; else `cpu_share` of the host's available memory, less the copies of the data that the other ranks on
    the host will make, split between them."""
    if spec.memory_mb is not None:
        return spec.memory_mb * MiB, "batch.memory_mb"
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # torch.cuda.set_per_process_memory_fraction caps what this process may use below what the device has.
        usable = torch.cuda.get_per_process_memory_fraction(device) * total
        free = min(free, usable - torch.cuda.memory_reserved(device))
        said = f"free GPU memory {free / MiB:.0f} MiB less {spec.gpu_margin:.0%} of the {usable / MiB:.0f} it may use"
        return free - spec.gpu_margin * usable, said
    available = host_available()
    if available is None:
        raise ConfigError(
            "batch.effective: this system does not say how much memory is available (no /proc/meminfo); "
            "allowed here: batch.memory_mb=<MiB per rank>"
        )
    shared = spec.cpu_share * available - (local_ranks - 1) * host_data
    ranks = f", for {local_ranks} ranks" if local_ranks > 1 else ""
    return int(shared / local_ranks), f"{spec.cpu_share:.0%} of the {available / MiB:.0f} MiB available{ranks}"


def _splits(data: RegressionData) -> list[torch.Tensor]:
    return list({id(t): t for t in (data.x_train, data.y_train, data.x_val, data.y_val)}.values())  # val may be train


def host_data_bytes(data: RegressionData) -> int:
    return sum(t.nbytes for t in _splits(data))


def resident_data_bytes(data: RegressionData, device: torch.device) -> int:
    """What the data adds on `device` once training starts: an epoch's order (int64, made where the data is), and
    its splits when `data.on_device` will move them there (on the CPU they are there before the budget is read)."""
    order, nbytes = 8 * len(data.x_train), host_data_bytes(data)
    if device.type == "cpu" or data.x_train.device == device:
        return order
    return nbytes + order if keep_on_device(data.on_device, device, nbytes) else 0


def applied(cfg: DictConfig, fit: Fit) -> DictConfig:
    """The config the run trains with: the fit's data.batch_size and trainer.accumulate_grad_batches. run.yaml and
    the checkpoint record it (eval.py scores in batches of that size); run dirs compare without both
    (experiments.run.state), since they follow from batch.*."""
    trained = copy.deepcopy(cfg)
    OmegaConf.update(trained, "data.batch_size", fit.global_batch)
    OmegaConf.update(trained, "trainer.accumulate_grad_batches", fit.accumulate)
    return trained


class ShareFit(Callback):
    """Every rank trains with rank 0's fit: at `setup`, when the ranks' process group exists and before any loader
    is built, rank 0's is broadcast and set on the trainer and the data (Lightning reads `accumulate_grad_batches`
    at every step; its own StochasticWeightAveraging sets it the same way)."""

    def __init__(self, fit: Fit):
        self.fit = fit

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.fit = trainer.strategy.broadcast(self.fit, src=0)
        if self.fit.ranks != trainer.world_size:
            raise RunFailed(f"batch.effective was fitted for {self.fit.ranks} ranks and {trainer.world_size} started")
        trainer.accumulate_grad_batches = self.fit.accumulate
        trainer.datamodule.batch_size = self.fit.global_batch


def suggestion(cfg: DictConfig, trainer: L.Trainer, data: RegressionData) -> str:
    """What `batch.effective` would choose for this run's effective batch, measured now (after the run ran out
    of memory): the out-of-memory message's advice. Only the option when the measurement fails too."""
    effective = cfg.data.batch_size * cfg.trainer.accumulate_grad_batches
    option = f"batch.effective={effective}"
    spec = OmegaConf.merge(cfg.batch, {"effective": effective, "memory_mb": None})  # the default budget
    try:
        fit = measure(cfg, trainer, data, effective, spec)
    except (ConfigError, RuntimeError) as err:
        return f"or let the lab choose with {option} ({str(err).splitlines()[0]})"
    return (
        f"or let the lab choose with {option}: measured now, it would train data.batch_size={fit.global_batch} "
        f"trainer.accumulate_grad_batches={fit.accumulate} (a micro-batch of {fit.micro_batch} per rank, "
        f"{fit.step_mb:.4g} MiB of a {fit.budget_mb:.4g} MiB budget: {fit.budget_from})"
    )


def fit_into(cfg: DictConfig, trainer: L.Trainer, data: RegressionData, perf, resumed, rank_zero: bool):
    """The train recipe's one call, once the trainer and the data are built and before the module is: fit, and set
    the choice wherever the run reads it. Returns (the config the run trains with, the fit or None)."""
    fit = fit_batch(cfg, trainer, data, resumed, rank_zero)
    if fit is None:
        return cfg, None
    data.batch_size = perf.global_batch_size = fit.global_batch
    trainer.accumulate_grad_batches = fit.accumulate  # public, and read by Lightning at every step
    if trainer.world_size > 1:
        trainer.callbacks.append(ShareFit(fit))
    return applied(cfg, fit), fit
