"""A callback for a DDP test run from the command line (`+callbacks.signal_peer._target_=signal_rank.SignalPeer`,
tests/ on the PYTHONPATH): from `step` on, the `sender` rank sends SIGTERM to its peer while the peer waits in the
ranks' agreement on a stop (experiments.run.interruption), the sender not there yet (test_reliability.py)."""

import os
import signal
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


class SignalPeer(Callback):
    def __init__(self, sender: int, step: int):
        self.sender, self.step = sender, step

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pids = [None, None]
        torch.distributed.all_gather_object(pids, os.getpid())  # a collective: every rank
        if trainer.global_rank != self.sender:
            return
        peer = pids[1 - self.sender]
        strategy, reduce = trainer.strategy, trainer.strategy.reduce

        def signal_inside_the_agreement(tensor, *args, **kwargs):
            # The agreement's all-reduce is the one of two numbers (the signal, and whether it is SIGUSR1).
            if self.step is not None and trainer.global_step >= self.step and tensor.shape == (2,):
                self.step = None
                time.sleep(1.0)  # the peer is in the all-reduce by now, waiting for this rank
                os.kill(peer, signal.SIGTERM)
                time.sleep(0.5)  # its handler has run... once its all-reduce returns
            return reduce(tensor, *args, **kwargs)

        strategy.reduce = signal_inside_the_agreement
