"""The LightningModule: it composes a plain model and owns the loss, the optimizer and the metrics."""

import inspect
import time
from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MeanAbsoluteError, MeanSquaredError, MetricCollection, R2Score

from experiments import internals
from experiments.data.loader import BatchLoader
from experiments.distributed import comm
from experiments.training import windows
from experiments.training.clocks import ComputeClock, DeviceStepClock, HostStepClock
from experiments.training.divergence import check_loss
from experiments.training.interruption import Interruption
from experiments.training.log_steps import every_n_steps, is_log_step
from experiments.training.windows import WARMUP_BATCHES, Pace, window_batches


class Regressor(L.LightningModule):
    """MSE regression of any `nn.Module`, trained with the optimizer that `optimizer(params)` builds, its lr
    set by `scheduler(optimizer, ...)` when there is one (conf/scheduler/), stepped after every optimizer step;
    with `compile`, its forward pass in training runs through `torch.compile`; `window_s`: the seconds of steps a
    window of them runs, in whole log intervals (experiments.training.windows; 0: a window ends at every log step).

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
        compile: bool = False,
        window_s: float = 0.1,
    ):
        super().__init__()
        self.net = net
        self.make_optimizer = optimizer
        self.make_scheduler = scheduler
        self.compile = compile  # the top-level `compile`: the training forward pass through torch.compile
        self.window_s = window_s
        self.register_buffer("feature_mean", feature_mean.clone())
        self.register_buffer("feature_std", feature_std.clone())
        self.compute_clock = ComputeClock()  # forward, backward and update, read by PerfMonitor (compute_ms)
        self.forward_net: Callable | None = None  # the net's forward pass in training; strategy=dp sets it
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

    def setup(self, stage: str) -> None:
        if stage == "fit":
            internals.optimize_manually(self)  # a window of steps a training_step: only manual optimization allows it

    def on_train_start(self) -> None:
        trainer = self.trainer
        self._optimizer = trainer.optimizers[0]  # torch's own: Lightning's wrapper costs as much as a small step
        configs = trainer.lr_scheduler_configs
        self._scheduler = configs[0].scheduler if configs else None
        self._scaler = getattr(trainer.precision_plugin, "scaler", None)  # 16-mixed: the gradient scaler
        # One rank alone must not end a window early (the others would wait in their next all-reduce): under
        # several ranks a signal is agreed at a log step's window end (experiments.training.interruption).
        interruption = next((c for c in trainer.callbacks if isinstance(c, Interruption)), None)
        self._interruption = interruption if trainer.world_size == 1 else None
        if self.device.type == "cuda":  # kernels run on streams: events, read once the monitor has synchronised
            self._step_clock = DeviceStepClock(self.compute_clock)
        else:  # DDP on the host clock: the all-reduce's wait is comm_ms, not compute
            self._step_clock = HostStepClock(self.compute_clock, comm.timed(trainer.strategy.model))
        self._sync = trainer.strategy.pre_backward if trainer.world_size > 1 else None  # DDP: all-reduce next backward
        self._check_every = self.device.type == "cpu"  # elsewhere reading the loss waits for the device
        self._fit_batches = 0  # micro-batches of this fit: the first ones run a step a window (windows.py)
        # With several ranks the pace is agreed at a log step's window end, with a signal (interruption.py).
        self.pace = Pace(self.window_s, trainer.log_every_n_steps, agreed=trainer.world_size > 1)
        if self.compile:  # a function, not a module: the state_dict (and so every checkpoint) stays the net's own
            self.forward_net = torch.compile(self.forward_net or self.net.forward)

    def training_step(self, window: BatchLoader, batch_idx: int) -> None:
        """One window (experiments.training.windows) of the seed's loop: for each micro-batch drawn from `window`,
        the forward pass, the MSE and its backward pass (`_backward`), and at the end of each accumulation an
        optimizer step (`_optimizer_step`), in plain PyTorch, as Lightning's automatic optimization would run them.
        The log steps inside the window keep their loss, written at its end (`_log_steps`). With one rank, a signal
        (experiments.training.interruption) ends the window at the next optimizer step; with several, the window
        runs to its end, and the ranks agree at a log step's.

        The step clock (experiments.training.clocks) times each micro-batch from its forward pass to the end of its
        update for compute_ms, less the wait for the gradients' all-reduce under DDP (comm_ms); the loader's clock
        (data_ms) the forming of its batch; what is left of the window is the framework's. The window's own time
        sets the next windows' length (`Pace`).
        """
        trainer, clock = self.trainer, self._step_clock
        began = time.perf_counter()
        at = windows.position(trainer, self._fit_batches < WARMUP_BATCHES, self.pace.intervals)
        batches = window_batches(at)
        done = steps = 0
        lr = None
        logged = []  # (step from 0, loss, lr) of each log step of the window
        try:
            while done < batches:
                x, y = window.next_batch()
                done += 1
                ends_step = (at.batch + done) % at.accumulate == 0 or at.batch + done == at.batches
                clock.start()
                mse = self._backward(x, y, at, ends_step, check=self._check_every or done == batches,
                                     where=(at.step + steps, at.batch + done - 1))  # fmt: skip
                if ends_step:
                    clock.backward_done()
                    lr = self._optimizer_step()
                    steps += 1
                    if every_n_steps(at.step + steps, at.log_every):
                        logged.append((at.step + steps - 1, mse.detach(), lr))
                clock.stop(ends_step)
                del x, y  # one batch alive at a time (experiments.training.batch_fit measures a step with one)
                if ends_step and self._interruption is not None and self._interruption.signum is not None:
                    break
        finally:
            internals.count_window(trainer, done, steps)
            self._fit_batches += done
            clock.end_window()
            self.pace.window_done(time.perf_counter() - began, steps)
            last = trainer.global_step - 1
            # A log step that Lightning's rule adds at the window's end (the step the trainer stops at).
            if steps and ends_step and is_log_step(trainer) and (not logged or logged[-1][0] != last):
                logged.append((last, mse.detach(), lr))
            self._log_steps(logged)  # on the way out of a failed window too: its curve up to there
        self.last_loss = mse.detach()  # metrics.json's train_loss: read once, after the fit

    def _backward(self, x, y, at, ends_step: bool, check: bool, where: tuple[int, int]) -> torch.Tensor:
        """A micro-batch's forward pass, MSE and backward pass: the loss divided by `accumulate_grad_batches`, DDP's
        all-reduce in the backward pass of a step's last micro-batch only; returns the MSE."""
        mse = F.mse_loss((self.forward_net or self.net)(x), y)  # strategy=dp: forward_net scatters over the GPUs
        if check:  # before the backward pass, so a diverged step never reaches the weights or a checkpoint
            check_loss(mse, self.trainer, *where)
        loss = mse / at.accumulate if at.accumulate > 1 else mse
        if ends_step and self._sync:
            self._sync(loss)
        (self._scaler.scale(loss) if self._scaler else loss).backward()
        return mse

    def _optimizer_step(self) -> float | None:
        """The optimizer step of an accumulation's end: gradients clipped as the Trainer says, the gradient scaler's
        step under 16-mixed, the gradients set to None, the scheduler stepped; returns the lr the step used (for
        train/lr) when there is a scheduler."""
        optimizer, scaler, clip = self._optimizer, self._scaler, self.trainer.gradient_clip_val
        if clip:
            if scaler:
                scaler.unscale_(optimizer)
            self.clip_gradients(optimizer, clip, self.trainer.gradient_clip_algorithm)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        if self._scheduler is None:
            return None
        lr = optimizer.param_groups[0]["lr"]
        self._scheduler.step()
        return lr

    def _log_steps(self, logged: list[tuple[int, torch.Tensor, float | None]]) -> None:
        """`train/loss` (and with a scheduler `train/lr`, the lr the step used) of a window's log steps, written
        straight to the loggers at the end of the window, each at the step at which Lightning writes what `self.log`
        collects (the step's index from 0).

        Not `self.log`: Lightning's result collection re-walks its state on every call, about 0.5 ms a log step,
        as much as several steps of a small model; so these are points in the logs, not `callback_metrics` for a
        callback to monitor (val/* are). The losses are read in one go, one wait for the device a window.
        """
        if not logged:
            return
        losses = torch.stack([loss for _, loss, _ in logged]).tolist()
        for (step, _, lr), loss in zip(logged, losses, strict=True):
            values = {"train/loss": loss} if lr is None else {"train/loss": loss, "train/lr": lr}
            for logger in self.trainer.loggers:
                logger.log_metrics(values, step=step)
        for logger in self.trainer.loggers:
            logger.save()  # on disk, as Lightning's logger connector does (training.dashboard.TensorBoardLogger)

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
        # Lightning saves the scheduler's state in every checkpoint and restores it on resume; training_step steps
        # it after each optimizer step (not micro-step) and logs its lr as train/lr.
        scheduler = self.make_scheduler(optimizer, **self._run_length(self.make_scheduler))
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
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
