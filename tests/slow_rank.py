"""A model for a DDP test run from the command line (`model._target_=slow_rank.SlowOnRankOne`, tests/ on the
PYTHONPATH): rank 1's forward pass also sleeps, so that rank 0 waits for it in every all-reduce (test_perf.py), or a
run outlasts SLURM's notice of a lost node (test_multinode.py: `first_start_only`, a requeued job runs at full pace)."""

import os
import time

import torch


class SlowOnRankOne(torch.nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias=True, seconds=0.0, first_start_only=False):
        super().__init__(in_features, out_features, bias)
        requeued = os.environ.get("SLURM_RESTART_COUNT", "0") != "0"
        self.seconds = 0.0 if first_start_only and requeued else seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
            time.sleep(self.seconds)
        return super().forward(x)
