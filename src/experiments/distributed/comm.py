"""The gradients' all-reduce of DDP, timed: `comm_ms`, the part of a DDP step spent communicating or waiting for the
other ranks, which would otherwise hide in compute_ms (experiments.perf).

DDP calls its communication hook when a bucket of gradients is ready, and its backward pass returns only once
every bucket's all-reduce has completed. The hook here runs torch's own default (`allreduce_hook`: divide by the
world size, all-reduce) and notes when the last bucket became ready; from then to the end of the backward pass the
rank computes nothing: it sends, receives, and waits for the slowest rank. On the host clock (CPU) the module
subtracts that time from the micro-batch's compute and counts it as communication. On CUDA the all-reduce runs on
a stream, so the host clock says nothing about it: there the sampled step's CUDA events include it in compute_ms.

`agree` is the ranks' other exchange: a few numbers they decide on together (a stop, finite weights).
"""

import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel


class CommClock:
    """When the last bucket of the current backward pass was handed to the all-reduce (`time.perf_counter()`)."""

    def __init__(self):
        self.ready: float | None = None

    def wait_since_ready(self) -> float:
        """Seconds from the last bucket's hand-over to now (the end of the backward pass); 0 when none was."""
        if self.ready is None:
            return 0.0
        seconds, self.ready = time.perf_counter() - self.ready, None
        return seconds


def _timed_allreduce(clock: CommClock, bucket) -> torch.futures.Future[torch.Tensor]:
    clock.ready = time.perf_counter()
    return allreduce_hook(None, bucket)  # torch's default: the mean over the default process group


def timed(model: torch.nn.Module) -> CommClock | None:
    """Register the timing hook on a DDP-wrapped model (once: DDP takes one hook); None for any other model."""
    if not isinstance(model, DistributedDataParallel):
        return None
    clock = getattr(model, "_gpu_lab_comm_clock", None)
    if clock is None:
        clock = CommClock()
        model.register_comm_hook(clock, _timed_allreduce)
        model._gpu_lab_comm_clock = clock  # a second fit on the same wrapper finds it
    return clock


def agree(values: torch.Tensor, op: torch.distributed.ReduceOp.RedOpType) -> torch.Tensor:
    """`values` reduced over the ranks by `op`, in place, in one collective. torch's all-reduce, not Lightning's
    `strategy.reduce`: that puts a barrier before it (`_sync_ddp`), one more collective (about 0.5 ms on gloo) that an
    all-reduce, which waits for every rank itself, does not need."""
    torch.distributed.all_reduce(values, op=op)
    return values
