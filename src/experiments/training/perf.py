"""Speed and memory of a run, measured without forcing a device sync on every step."""

import os
import resource
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import PassThroughProfiler

from experiments import internals
from experiments.training.clocks import BatchClock, ComputeClock, synchronized_clock
from experiments.training.log_steps import ends_optimizer_step
from experiments.training.windows import WARMUP_BATCHES


def peak_memory_mb(device: torch.device) -> float:
    """CUDA's peak allocated memory on a GPU; the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = peak_resident_mb()
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB (Linux)


def peak_resident_mb(pid: int | str = "self") -> float | None:
    """A process's peak resident set (VmHWM), in MiB; None where /proc does not say (not Linux, or it exited).

    VmHWM rather than getrusage's ru_maxrss: Linux carries ru_maxrss over from the parent process across fork and
    exec, so a run started by a large process (a benchmark, a sweep launcher) would report the parent's peak.
    """
    try:
        status = _own_status() if pid == "self" else Path(f"/proc/{pid}/status").read_bytes()
        return int(status.split(b"VmHWM:", 1)[1].split(None, 1)[0]) / 2**10
    except (OSError, IndexError, ValueError):
        return None


_status: tuple[int, int] | None = None  # (pid, an open descriptor of its /proc/<pid>/status)


def _own_status() -> bytes:
    """This process's /proc status, read through a descriptor kept open (PerfMonitor reads it at every window's end:
    opening the file by its path costs about 0.1 ms, as much as a step of the seed's model)."""
    global _status
    if _status is None or _status[0] != os.getpid():  # a forked child opens its own
        _status = (os.getpid(), os.open(f"/proc/{os.getpid()}/status", os.O_RDONLY))
    return os.pread(_status[1], 1 << 16, 0)


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


