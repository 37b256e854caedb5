"""A training step that cannot fit is refused before training, for `data.batch_size` as the user gave it (with
`batch.effective`, experiments.training.batch_fit chooses a batch that fits instead).

Measured, as batch_fit measures, never guessed: probe steps of the run's own model, optimizer and precision on its
device give the step's fixed part (parameters, gradients, optimizer state) and what one more sample adds (the batch,
the activations the backward pass keeps, the gradients of the activations), so a model that computes (an MLP's
activations grow with the batch, the seed's Linear keeps almost none) is counted as what it allocates
(experiments.training.probe, batch_fit's mechanism too).
"""

import math

import lightning as L
from omegaconf import DictConfig

from experiments.config.errors import ConfigError
from experiments.config.sizes import device_free, host_available
from experiments.data.datamodule import RegressionData
from experiments.training.batch_fit import resident_data_bytes
from experiments.training.probe import MiB, Probe


def check_step_memory(cfg: DictConfig, trainer: L.Trainer, data: RegressionData) -> None:
    """Refuse `data.batch_size` when one rank's training step needs more than its device has available: the host's
    available memory (the one reader, experiments.config.sizes.host_available) split between the host's ranks, or
    the GPU's free memory."""
    device, ranks = trainer.strategy.root_device, max(trainer.world_size, 1)
    if device.type not in ("cpu", "cuda"):
        return
    local = max(trainer.num_devices, 1) if device.type == "cpu" else 1  # ranks sharing this host's memory
    available = host_available() if device.type == "cpu" else device_free(device)
    if available is None:
        return
    available //= local
    micro = max(cfg.data.batch_size // ranks, 1)
    probe = Probe(cfg, trainer, data, device)
    if device.type == "cuda":
        probe.step_bytes(1)  # CUDA's context, cuBLAS's workspace
    if (measured := probe.slope(micro, available)) is None:
        return  # out of CUDA memory already at the probes' size: the run's own error says so
    per_sample, fixed = measured
    fixed += resident_data_bytes(data, device)
    needed = fixed + per_sample * micro
    if needed <= available:
        return
    where = "host memory" + (f" for each of {local} ranks" if local > 1 else "") if device.type == "cpu" else (
        f"free on {device}")  # fmt: skip
    fits = math.floor((available - fixed) / per_sample) if per_sample else 0
    allowed = "a smaller model, or a device with more memory"
    if fits >= 1:
        split = next(k for k in range(math.ceil(micro / fits), micro + 1) if micro % k == 0)
        effective = cfg.data.batch_size * cfg.trainer.accumulate_grad_batches
        allowed = (
            f"data.batch_size={cfg.data.batch_size // split} trainer.accumulate_grad_batches="
            f"{cfg.trainer.accumulate_grad_batches * split} (the same effective batch), or batch.effective={effective}"
        )
    raise ConfigError(
        f"data.batch_size={cfg.data.batch_size}: a training step of {micro} samples a rank needs about "
        f"{needed / MiB:.4g} MiB (fixed part {fixed / MiB:.4g} MiB: the model, its gradients and optimizer state; "
        f"plus {per_sample:.4g} bytes a sample: the batch, the activations and their gradients, measured) and "
        f"{available / MiB:.4g} MiB are available ({where}); allowed: {allowed}"
    )
