"""Batches sliced whole from in-memory tensors, in an order that depends on the seed and the epoch alone.

`data.batch_size` is the GLOBAL batch of one micro-step. Each of W ranks keeps a contiguous 1/W share of
every global batch, so changing the device count or the strategy changes the speed, never the maths.
"""

import time

import numpy as np
import torch

from experiments.training.clocks import BatchClock, TransferClock


class EpochShuffle:
    """The sample order of one epoch: a permutation drawn from (seed, epoch) only.

    Lightning calls `set_epoch` on a loader's `sampler` before every epoch (fabric's `_set_sampler_epoch`).
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        seed = np.random.SeedSequence([self.seed, self.epoch]).generate_state(1)[0]
        generator = torch.Generator().manual_seed(int(seed))
        return torch.randperm(self.num_samples, generator=generator)


class BatchLoader:
    """Yields `(x, y)` batches sliced whole from in-memory tensors.

    Hand-written because `DataLoader(TensorDataset)` collates sample by sample, which costs far more than
    the step itself for a model this small (docs/speed.md, the plain loop). A shuffled batch is one gather with one
    index tensor, on the device when the tensors live there; an unshuffled one (evaluation) is a view, no copy.

    Training batches drop the incomplete last global batch so that every rank always holds an equal share, and
    the batches short of a whole optimizer step (`accumulate` of them), so that every step of an epoch has the
    effective batch and an accumulated run trains as one with the effective batch would (Lightning would step on
    the remainder); evaluation batches keep every row and split the last batch as evenly as it goes
    (torchmetrics sums over ranks exactly).

    `clock` (a BatchClock) adds up the host time spent forming batches. `reuse=True` gathers every batch into
    the same two tensors, as the seed's loop written by an expert does: a fresh batch each step costs page
    faults and frees that grow with the batch (4 MB at B=1024, d=1000), more than the gather itself; a batch
    then holds only until the next one is formed, which suits a training window (experiments.training.windows).
    `device`: where the batches go, `transfer` timing the copies (a window's batches are copied here, not by
    Lightning). `pin_memory` gathers each batch straight into page-locked host memory, from which a copy to a
    GPU is a DMA that need not block the host (`non_blocking`); those batches come from PyTorch's caching host
    allocator, which hands a block out again only once the copies that read it have completed (a reused pinned
    tensor could be overwritten while a copy still reads it).
    """

    batch_sampler = None  # Lightning treats an object with a `sampler` like a DataLoader and reads this

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        sampler: EpochShuffle,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        clock: BatchClock | None = None,
        pin_memory: bool = False,
        accumulate: int = 1,
        reuse: bool = False,
        device: torch.device | None = None,
        transfer: TransferClock | None = None,
    ):
        self.x, self.y = x, y
        self.clock = clock or BatchClock()
        self.pin_memory = pin_memory
        self.reuse = reuse and not pin_memory and drop_last  # every batch the same size
        self.device = device or x.device
        self.copies = self.device != x.device
        self.transfer = transfer or TransferClock()
        self.batch_size = batch_size
        self.sampler = sampler
        self.rank, self.world_size = rank, world_size
        self.drop_last = drop_last
        self.accumulate = accumulate
        self.epoch, self.batches = sampler.epoch, 0  # the position: batches handed out in this epoch
        self.resume_at: tuple[int, int] | None = None
        self._index: list[torch.Tensor] | None = None  # this epoch's batch indices; None: unshuffled (views)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        n = len(self.x)
        if not self.drop_last:
            return -(-n // self.batch_size)
        return n // (self.batch_size * self.accumulate) * self.accumulate

    def state_dict(self) -> dict[str, int]:
        # Lightning keeps this in its checkpoints and hands it back on resume, so that an epoch interrupted
        # half-way goes on from the next batch. Batches handed out are batches the loop has taken: Lightning
        # prefetches nothing from a loader that has a length (`_PrefetchDataFetcher.__iter__`).
        return {"epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_at = (state["epoch"], state["batches"])

    def __iter__(self):
        # The body runs at the first batch, after Lightning has called `sampler.set_epoch`.
        self.start_epoch()
        while self.batches < len(self):
            yield self.next_batch()

    def start_epoch(self) -> None:
        """Go to the epoch's first batch, or to the saved position: it applies only to the epoch it was saved in
        (a checkpoint at an epoch's end starts the next one whole). Its time is the data's (BatchClock)."""
        began = time.perf_counter()
        start = self.resume_at[1] if self.resume_at and self.resume_at[0] == self.sampler.epoch else 0
        self.resume_at = None
        self.epoch, self.batches = self.sampler.epoch, start
        self._index = None
        if self.sampler.shuffle:
            order = self.sampler.order().to(self.x.device)
            if self.drop_last:
                # Every batch's index for this rank, as views made in one call: indexing the order tensor batch by
                # batch (`order[a:b]`) costs a few microseconds each time, as much as the gather of a small batch.
                share = self.batch_size // self.world_size
                rows = order[: len(self) * self.batch_size].view(len(self), self.batch_size)
                self._index = rows[:, self.rank * share : (self.rank + 1) * share].unbind(0)
            else:
                self._index = [order[slice(*self._rows(i))] for i in range(len(self))]
        self.clock.seconds += time.perf_counter() - began

    def _rows(self, i: int) -> tuple[int, int]:
        """This rank's rows of batch i, in epoch order: torch.tensor_split's share of the global batch (the
        first `rest` ranks take one more)."""
        a, b = i * self.batch_size, min((i + 1) * self.batch_size, len(self.x))
        share, rest = divmod(b - a, self.world_size)
        a += self.rank * share + min(self.rank, rest)
        return a, a + share + (self.rank < rest)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The epoch's next batch, on `device`."""
        began = time.perf_counter()
        i = self.batches
        self.batches = i + 1
        if self._index is None:
            a, b = self._rows(i)
            xb, yb = self.x[a:b], self.y[a:b]
        elif self.reuse:
            index = self._index[i]
            if self._buffers is None:
                self._buffers = tuple(torch.empty((len(index), *t.shape[1:]), dtype=t.dtype, device=t.device)
                                      for t in (self.x, self.y))  # fmt: skip
            xb = torch.index_select(self.x, 0, index, out=self._buffers[0])
            yb = torch.index_select(self.y, 0, index, out=self._buffers[1])
        elif self.pin_memory:
            xb, yb = self._pinned(self.x, self._index[i]), self._pinned(self.y, self._index[i])
        else:
            xb, yb = self.x[self._index[i]], self.y[self._index[i]]
        self.clock.seconds += time.perf_counter() - began
        if self.copies:
            with self.transfer.timing(self.device):
                # From pinned memory the copy is queued and the host goes on; from pageable memory CUDA stages it
                # and the host waits, so a reused host buffer is free again once `to` returns.
                xb, yb = xb.to(self.device, non_blocking=True), yb.to(self.device, non_blocking=True)
        return xb, yb

    @staticmethod
    def _pinned(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        out = torch.empty((len(index), *t.shape[1:]), dtype=t.dtype, pin_memory=True)
        return torch.index_select(t, 0, index, out=out)


class StepWindows:
    """The training loader that Lightning iterates: each item is a window (experiments.training.windows), the loader
    itself, from which the module's `training_step` draws the window's micro-batches (`next_batch`).

    Its length is the loader's, in micro-batches, which Lightning's counters count (the module counts a window's
    batches in them: experiments.internals.count_window); its state is the loader's position.
    """

    batch_sampler = None

    def __init__(self, loader: BatchLoader):
        self.loader = loader
        self.sampler = loader.sampler  # Lightning calls `set_epoch` on it

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, int]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loader.load_state_dict(state)

    def __iter__(self):
        # The body runs at the first window, after Lightning has called `sampler.set_epoch`.
        self.loader.start_epoch()
        while self.loader.batches < len(self.loader):
            yield self.loader
