"""The DataModule shared by every data source: split, standardize, place, batch and shard, and the reference
optimum. Subclasses (synthetic.py, files.py) implement `load()`.
"""

from functools import cached_property

import lightning as L
import torch

from experiments.data.least_squares import least_squares
from experiments.data.loader import BatchLoader, EpochShuffle, StepWindows
from experiments.training.clocks import BatchClock, TransferClock

# data.on_device=auto keeps the data on a GPU when it takes at most this share of the GPU's free memory; the rest
# is left for the model, its gradients and optimizer state, and the batches sliced from the data.
DEVICE_MEMORY_SHARE = 0.5


def keep_on_device(setting: bool | str, device: torch.device, nbytes: int) -> bool:
    """What `data.on_device` (auto, true, false) decides for `nbytes` of data on `device`.

    False on the CPU, whatever the setting: the data is there already.
    """
    if device.type == "cpu":
        return False
    if setting != "auto":
        return setting
    if device.type != "cuda":
        return False
    # Of the memory that is free now, not the GPU's total: another process may be using it.
    free, total = torch.cuda.mem_get_info(device)
    return nbytes <= DEVICE_MEMORY_SHARE * min(free, total)


class RegressionData(L.LightningDataModule):
    """Shared by every data source: split, standardize, batch and shard, and the reference optimum.

    Subclasses implement `load()`, returning all features and targets as float32 tensors.
    """

    def __init__(
        self,
        batch_size: int,
        val_fraction: float,
        seed: int,
        standardize: bool,
        on_device: bool | str,
        pin_memory: bool | str = "auto",
    ):
        super().__init__()  # data.on_device and data.pin_memory: config/checks.py
        self.on_device = on_device
        self.pin_memory = pin_memory
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.standardize = standardize
        self.x_train = self.y_train = self.x_val = self.y_val = None
        # A CSV's column names, which the checkpoint keeps so that predict.py matches columns by name; None
        # for data without names (synthetic, NumPy).
        self.feature_names: list[str] | None = None
        self.target_name: str | None = None
        self.transfer_clock = TransferClock()  # host-to-device copies of batches, read by PerfMonitor
        self.batch_clock = BatchClock()  # forming the training batches, read by PerfMonitor

    def load(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.x_train is not None:  # called again by the Trainer after train.py has looked at the data
            return
        x, y = self.load()
        num_val = round(len(x) * self.val_fraction)
        # The split is fixed by the seed, so every run of a sweep validates on the same samples.
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed))
        train, val = order[num_val:], order[:num_val]
        self.x_train, self.y_train = x[train], y[train]
        # With no held-out share (the seed's examples), the fit is measured on the training split.
        self.x_val, self.y_val = (x[val], y[val]) if num_val else (self.x_train, self.y_train)
        self.feature_mean = torch.zeros(x.shape[1])
        self.feature_std = torch.ones(x.shape[1])
        if self.standardize:
            self.feature_mean = self.x_train.mean(0)
            # A constant column keeps scale 1 rather than dividing by zero.
            std = self.x_train.std(0)
            self.feature_std = torch.where(std > 0, std, torch.ones(()))
            self.x_train = (self.x_train - self.feature_mean) / self.feature_std
            self.x_val = (self.x_val - self.feature_mean) / self.feature_std

    # Solved when first read: at the first validation (experiments.training.target, whose time counts as validation), or
    # after training, for metrics.json. Never beside the training steps: the solve (17 s at d=1000 on two cores)
    # would share their cores.
    @cached_property
    def optimum(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.solve_optimum()

    def solve_optimum(self) -> tuple[torch.Tensor, torch.Tensor]:
        return least_squares(self.x_train, self.y_train)

    @cached_property
    def optimal_val_mse(self) -> float:
        w, b = self.optimum
        return torch.mean((self.x_val.cpu().double() @ w + b - self.y_val.cpu().double()) ** 2).item()

    @property
    def num_features(self) -> int:
        return self.x_train.shape[1]

    @property
    def pins_batches(self) -> bool:
        """Whether batches are gathered into pinned memory: `pin_memory` (auto or true; false: pageable) applies
        to host-resident data copied to a CUDA GPU, the one case where the copy can use it."""
        device = self.trainer.strategy.root_device if self.trainer else torch.device("cpu")
        return self.pin_memory is not False and device.type == "cuda" and self.x_train.device.type == "cpu"

    def _loader(self, x: torch.Tensor, y: torch.Tensor, shuffle: bool, training: bool) -> BatchLoader:
        trainer = self.trainer
        return BatchLoader(
            x,
            y,
            self.batch_size,
            EpochShuffle(len(x), self.seed, shuffle=shuffle),
            rank=trainer.global_rank if trainer else 0,
            world_size=trainer.world_size if trainer else 1,
            drop_last=training,
            # Training batches only: the breakdown leaves validation out. Lightning copies validation batches to
            # the device (`transfer_batch_to_device`); a training window's the loader copies itself.
            clock=self.batch_clock if training else None,
            pin_memory=self.pins_batches,
            accumulate=trainer.accumulate_grad_batches if trainer and training else 1,  # whole optimizer steps
            reuse=training,
            device=trainer.strategy.root_device if trainer and training else None,
            transfer=self.transfer_clock if training else None,
        )

    def _place_on_device(self) -> None:
        """Move the splits to the accelerator once, if `on_device` says so: batches are then sliced there."""
        device = self.trainer.strategy.root_device if self.trainer else torch.device("cpu")
        tensors = {id(t): t for t in (self.x_train, self.y_train, self.x_val, self.y_val)}  # val may be train
        if self.x_train.device == device or not keep_on_device(
            self.on_device, device, sum(t.nbytes for t in tensors.values())
        ):
            return
        moved = {key: t.to(device) for key, t in tensors.items()}
        for name in ("x_train", "y_train", "x_val", "y_val"):
            setattr(self, name, moved[id(getattr(self, name))])

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        # Here rather than in the module: the data decides where it lives (`on_device`), and Lightning warns
        # when a module overrides this hook while a DataModule is in use.
        if isinstance(batch, BatchLoader) or batch[0].device == device:  # a training window copies its own
            return batch  # batches; device-resident data, or the CPU: nothing to copy
        # Lightning copies with non_blocking=True to CUDA (fabric's `move_data_to_device`): from pinned batches
        # the copy is queued and the host goes on; from pageable ones CUDA stages it and the host waits.
        with self.transfer_clock.timing(device):
            return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def train_dataloader(self) -> StepWindows:
        self._place_on_device()
        # trainer.overfit_batches: the same first batches every epoch. Lightning turns shuffling off only in a
        # DataLoader (it warns that it does so for this loader too: here it is done).
        overfit = bool(self.trainer and self.trainer.overfit_batches)
        return StepWindows(self._loader(self.x_train, self.y_train, shuffle=not overfit, training=True))

    def val_dataloader(self) -> BatchLoader:
        self._place_on_device()
        return self._loader(self.x_val, self.y_val, shuffle=False, training=False)
