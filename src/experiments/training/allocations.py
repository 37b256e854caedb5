"""The bytes of CPU tensors that a piece of code allocates at most at once: batch.effective's probe of a training
step on the CPU (experiments.training.batch_fit)."""

import weakref
from collections.abc import Iterator

import torch

from experiments import internals


class CpuAllocations(internals.TorchDispatchMode):
    """While active (`with counter:`), the bytes of the CPU tensors that torch allocates in this thread: `live`
    now, `peak` the most at once (experiments.training.batch_fit measures a training step on the CPU with it).

    Why: torch keeps no statistics of its CPU allocator (CUDA has `max_memory_allocated`), and the process's
    resident set (VmHWM) does not see memory that glibc hands out again from its own heap: a second probe of the
    same size grows it by 0 bytes. A dispatch mode (experiments.internals.TorchDispatchMode) sees every op,
    autograd's backward included, and each new storage is counted once until it is freed (a weakref's finalizer).
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._counted: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in _tensors(out):
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if tensor.device.type == "cpu" and key and key not in self._counted:
                self._counted.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self._counted.discard(key)
        self.live -= nbytes


def _tensors(out) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, list | tuple):
        for item in out:
            yield from _tensors(item)
