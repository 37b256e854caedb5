"""`strategy=dp`: torch.nn.DataParallel as a Lightning 2 strategy (Lightning 2.0 removed its own)."""

import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch.nn import DataParallel


class DataParallelStrategy(ParallelStrategy):
    """`torch.nn.DataParallel` in one process: the forward pass of each training batch is scattered over
    `trainer.devices` GPUs and the outputs gathered on the first, where the loss is taken over the whole batch.

    Lightning 2.0 removed its own (`strategy="dp"`). Lightning 1.9's ran each replica's `training_step` on its
    share; here the module's `training_step` runs a window of optimizer steps (experiments.training.windows), so it runs
    once, on the first GPU, and only its net's forward pass is data-parallel (a DataParallel of the net, which
    replicates it on every call; without CUDA it calls the net itself). Validation, test and predict steps run
    on the first GPU alone: torchmetrics states must update in the module itself.
    """

    strategy_name = "dp"

    # One process: there are no ranks to tell apart.
    global_rank = property(lambda self: 0)
    local_rank = property(lambda self: 0)
    node_rank = property(lambda self: 0)
    world_size = property(lambda self: 1)

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[0]

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        # The wrapper's call, not the wrapper: a Module attribute would become part of the module's state_dict.
        model.forward_net = DataParallel(model.net, device_ids=[d.index for d in self.parallel_devices]).__call__
        return model

    def training_step(self, *args, **kwargs):
        with self.precision_plugin.train_step_context():
            return self.lightning_module.training_step(*args, **kwargs)

    def validation_step(self, *args, **kwargs):
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    def test_step(self, *args, **kwargs):
        with self.precision_plugin.test_step_context():
            return self.lightning_module.test_step(*args, **kwargs)

    def predict_step(self, *args, **kwargs):
        with self.precision_plugin.predict_step_context():
            return self.lightning_module.predict_step(*args, **kwargs)

    # Collectives of a single process: the values are already complete.
    def reduce(self, tensor, group=None, reduce_op="mean"):
        return tensor

    def all_gather(self, tensor, group=None, sync_grads=False):
        return tensor

    def broadcast(self, obj, src=0):
        return obj

    def barrier(self, name=None) -> None:
        pass

    def teardown(self) -> None:
        if self.lightning_module is not None:
            self.lightning_module.forward_net = None
        super().teardown()
