"""Time to quality: how long a run takes to come within `target.mse_ratio` of the exact optimum's validation MSE.

Samples per second is not what "faster training" means to a user; time to a given quality is (the measure of
MLPerf Training and DAWNBench), and this project knows the optimum of every run. The resolution is one
validation: every epoch by default, or `trainer.val_check_interval`.
"""

import lightning as L
from lightning.pytorch.callbacks import Callback

from experiments import internals
from experiments.run.summary import EXACT_FIT
from experiments.training.perf import PerfMonitor


class TimeToTarget(Callback):
    """The first validation with val/mse <= mse_ratio x optimal_val_mse; with `stop`, the run ends there.

    Its training time comes from PerfMonitor's clock (validation left out); steps, samples and epochs count
    the whole run, a resumed one included (its time counts from the resume). The exact optimum is solved at the
    first validation (17 s at d=1000 on two cores), never beside the training steps, whose cores it would share:
    put this callback before PerfMonitor, so that the solve counts as validation.
    """

    def __init__(self, perf: PerfMonitor, mse_ratio: float = 1.02, stop: bool = False):
        self.perf, self.mse_ratio, self.stop = perf, mse_ratio, stop
        self.summary = {
            "target_mse": None,
            "time_to_target_s": None,
            "steps_to_target": None,
            "samples_to_target": None,
            "epochs_to_target": None,
            "stopped_at_target": False,
        }

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        data = trainer.datamodule
        mse = trainer.callback_metrics.get("val/mse")
        if mse is not None and data.optimal_val_mse > EXACT_FIT:  # noise-free data: a ratio to ~0 says nothing
            # The curve of the same quantity, `val/mse_over_optimum` (1: the optimum; the target: mse_ratio).
            for logger in trainer.loggers:
                logger.log_metrics({"val/mse_over_optimum": mse.item() / data.optimal_val_mse}, trainer.global_step)
        if self.summary["steps_to_target"] is not None:
            return
        self.summary["target_mse"] = target = self.mse_ratio * data.optimal_val_mse
        reached = mse is not None and mse.item() <= target
        # Every rank holds the same synced val/mse and optimum; agree all the same, since a stop that one rank
        # alone took would leave the others waiting in their next collective.
        reached = trainer.strategy.reduce_boolean_decision(reached, all=True)
        if not reached:
            return
        micro_steps = internals.micro_batches_completed(trainer)
        self.summary |= {
            "time_to_target_s": self.perf.training_seconds(),
            "steps_to_target": trainer.global_step,
            "samples_to_target": micro_steps * data.batch_size,
            "epochs_to_target": micro_steps / trainer.num_training_batches,
        }
        if self.stop:
            trainer.should_stop = True
            self.summary["stopped_at_target"] = True
