"""Time to target: the first validation within target.mse_ratio of the exact optimum."""

import lightning as L
import pytest
import torch
from conftest import compose_config
from lightning.pytorch.callbacks import Callback

from experiments.config.checks import check_config
from experiments.config.errors import ConfigError
from experiments.data import SyntheticRegression
from experiments.training.module import Regressor
from experiments.training.perf import PerfMonitor
from experiments.training.target import TimeToTarget


def test_a_reachable_target_stops_the_run_there(run_in_process):
    metrics, _ = run_in_process("trainer.max_epochs=30", "optimizer.lr=0.2", "target.mse_ratio=1.5", "target.stop=true")
    assert metrics["status"] == "completed" and metrics["stopped_at_target"] is True
    assert metrics["val_mse"] <= 1.5 * metrics["optimal_val_mse"] == pytest.approx(metrics["target_mse"])
    # Stopped at the epoch that reached it: the run's last.
    assert metrics["epochs"] < 30 and metrics["steps_to_target"] == metrics["global_step"]
    assert metrics["epochs_to_target"] == metrics["global_step"] / 8  # 8 steps an epoch
    assert metrics["samples_to_target"] == 64 * metrics["global_step"]
    assert 0 < metrics["time_to_target_s"] < metrics["wall_time_s"]


def test_an_unreachable_target_is_null_and_the_run_completes(run_in_process):
    metrics, _ = run_in_process("trainer.max_epochs=1", "target.mse_ratio=1.0", "target.stop=true")
    assert metrics["status"] == "completed" and metrics["epochs"] == 1
    assert metrics["time_to_target_s"] is None and metrics["steps_to_target"] is None
    assert metrics["stopped_at_target"] is False


@pytest.mark.parametrize("ratio, shown", [("0.9", "0.9"), ("x", "x"), ("true", "True")])
def test_bad_ratio_is_refused(ratio, shown):
    with pytest.raises(ConfigError, match=rf"target.mse_ratio={shown} is not allowed; allowed: a number >= 1"):
        check_config(compose_config(f"target.mse_ratio={ratio}"))


class SolvedYet(Callback):
    """Whether the data's exact optimum had been solved at each training window's end and each validation's start."""

    def __init__(self):
        self.in_training, self.at_validation = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.in_training.append("optimum" in vars(trainer.datamodule))

    def on_validation_start(self, trainer, pl_module):
        self.at_validation.append("optimum" in vars(trainer.datamodule))


def test_the_optimum_is_solved_in_validation_never_beside_the_training_steps():
    # The solve shares the cores with no step: it runs in the first validation, which the clock leaves out.
    data = SyntheticRegression(num_samples=640, num_features=8, batch_size=64, seed=0)
    data.setup()
    sgd = lambda params: torch.optim.SGD(params, lr=0.05)  # noqa: E731
    module = Regressor(torch.nn.Linear(8, 1), sgd, data.feature_mean, data.feature_std, window_s=0)  # a step a window
    perf, solved = PerfMonitor(64), SolvedYet()
    trainer = L.Trainer(
        max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[solved, TimeToTarget(perf), perf], log_every_n_steps=1,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    assert solved.at_validation == [False, True]  # solved by the end of the first validation
    assert solved.in_training == [False] * 8 + [True] * 8  # 8 steps an epoch, a window each
