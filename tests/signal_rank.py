"""A callback for a DDP test run from the command line (`+callbacks.signal_peer._target_=signal_rank.SignalPeer`,
tests/ on the PYTHONPATH): from `step` on, the `sender` rank sends SIGTERM to its peer while the peer waits in the
ranks' agreement on a stop (experiments.training.interruption), the sender not there yet (test_faults_ranks.py)."""

import os
import signal
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from experiments.training.interruption import Interruption


class SignalPeer(Callback):
    def __init__(self, sender: int, step: int):
        self.sender, self.step = sender, step

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pids = [None, None]
        torch.distributed.all_gather_object(pids, os.getpid())  # a collective: every rank
        if trainer.global_rank != self.sender:
            return
        peer = pids[1 - self.sender]
        interruption = next(c for c in trainer.callbacks if isinstance(c, Interruption))
        agree = interruption.agree

        def signal_inside_the_agreement(strategy, pace=None):
            if self.step is not None and trainer.global_step >= self.step:
                self.step = None
                time.sleep(1.0)  # the peer is in the agreement's all-reduce by now, waiting for this rank
                os.kill(peer, signal.SIGTERM)
                time.sleep(0.5)  # its handler has run... once its all-reduce returns
            return agree(strategy, pace)

        interruption.agree = signal_inside_the_agreement
