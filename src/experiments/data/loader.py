"""Batches sliced whole from in-memory tensors, in an order that depends on the seed and the epoch alone.

`data.batch_size` is the GLOBAL batch of one micro-step. Each of W ranks keeps a contiguous 1/W share of
every global batch, so changing the device count or the strategy changes the speed, never the maths.
"""

import time

import numpy as np
import torch

from experiments.perf import BatchClock


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
    the step itself for a model this small (design.md, known traps). Indexing with one index tensor per
    batch is a single gather, on the device when the tensors live there.

    Training batches drop the incomplete last global batch so that every rank always holds an equal share, and
    the batches short of a whole optimizer step (`accumulate` of them), so that every step of an epoch has the
    effective batch and an accumulated run trains as one with the effective batch would (Lightning would step on
    the remainder); evaluation batches keep every row and split the last batch as evenly as it goes
    (torchmetrics sums over ranks exactly).

    `clock` (a BatchClock) adds up the host time spent forming batches. `pin_memory` gathers each batch
    straight into page-locked host memory, from which a copy to a GPU is a DMA that need not block the host
    (`non_blocking`); the batches come from PyTorch's caching host allocator, which hands a block out again only
    once the copies that read it have completed.
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
    ):
        self.x, self.y = x, y
        self.clock = clock or BatchClock()
        self.pin_memory = pin_memory
        self.batch_size = batch_size
        self.sampler = sampler
        self.rank, self.world_size = rank, world_size
        self.drop_last = drop_last
        self.accumulate = accumulate
        self.epoch, self.batches = sampler.epoch, 0  # the position: batches handed out in this epoch
        self.resume_at: tuple[int, int] | None = None

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
        # The body runs at the first batch, after Lightning has called `sampler.set_epoch`: a saved position
        # applies only to the epoch it was saved in (a checkpoint at an epoch's end starts the next one whole).
        began = time.perf_counter()
        start = self.resume_at[1] if self.resume_at and self.resume_at[0] == self.sampler.epoch else 0
        self.resume_at = None
        self.epoch, self.batches = self.sampler.epoch, start
        order = self.sampler.order().to(self.x.device)
        for i in range(start, len(self)):
            batch = order[i * self.batch_size : (i + 1) * self.batch_size]
            local = torch.tensor_split(batch, self.world_size)[self.rank]
            self.batches = i + 1
            xb, yb = (
                (self._pinned(t, local) for t in (self.x, self.y))
                if self.pin_memory
                else (self.x[local], self.y[local])
            )
            self.clock.seconds += time.perf_counter() - began
            yield xb, yb
            # Let go of this batch before gathering the next: held here, two batches would be alive at the peak of
            # every step (twice the batch's memory; experiments.batch_fit measures a step with one).
            del xb, yb
            began = time.perf_counter()

    @staticmethod
    def _pinned(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        out = torch.empty((len(index), *t.shape[1:]), dtype=t.dtype, pin_memory=True)
        return torch.index_select(t, 0, index, out=out)
