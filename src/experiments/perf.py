"""Speed and memory of a run, measured without forcing a device sync on every step."""

import os
import resource
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import PassThroughProfiler


def peak_memory_mb(device: torch.device) -> float:
    """CUDA's peak allocated memory on a GPU; the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # VmHWM rather than getrusage's ru_maxrss: Linux carries ru_maxrss over from the parent process across
    # fork and exec, so a run started by a large process (a benchmark, a sweep launcher) would report the
    # parent's peak.
    try:
        status = Path("/proc/self/status").read_text()
        return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) / 2**10
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux (bytes on macOS)


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


def process_start_time() -> float | None:
    """When this process started, on the `time.time()` clock; None where /proc is missing (not Linux).

    Read from /proc rather than psutil to need no extra package: field 22 of /proc/self/stat is the start
    in clock ticks after boot, /proc/uptime the seconds since boot (resolution: one tick, 10 ms).
    """
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the command name in parentheses may hold spaces
    age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # fields[0] is field 3
    return time.time() - age


_runs_started = 0


def run_start_time() -> float:
    """When the run that calls this started, on the `time.time()` clock: the process's start for its first
    run (the user waited for Python, the imports and Hydra), now for each later run in the same process (the
    jobs of a sweep under Hydra's basic launcher or one joblib worker), which did not wait for the earlier."""
    global _runs_started
    _runs_started += 1
    started = process_start_time() if _runs_started == 1 else None
    return started if started is not None else time.time()


class NoProfiler(PassThroughProfiler):
    """Lightning's default pass-through profiler without its cost on every hook call.

    Lightning wraps each of the ~50 hook calls of a training step in `profiler.profile(name)`. The default
    profiler records nothing, yet builds a generator-based context manager each time (about 1 us); this one
    hands back one shared no-op context. `trainer.profiler=simple` (or advanced, pytorch) replaces it.
    """

    def profile(self, action_name: str) -> AbstractContextManager:
        return _NO_OP


_NO_OP = nullcontext()


class TransferClock:
    """Time spent copying batches from host to device, read without a sync of its own.

    On CUDA a pair of events brackets each copy and is read only after the monitor has synchronised (at log
    intervals): the host clock would also count the wait for queued work that a copy from pageable memory
    makes. Elsewhere (MPS) the copy is blocking and the host clock measures it.
    """

    def __init__(self):
        self.seconds = 0.0
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def timing(self, device: torch.device):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pending.append((start, end))
        else:
            start = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - start

    def total_seconds(self) -> float:
        """All copies so far; call it after a device sync, so that every recorded event has completed."""
        self.seconds += sum(start.elapsed_time(end) for start, end in self.pending) / 1e3
        self.pending.clear()
        return self.seconds


class PerfMonitor(Callback):
    """Steady-state step time and throughput, transfer time, peak memory and start-up time.

    Step time counts micro-steps (one global batch of `data.batch_size` samples each). The clock starts
    after `warmup_steps`, so start-up and first-step compilation stay out of the steady state:
    step time = (T(N) - T(warmup)) / (N - warmup), with time spent in validation left out. The device is
    synchronised only when a figure is read: every `trainer.log_every_n_steps` micro-steps, around
    validation and at the end.

    TensorBoard's `perf/*` points describe the interval since the previous point; `summary` (metrics.json)
    the whole steady state. `startup_s` runs from `started_at` (`run_start_time()`: the start of the process
    for its first run, of the run for later ones) to the start of the first step.
    """

    def __init__(self, global_batch_size: int, warmup_steps: int = 5, started_at: float | None = None):
        self.global_batch_size = global_batch_size
        self.warmup_steps = warmup_steps
        self.summary: dict[str, float] = {}
        self.started_at = started_at if started_at is not None else run_start_time()
        self.steps = None  # micro-steps of the current fit; None before the first fit starts
        self.validation_start = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        reset_peak_memory(pl_module.device)
        self.steps = 0
        self.paused = self.paused_transfer = 0.0  # seconds in validation, and in its copies, since the fit began
        self.first_step_at = None
        self.fit_start = self._mark(pl_module)
        self.steady_start = self.interval_start = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.time()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        self.steps += 1
        if self.steps == self.warmup_steps:
            self.steady_start = self.interval_start = self._mark(pl_module)
        elif self.steady_start and self.steps % trainer.log_every_n_steps == 0:
            mark = self._mark(pl_module)
            interval = self._figures(self.interval_start, mark, pl_module)
            self.interval_start = mark
            for logger in trainer.loggers:
                logger.log_metrics({f"perf/{k}": v for k, v in interval.items()}, step=trainer.global_step)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.steps is not None and not trainer.sanity_checking:
            self.validation_start = (self._clock(pl_module), self._transfer_seconds(pl_module))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.validation_start is not None:
            self.paused += self._clock(pl_module) - self.validation_start[0]
            self.paused_transfer += self._transfer_seconds(pl_module) - self.validation_start[1]
            self.validation_start = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # A failed or interrupted run reports its speed up to where it stopped, under the same keys.
        if self.steps is not None and not self.summary:
            self.on_train_end(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Too short a run for a steady state: fall back to the whole run.
        self.summary = self._figures(self.steady_start or self.fit_start, self._mark(pl_module), pl_module)
        if self.started_at is not None and self.first_step_at is not None:
            self.summary["startup_s"] = self.first_step_at - self.started_at

    def _clock(self, pl_module: L.LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    def _transfer_seconds(self, pl_module: L.LightningModule) -> float:
        clock = getattr(pl_module.trainer.datamodule, "transfer_clock", None)
        return clock.total_seconds() if clock else 0.0

    def _mark(self, pl_module: L.LightningModule) -> tuple[float, int, float]:
        """(training time, micro-steps, transfer seconds) now, validation left out of both times."""
        training_time = self._clock(pl_module) - self.paused
        return training_time, self.steps, self._transfer_seconds(pl_module) - self.paused_transfer

    def _figures(self, start: tuple, end: tuple, pl_module: L.LightningModule) -> dict[str, float]:
        steps = max(end[1] - start[1], 1)
        elapsed = max(end[0] - start[0], 1e-9)
        return {
            "samples_per_sec": self.global_batch_size * steps / elapsed,
            "step_time_ms": 1e3 * elapsed / steps,
            "transfer_ms": 1e3 * (end[2] - start[2]) / steps,
            "peak_memory_mb": peak_memory_mb(pl_module.device),
        }
