"""Speed and memory of a run, measured without forcing a device sync on every step."""

import resource
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


def peak_memory_mb(device: torch.device) -> float:
    """CUDA's peak allocated memory on a GPU; the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak from now, so that the jobs of a sweep that run one after another in one process (Hydra's
    basic launcher, a joblib worker) each report their own peak rather than the largest so far."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: writing 5 to clear_refs resets the peak resident set (VmHWM, ru_maxrss); see proc(5)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # elsewhere the peak stays the process's


class PerfMonitor(Callback):
    """Steady-state step time and throughput, transfer time and peak memory.

    Step time counts micro-steps (one global batch of `data.batch_size` samples each). The clock starts
    after `warmup_steps`, so start-up and first-step compilation stay out of the steady state:
    step time = (T(N) - T(warmup)) / (N - warmup). The device is synchronised only when a figure is read,
    every `trainer.log_every_n_steps` micro-steps and at the end.
    """

    def __init__(self, global_batch_size: int, warmup_steps: int = 5):
        self.global_batch_size = global_batch_size
        self.warmup_steps = warmup_steps
        self.summary: dict[str, float] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        reset_peak_memory(pl_module.device)
        self.fit_start = time.perf_counter()
        self.steps = 0
        self.clock_start = None  # (time, steps) when the warm-up ended

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        self.steps += 1
        if self.steps == self.warmup_steps:
            self.clock_start = (self._now(pl_module), self.steps)
        elif self.steps % trainer.log_every_n_steps == 0:
            self._read(pl_module)
            for logger in trainer.loggers:
                logger.log_metrics({f"perf/{k}": v for k, v in self.summary.items()}, step=trainer.global_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._read(pl_module)

    def _now(self, pl_module: L.LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    def _read(self, pl_module: L.LightningModule) -> None:
        now = self._now(pl_module)
        # Too short a run for a steady state: fall back to the whole run.
        start, start_steps = self.clock_start or (self.fit_start, 0)
        steps = max(self.steps - start_steps, 1)
        elapsed = max(now - start, 1e-9)
        self.summary = {
            "samples_per_sec": self.global_batch_size * steps / elapsed,
            "step_time_ms": 1e3 * elapsed / steps,
            "transfer_ms": 1e3 * getattr(pl_module, "transfer_seconds", 0.0) / max(self.steps, 1),
            "peak_memory_mb": peak_memory_mb(pl_module.device),
        }