class PerfMonitor(Callback):
    """Steady-state step time and throughput, where a step's time goes, peak memory and start-up time.

    Step time counts micro-steps (one global batch of `data.batch_size` samples each). The clock starts at the
    first optimizer-step boundary after `warmup_steps` micro-steps (the first windows run a step each:
    experiments.training.windows), so start-up and first-step compilation stay out of the steady state: step time =
    (T(N) - T(warmup)) / (N - warmup), with time spent in validation and in saving last.ckpt left out (a save's
    cost is metrics.json's `checkpoint_save_ms`: a step is what the raw loop does, not the run's I/O). Its hooks
    run once a window, and count the window's micro-batches from Lightning's counters. The device is
    synchronised only when a figure is read: at the end of each window that ends an optimizer step (at most about
    `window_s` apart, or a log interval: experiments.training.windows), around validation and at the end.

    A step's time is split into `data_ms` (forming the batch: BatchClock), `transfer_ms` (host-to-device
    copies: TransferClock), `compute_ms` (forward, backward and optimizer update: ComputeClock), `comm_ms` (under
    DDP on the host clock: waiting for the gradients' all-reduce, experiments.distributed.comm; 0 otherwise) and
    `framework_ms`, the rest: Lightning's loop, hooks, callbacks and logging, and the window's own loop. Each
    of the first four is timed on its own, so the rest is a measurement too (it would come out negative if the
    parts overlapped).

    TensorBoard's `perf/*` points, one at each such window's end, at its last step, describe the interval since
    the previous point; `summary` (metrics.json) the whole steady state. `startup_s` runs from `started_at`
    (`run_start_time()`: the start of the process for its first run, of the run for later ones) to the start of the
    first step.
    """

    def __init__(
        self,
        global_batch_size: int,
        warmup_steps: int = WARMUP_BATCHES,
        started_at: float | None = None,
        saver=None,
    ):
        self.global_batch_size = global_batch_size
        self.saver = saver  # the run's LastCheckpoint (run.last_checkpoint): its `seconds_saving` is not training
        self.warmup_steps = warmup_steps
        self.summary: dict[str, float] = {}
        self.started_at = started_at if started_at is not None else run_start_time()
        self.steps = None  # micro-steps of the current fit; None before the first fit starts
        self.validation_start = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        reset_peak_memory(pl_module.device)
        self.compute_clock = getattr(pl_module, "compute_clock", None) or ComputeClock()
        self.compute_clock.bind(pl_module.device)
        self.compute_clock.sample()
        self.batch_clock = getattr(trainer.datamodule, "batch_clock", None) or BatchClock()
        self.transfer_clock = getattr(trainer.datamodule, "transfer_clock", None)
        self.steps, self.steps_before = 0, internals.micro_batches_done(trainer)[1]  # a resume counts from there
        self.paused = self.paused_transfer = 0.0  # seconds in validation, and in its copies, since the fit began
        self.saved_before = self._seconds_saving()
        self.first_step_at = None
        self.fit_start = self._mark(pl_module)
        self.steady_start = self.interval_start = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.time()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        self.steps = internals.micro_batches_done(trainer)[1] - self.steps_before  # the window's included
        if self.steady_start is None:
            if self.steps >= self.warmup_steps and ends_optimizer_step(trainer):
                self.steady_start = self.interval_start = self._mark(pl_module)
                self.compute_clock.sample()
        elif ends_optimizer_step(trainer):
            mark = self._mark(pl_module)
            interval = self._figures(self.interval_start, mark, pl_module)
            self.interval_start = mark
            self.compute_clock.sample()
            for logger in trainer.loggers:
                logger.log_metrics({f"perf/{k}": v for k, v in interval.items()}, step=trainer.global_step)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.steps is not None and not trainer.sanity_checking:
            self.validation_start = (self._clock(pl_module), self._transfer_seconds())

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.validation_start is not None:
            self.paused += self._clock(pl_module) - self.validation_start[0]
            self.paused_transfer += self._transfer_seconds() - self.validation_start[1]
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

    def training_seconds(self) -> float:
        """Seconds of training since the fit began, validation and saves left out; during a validation, up to its
        start."""
        now = self.validation_start[0] if self.validation_start else time.perf_counter()
        return now - self._paused() - self.fit_start["time"]

    def _seconds_saving(self) -> float:
        return self.saver.seconds_saving if self.saver is not None else 0.0

    def _paused(self) -> float:
        """Seconds of this fit not spent training: in validation and in last.ckpt's saves."""
        return self.paused + self._seconds_saving() - self.saved_before

    def _clock(self, pl_module: L.LightningModule) -> float:
        return synchronized_clock(pl_module.device)

    def _transfer_seconds(self) -> float:
        return self.transfer_clock.total_seconds() if self.transfer_clock else 0.0

    def _mark(self, pl_module: L.LightningModule) -> dict[str, float]:
        """The clocks now, validation and saves left out of the training time, validation of the transfers."""
        training_time = self._clock(pl_module) - self._paused()
        compute, computed_steps = self.compute_clock.total()
        return {
            "time": training_time,
            "steps": self.steps,
            "transfer": self._transfer_seconds() - self.paused_transfer,
            "data": self.batch_clock.seconds,
            "compute": compute,
            "comm": self.compute_clock.comm_seconds,
            "computed_steps": computed_steps,
        }

    def _figures(self, start: dict, end: dict, pl_module: L.LightningModule) -> dict[str, float]:
        steps = max(end["steps"] - start["steps"], 1)
        elapsed = max(end["time"] - start["time"], 1e-9)
        computed = end["computed_steps"] - start["computed_steps"]
        figures = {
            "step_time_ms": 1e3 * elapsed / steps,
            "data_ms": 1e3 * (end["data"] - start["data"]) / steps,
            "transfer_ms": 1e3 * (end["transfer"] - start["transfer"]) / steps,
            # per micro-step of the steps timed: all of them on the host clock, the sampled ones on CUDA
            "compute_ms": 1e3 * (end["compute"] - start["compute"]) / computed if computed else 0.0,
            "comm_ms": 1e3 * (end["comm"] - start["comm"]) / computed if computed else 0.0,
        }
        figures["framework_ms"] = figures["step_time_ms"] - figures["data_ms"] - figures["transfer_ms"]
        figures["framework_ms"] -= figures["compute_ms"] + figures["comm_ms"]
        return {
            "samples_per_sec": self.global_batch_size * steps / elapsed,
            **figures,
            "peak_memory_mb": peak_memory_mb(pl_module.device),
        }
