"""The LightningModule: it composes a plain model and owns the loss, the optimizer and the metrics."""

import inspect
from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MeanAbsoluteError, MeanSquaredError, MetricCollection, R2Score

from experiments import internals
from experiments.divergence import check_loss
from experiments.log_steps import is_log_step
from experiments.perf import ComputeClock


class Regressor(L.LightningModule):
    """MSE regression of any `nn.Module`, trained with the optimizer that `optimizer(params)` builds, its lr
    set by `scheduler(optimizer, ...)` when there is one (conf/scheduler/), stepped after every optimizer step.

    `feature_mean` and `feature_std` are the training split's statistics: the model sees standardized
    inputs, and they travel in the checkpoint so that `predict_raw` works on raw inputs. A module that only
    scores or predicts (eval.py, predict.py) has no optimizer (None).
    """

    def __init__(
        self,
        net: torch.nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer] | None,
        feature_mean: torch.Tensor,
        feature_std: torch.Tensor,
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None,
    ):
        super().__init__()
        self.net = net
        self.make_optimizer = optimizer
        self.make_scheduler = scheduler
        self.register_buffer("feature_mean", feature_mean.clone())
        self.register_buffer("feature_std", feature_std.clone())
        self.compute_clock = ComputeClock()  # forward, backward and update, read by PerfMonitor (compute_ms)
        self.val_metrics = MetricCollection(
            {"mse": MeanSquaredError(), "mae": MeanAbsoluteError(), "r2": R2Score()}, prefix="val/"
        )

    def __setattr__(self, name: str, value) -> None:
        # Lightning sets `_current_fx_name` before and after every hook call, about 45 times a step, and
        # torch's Module.__setattr__ checks parameters, buffers and submodules each time (about 1 us): a
        # string needs none of that. Lightning's own `_ResultMetric` skips the checks the same way.
        if name == internals.HOOK_NAME_ATTRIBUTE:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @torch.no_grad()
    def predict_raw(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.feature_mean) / self.feature_std)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.predict_raw(batch[0])  # predict.py feeds raw inputs (its batches carry no targets)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.compute_clock.start(micro_step=True)
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.compute_clock.stop()
        self.last_loss = loss.detach()  # metrics.json's train_loss: read once, after the fit
        # `self.log` costs more than a step of a small model (its result collection re-walks its state on
        # every call), so it is called only on the steps that the logger writes (experiments.log_steps). A
        # tensor, not `.item()`, and no progress-bar entry: nothing here waits for the device.
        if is_log_step(self.trainer):
            self.log("train/loss", loss)
        # Before the backward pass, so a diverged step never reaches the weights or a checkpoint.
        check_loss(loss, self.trainer, batch_idx)
        return loss

    # The compute clock's other two brackets: the backward pass, and the optimizer's update, which runs after
    # the closure (forward and backward) inside `optimizer.step`, from `on_before_optimizer_step` on.
    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        self.compute_clock.start()
        super().backward(loss, *args, **kwargs)
        self.compute_clock.stop()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.compute_clock.start()

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        self.compute_clock.stop(step_done=True)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_metrics.update(self(x), y)

    def on_validation_epoch_end(self) -> None:
        metrics = self.val_metrics.compute()  # torchmetrics sums over all ranks before dividing
        self.val_metrics.reset()
        self.log_dict({**metrics, "val/loss": metrics["val/mse"]}, sync_dist=True)

    def configure_optimizers(self):
        optimizer = self.make_optimizer(self.parameters())
        if self.make_scheduler is None:
            return optimizer
        # Lightning saves the scheduler's state in every checkpoint and restores it on resume; "step" steps it
        # after each optimizer step (not micro-step); the name is LearningRateMonitor's tag.
        scheduler = self.make_scheduler(optimizer, **self._run_length(self.make_scheduler))
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "train/lr"},
        }

    def _run_length(self, make_scheduler) -> dict[str, int]:
        """The run's optimizer steps for the arguments that a schedule over the whole run needs (cosine's T_max,
        one-cycle's total_steps), unless the config sets them. Only the trainer knows the number: it counts
        max_epochs or max_steps, limit_train_batches, accumulation and the devices."""
        wanted = {"T_max", "total_steps"} & inspect.signature(make_scheduler).parameters.keys()
        wanted -= getattr(make_scheduler, "keywords", {}).keys()
        if not wanted:
            return {}
        # Finite: checks.check_config refuses a scheduler on a run bounded by neither max_epochs nor max_steps.
        steps = int(self.trainer.estimated_stepping_batches)
        # Counting the steps builds the training loader before a resumed run's checkpoint is restored: drop it,
        # so that the loop builds it again and hands it the saved mid-epoch position.
        internals.rebuild_train_loader(self.trainer)
        return dict.fromkeys(wanted, steps)
