"""`strategy=dp`: torch.nn.DataParallel as a Lightning 2 strategy (Lightning 2.0 removed its own)."""

import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch.nn import DataParallel


class _ReplicaStep(torch.nn.Module):
    """What each DataParallel replica runs: the module's `training_step` on its share of the batch.

    Replicas run in threads and are thrown away after the step, so `self.log` inside them is captured and
    returned, and the strategy logs each value once: the mean over replicas, weighted by their shares.
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        # Keyword arguments of each captured `log` call; one dict shared by all replicas, since `replicate`
        # copies a module's attributes shallowly.
        self.log_options: dict[str, dict] = {}

    def forward(self, batch, *args, **kwargs):
        module = self.module
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
        module._device = first.device  # a replica's `self.device` is its GPU, not the root device
        logged = {}

        def capture(name: str, value, **options) -> None:
            logged[name] = torch.as_tensor(value, device=first.device).float().reshape(1)
            self.log_options[name] = options

        module.log = capture
        try:
            output = module.training_step(batch, *args, **kwargs)
        finally:
            del module.log
        # Scalars become length-1 vectors so that `gather` stacks them, one entry per replica.
        if isinstance(output, dict):
            output = {**output, "loss": output["loss"].reshape(1)}
        else:
            output = output.reshape(1)
        return output, torch.tensor([len(first)], device=first.device), logged


class DataParallelStrategy(ParallelStrategy):
    """`torch.nn.DataParallel` in one process: each training batch is scattered over `trainer.devices` GPUs,
    the replicas' losses are gathered on the first and averaged, and metrics are logged once.

    Lightning 2.0 removed its own (`strategy="dp"`); this follows the design of Lightning 1.9's
    `DataParallelStrategy`. Validation, test and predict steps run on the first GPU alone: torchmetrics
    states must update in the module itself, not in replicas that are discarded after each step.
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

    def _setup_model(self, model: torch.nn.Module) -> DataParallel:
        return DataParallel(_ReplicaStep(model), device_ids=[d.index for d in self.parallel_devices])

    def training_step(self, *args, **kwargs):
        with self.precision_plugin.train_step_context():
            output, sizes, logged = self.model(*args, **kwargs)
        # Each replica's loss is the mean over its share; weighting by the shares gives the mean over the
        # whole batch even when the batch does not split evenly.
        weights = sizes.to(self.root_device, torch.float32) / sizes.sum()

        def mean(per_replica: torch.Tensor) -> torch.Tensor:
            return (per_replica * weights.to(per_replica.dtype)).sum()

        for name, values in logged.items():
            self.lightning_module.log(name, mean(values), **self.model.module.log_options[name])
        if isinstance(output, dict):
            return {**output, "loss": mean(output["loss"])}
        return mean(output)

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
        if isinstance(self.model, DataParallel):
            self.model = self.lightning_module
        super().teardown()
