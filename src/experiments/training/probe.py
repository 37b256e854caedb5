"""Probe steps: what one rank's training step allocates, measured with a fresh copy of the run's own model,
optimizer and precision on its device, never guessed and never by running out of memory. Both users of it share this
one mechanism: batch.effective's choice of micro-batch (experiments.training.batch_fit) and the refusal of a
data.batch_size whose step cannot fit (experiments.training.step_memory).

Memory is CUDA's `max_memory_allocated` on a GPU; on the CPU, the bytes of the tensors torch allocates
(`training.allocations.CpuAllocations`), since the process's resident set does not see memory that glibc reuses.
Every probe runs inside `torch.random.fork_rng`, so the run's seeded maths is the same as without it.
"""

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig

from experiments.config.errors import ConfigError
from experiments.data.datamodule import RegressionData
from experiments.training.allocations import CpuAllocations

MiB = 2**20
PROBE_BYTES = 4 * MiB  # a GPU's first probe's batch: large enough that CUDA's 512-byte rounding is noise, small
# beside any budget (or a sixteenth of a smaller one)
CPU_PROBE = 8  # samples of the CPU's first probe: torch's allocations there are counted exactly


class Probe:
    """Training steps of a fresh copy of the run's model and optimizer, at the run's precision, on rows of its
    data: what one rank's step allocates, fixed part included (model, gradients, optimizer state)."""

    def __init__(self, cfg: DictConfig, trainer: L.Trainer, data: RegressionData, device: torch.device):
        self.cfg, self.precision, self.data, self.device = cfg, trainer.precision_plugin, data, device
        self.splits = (data.x_train, data.y_train)

    def step_bytes(self, micro_batch: int, steps: int = 2) -> int | None:
        """Peak bytes of `steps` steps (the first makes the optimizer's state); None if CUDA ran out of memory."""
        rows = torch.arange(micro_batch, device=self.splits[0].device)  # on the GPU where the run moved the data
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the run's seeded initial weights stay as they are
            try:
                return allocated_peak(self.device, lambda: self._steps(rows, steps))
            except torch.OutOfMemoryError:
                return None
            finally:
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def slope(self, largest: int, room: float) -> tuple[float, float] | None:
        """(bytes one more sample adds to a step, the step's fixed bytes), measured where the per-sample part
        outweighs the fixed part; None if CUDA ran out of memory. A step's peak is the largest of several moments'
        bytes (after the forward pass, in the backward pass, at the update), each growing with the batch at its own
        rate: a small batch peaks where the weights weigh most, a large one where the activations do, so the slope
        of small probes alone undercounts a model that computes (an MLP [2048, 2048]: 8600 bytes a sample from 8
        and 16 samples, 41,370 where the activations dominate; a step of 32,768 that the first figure admitted ran
        out of a 1 GiB cgroup). The probes double from a few samples up to `largest`, none larger than the slope
        seen so far, doubled, puts within `room` bytes: a probe never runs out of memory itself (on the CPU that
        kills the process)."""
        rows = CPU_PROBE if self.device.type == "cpu" else int(min(PROBE_BYTES, room / 16) // data_row_bytes(self.data))
        low = max(1, min(largest // 2, rows))
        high, peak_low = max(low + 1, 2 * low), self.step_bytes(low)
        while True:
            peak_high = self.step_bytes(high)
            if peak_low is None or peak_high is None:
                return None
            per_sample = (peak_high - peak_low) / (high - low)
            if per_sample <= 0:  # noise in tiny probes: the whole step a sample, a bound from above
                return peak_high / high, 0.0
            fixed = max(peak_low - low * per_sample, 0.0)
            larger = min(2 * high, largest, int((room - fixed) / (2 * per_sample)))
            if per_sample * high >= 4 * fixed or larger <= high:
                return per_sample, fixed
            low, peak_low, high = high, peak_high, larger

    def _steps(self, rows: torch.Tensor, steps: int) -> None:
        net = instantiate(self.cfg.model, in_features=self.data.num_features)
        net = self.precision.convert_module(net).to(self.device)
        optimizer = instantiate(self.cfg.optimizer)(net.parameters())
        for _ in range(steps):
            # Gathered as the loader gathers a batch, then moved as Lightning moves it.
            x, y = (self.precision.convert_input(t.index_select(0, rows).to(self.device)) for t in self.splits)
            with self.precision.train_step_context():
                loss = F.mse_loss(net(x), y)  # Regressor.training_step's loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del x, y, loss


def allocated_peak(device: torch.device, work) -> int:
    """The most bytes allocated at once on `device` while `work()` runs, beyond what was allocated before."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        work()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    if device.type != "cpu":
        raise ConfigError(
            f"batch.effective: memory is measured on cpu and cuda devices, not {device.type}; allowed: "
            "trainer.accelerator=cpu or cuda, or data.batch_size and trainer.accumulate_grad_batches set by hand"
        )
    with CpuAllocations() as counter:
        work()
    return counter.peak


def data_row_bytes(data: RegressionData) -> int:
    return data.x_train[0].nbytes + data.y_train[0].nbytes
