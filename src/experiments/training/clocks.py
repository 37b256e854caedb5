"""The clocks of a step's parts, read without forcing a device sync on every step: forming the batch (BatchClock),
copying it to the device (TransferClock), and forward, backward and update (ComputeClock, fed by a step clock the
module runs each micro-batch: HostStepClock on the CPU, DeviceStepClock on CUDA). PerfMonitor
(experiments.training.perf) reads them at log steps."""

import time
from contextlib import contextmanager

import torch


def synchronized_clock(device: torch.device) -> float:
    """`time.perf_counter()` once the device has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


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


class BatchClock:
    """Host seconds spent forming training batches (BatchLoader's gather into its reused batch), added to by the
    loader itself.

    Two `time.perf_counter()` reads a batch (about 0.1 us together); on a GPU with device-resident data the
    gather is only queued, and this is the time to queue it.
    """

    def __init__(self):
        self.seconds = 0.0


class ComputeClock:
    """Forward, backward and optimizer update of training steps, timed by the module (module.py) around each
    micro-batch of a window, from its forward pass to the end of its update (the loss check and the scheduler's
    step included).

    On the CPU (and MPS, whose kernels run before the host goes on, mostly) the host clock times every
    micro-step: the module reads `time.perf_counter()` itself, twice a micro-batch, and `add`s a window's total.
    On CUDA the host clock would time kernel launches, not kernels: a pair of CUDA events brackets one optimizer
    step per log interval (`sample()`, `start()`, `stop()`), read only after the monitor has synchronised, so no
    step waits for the device and the other steps record nothing.
    """

    def __init__(self):
        self.seconds = 0.0
        self.comm_seconds = 0.0  # DDP on the host clock: waiting for the gradients' all-reduce (comm_ms)
        self.micro_steps = 0  # micro-steps timed: every one on the host clock, the sampled ones with events
        self.cuda = False
        self.active = True  # host clock: always; CUDA: during a sampled optimizer step
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start = None

    def bind(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.active = not self.cuda

    def sample(self) -> None:
        """Time the next optimizer step (CUDA; on the host clock every step is timed anyway)."""
        self.active = True

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, micro_step: bool = False) -> None:
        if not self.active:
            return
        self.micro_steps += micro_step
        self._start = self._now()

    def stop(self, step_done: bool = False) -> None:
        if self._start is None:
            return
        if self.cuda:
            self.pending.append((self._start, self._now()))
            self.active = not step_done
        else:
            self.seconds += time.perf_counter() - self._start
        self._start = None

    def add(self, seconds: float, micro_steps: int, comm_seconds: float = 0.0) -> None:
        """Host-clock time the module measured itself (a method call a micro-batch would cost more than its reads):
        compute, and under DDP the wait for the gradients' all-reduce, which it took out of the compute."""
        self.seconds += seconds
        self.comm_seconds += comm_seconds
        self.micro_steps += micro_steps

    def total(self) -> tuple[float, int]:
        """(seconds, micro-steps) timed so far; call it after a device sync, so that every event has completed."""
        self.seconds += sum(start.elapsed_time(end) for start, end in self.pending) / 1e3
        self.pending.clear()
        return self.seconds, self.micro_steps




class HostStepClock:
    """The module's clock of each micro-batch on the host (CPU, MPS): two `time.perf_counter()` reads a micro-batch,
    and under DDP the wait for the gradients' all-reduce taken out of the compute (experiments.distributed.comm); a
    window's total goes to the ComputeClock once, at its end (a call a micro-batch would cost more than its reads)."""

    def __init__(self, compute: ComputeClock, comm=None):
        self.compute, self.comm = compute, comm
        self.seconds = self.waited = 0.0
        self.micro_steps = 0

    def start(self) -> None:
        self.began = time.perf_counter()

    def backward_done(self) -> None:
        """After the backward pass of a step's last micro-batch: how long it waited for the all-reduce."""
        if self.comm is not None:
            self.waited += self.comm.wait_since_ready()

    def stop(self, step_done: bool) -> None:
        self.seconds += time.perf_counter() - self.began
        self.micro_steps += 1

    def end_window(self) -> None:
        self.compute.add(self.seconds - self.waited, self.micro_steps, self.waited)
        self.seconds = self.waited = 0.0
        self.micro_steps = 0


class DeviceStepClock:
    """The module's clock on CUDA: the ComputeClock's events around the sampled optimizer step (the all-reduce
    included: it runs on a stream, which the host clock cannot see)."""

    def __init__(self, compute: ComputeClock):
        self.compute = compute

    def start(self) -> None:
        self.compute.start(micro_step=True)

    def backward_done(self) -> None:
        pass

    def stop(self, step_done: bool) -> None:
        self.compute.stop(step_done=step_done)

    def end_window(self) -> None:
        pass
