"""A model for a DDP test run from the command line (`model._target_=slow_rank.SlowOnRankOne`, tests/ on the
PYTHONPATH): rank 1's forward pass also sleeps, so that rank 0 waits for it in every all-reduce (test_perf.py)."""

import time

import torch


class SlowOnRankOne(torch.nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, seconds: float = 0.0):
        super().__init__(in_features, out_features, bias)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
            time.sleep(self.seconds)
        return super().forward(x)
