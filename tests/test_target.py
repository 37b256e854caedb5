"""Time to target: the first validation within target.mse_ratio of the exact optimum."""

import pytest
import torch
from conftest import compose_config

from experiments.config.checks import check_config
from experiments.config.errors import ConfigError


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


def test_the_optimum_solved_in_the_background_equals_the_one_solved_after():
    from experiments.data import SyntheticRegression
    from experiments.data.least_squares import least_squares

    data = SyntheticRegression(num_samples=2000, num_features=20, seed=1)
    data.setup()
    data.solve_optimum_in_background()
    w, b = data.optimum
    w0, b0 = least_squares(data.x_train, data.y_train)
    torch.testing.assert_close((w, b), (w0, b0))
