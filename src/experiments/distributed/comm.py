"""The gradients' all-reduce of DDP, timed: `comm_ms`, the part of a DDP step spent communicating or waiting for the
other ranks, which would otherwise hide in compute_ms (experiments.training.perf).

DDP hands a bucket of gradients to its all-reduce as soon as the bucket's last gradient has been accumulated, and
its backward pass returns only once every bucket's all-reduce has completed. A post-accumulate-grad hook on each
parameter notes when the last gradient of the backward pass was accumulated; from then to the end of the backward
pass the rank computes nothing: it sends, receives, and waits for the slowest rank. On the host clock (CPU) the
module subtracts that time from the micro-batch's compute and counts it as communication. On CUDA the all-reduce
runs on a stream, so the host clock says nothing about it: there the sampled step's CUDA events include it in
compute_ms.

Not a DDP communication hook: DDP's own all-reduce stays in C++, where a hook written in Python (torch's
`allreduce_hook`, wrapped to note the time) cost about 0.15 ms a step on this project's CPU (its call, the
all-reduce's Python wrapper and the future's callback), 5-7% of a DDP step at B=1024; two tensor hooks cost a few
microseconds.

`agree` is the ranks' other exchange: a few numbers they decide on together (a stop).
"""

import time

import torch
from torch.nn.parallel import DistributedDataParallel


class CommClock:
    """When the last gradient of the current backward pass was accumulated (`time.perf_counter()`)."""

    def __init__(self):
        self.ready: float | None = None

    def note(self, parameter: torch.Tensor) -> None:
        self.ready = time.perf_counter()

    def wait_since_ready(self) -> float:
        """Seconds from the last gradient's accumulation to now (the end of the backward pass); 0 when none was."""
        if self.ready is None:
            return 0.0
        seconds, self.ready = time.perf_counter() - self.ready, None
        return seconds


def timed(model: torch.nn.Module) -> CommClock | None:
    """Put the clock's hooks on a DDP-wrapped model's parameters (once); None for any other model."""
    if not isinstance(model, DistributedDataParallel):
        return None
    clock = getattr(model, "_gpu_lab_comm_clock", None)
    if clock is None:
        clock = CommClock()
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.register_post_accumulate_grad_hook(clock.note)
        model._gpu_lab_comm_clock = clock  # a second fit on the same wrapper finds it
    return clock


def agree(values: torch.Tensor, op: torch.distributed.ReduceOp.RedOpType) -> torch.Tensor:
    """`values` reduced over the ranks by `op`, in place, in one collective. torch's all-reduce, not Lightning's
    `strategy.reduce`: that puts a barrier before it (`_sync_ddp`), one more collective (about 0.5 ms on gloo) that an
    all-reduce, which waits for every rank itself, does not need."""
    torch.distributed.all_reduce(values, op=op)
    return values
