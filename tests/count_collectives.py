"""A callback for a DDP test run from the command line (`+callbacks.count._target_=count_collectives.CountCollectives`,
tests/ on the PYTHONPATH): counts this rank's torch.distributed calls from the start of training, and at each
epoch's start writes the counts so far to `<out>.rank<R>.epoch<E>.json` (test_strategies.py)."""

import json
import os
from collections import Counter

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

CALLS = ("all_reduce", "barrier", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object", "reduce")


class CountCollectives(Callback):
    def __init__(self, out: str):
        self.out = out
        self.counts = Counter()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for name in CALLS:
            setattr(torch.distributed, name, self._counting(name, getattr(torch.distributed, name)))

    def _counting(self, name, call):
        def counted(*args, **kwargs):
            self.counts[name] += 1
            return call(*args, **kwargs)

        return counted

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        path = f"{self.out}.rank{os.environ.get('LOCAL_RANK', '0')}.epoch{trainer.current_epoch}.json"
        with open(path, "w") as file:
            json.dump(self.counts, file)
