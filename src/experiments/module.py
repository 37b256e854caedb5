"""The LightningModule: it composes a plain model and owns the loss, the optimizer and the metrics."""

import time
from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MeanAbsoluteError, MeanSquaredError, MetricCollection, R2Score

from experiments.failures import check_loss


class Regressor(L.LightningModule):
    """MSE regression of any `nn.Module`, trained with the optimizer that `optimizer(params)` builds.

    `feature_mean` and `feature_std` are the training split's statistics: the model sees standardized
    inputs, and they travel in the checkpoint so that `predict_raw` works on raw inputs.
    """

    def __init__(
        self,
        net: torch.nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        feature_mean: torch.Tensor,
        feature_std: torch.Tensor,
    ):
        super().__init__()
        self.net = net
        self.make_optimizer = optimizer
        self.register_buffer("feature_mean", feature_mean.clone())
        self.register_buffer("feature_std", feature_std.clone())
        self.val_metrics = MetricCollection(
            {"mse": MeanSquaredError(), "mae": MeanAbsoluteError(), "r2": R2Score()}, prefix="val/"
        )
        self.transfer_seconds = 0.0  # host-to-device copies of batches, read by PerfMonitor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @torch.no_grad()
    def predict_raw(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.feature_mean) / self.feature_std)

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        if batch[0].device == device:  # device-resident data, or the CPU: nothing to copy
            return batch
        start = time.perf_counter()
        # A copy from pageable host memory returns once the data is on the device, so the host clock
        # measures it without a sync.
        batch = super().transfer_batch_to_device(batch, device, dataloader_idx)
        self.transfer_seconds += time.perf_counter() - start
        return batch

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        # A tensor, not `.item()`, and no progress-bar entry: Lightning reads it only at log steps.
        self.log("train/loss", loss)
        # Before the backward pass, so a diverged step never reaches the weights or a checkpoint.
        check_loss(loss, self.trainer, batch_idx)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_metrics.update(self(x), y)

    def on_validation_epoch_end(self) -> None:
        metrics = self.val_metrics.compute()  # torchmetrics sums over all ranks before dividing
        self.val_metrics.reset()
        self.log_dict({**metrics, "val/loss": metrics["val/mse"]}, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.make_optimizer(self.parameters())
