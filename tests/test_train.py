import csv
import json
import os
import signal
from collections import Counter

import pytest
import torch
from conftest import compose_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from experiments.commands.train import train
from experiments.data.loader import BatchLoader
from experiments.run.exits import RunFailed
from experiments.run.metrics import NAMES
from experiments.run.signals import Interrupted
from experiments.training.module import Regressor

SCHEMA = set(NAMES)  # every key of metrics.json, from its one definition (experiments.run.metrics)
TAGS = {
    "train/loss", "val/loss", "val/mse", "val/mae", "val/r2",
    "perf/samples_per_sec", "perf/step_time_ms", "perf/transfer_ms", "perf/peak_memory_mb",
}  # fmt: skip

# train/loss of the first 8 steps of `seed=1` on the TINY problem (640 samples x 8 features, batch 64,
# SGD lr 0.05). Recorded from this code; a change that alters the maths (data, order, init, loss,
# optimizer) changes them.
PINNED_LOSSES = [4.030202, 3.839142, 3.281759, 2.498386, 2.749173, 1.504164, 1.070565, 0.864265]


def test_metrics_json_has_every_key(tiny_run):
    metrics, run_dir = tiny_run
    on_disk = json.loads((run_dir / "metrics.json").read_text())
    assert on_disk == pytest.approx(metrics)
    assert on_disk.keys() == SCHEMA
    assert on_disk["status"] == "completed"
    assert on_disk["world_size"] == 1 and on_disk["accelerator"] == "cpu"
    assert on_disk["global_step"] == 2 * (512 // 64)  # 2 epochs of the 512-sample training split
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert not list(run_dir.glob("**/*.tmp"))


def test_tensorboard_has_the_tags_and_the_hparams(tiny_run):
    _, run_dir = tiny_run
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert TAGS <= set(events.Tags()["scalars"])
    assert len(events.Scalars("train/loss")) == 16  # one point per step at log_every_n_steps=1
    hparams = events.PluginTagToContent("hparams")
    assert "_hparams_/experiment" in hparams and "_hparams_/session_start_info" in hparams


def test_fast_dev_run(run_in_process):
    metrics, run_dir = run_in_process("trainer.fast_dev_run=true")
    assert metrics["status"] == "completed" and metrics["global_step"] == 1
    assert json.loads((run_dir / "metrics.json").read_text())["global_step"] == 1


def test_seeded_losses_equal_the_stored_numbers(run_in_process):
    _, run_dir = run_in_process("seed=1", "logger=csv", "trainer.max_steps=8")
    with open(run_dir / "csv" / "metrics.csv") as f:
        losses = [float(row["train/loss"]) for row in csv.DictReader(f) if row["train/loss"]]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(PINNED_LOSSES))


def test_effective_batch_is_what_each_optimizer_step_consumed(run_in_process, monkeypatch):
    # Count what the run really did: the samples its training steps drew, and its optimizer's updates.
    samples, updates = [], []
    next_batch, sgd_step = BatchLoader.next_batch, torch.optim.SGD.step

    def counted_batch(self):
        batch = next_batch(self)
        if self.drop_last:  # a training batch (validation keeps the last, short one)
            samples.append(len(batch[0]))
        return batch

    def counted_step(self, *args, **kwargs):
        updates.append(self)  # kept alive: each optimizer's id stays its own
        return sgd_step(self, *args, **kwargs)

    monkeypatch.setattr(BatchLoader, "next_batch", counted_batch)
    monkeypatch.setattr(torch.optim.SGD, "step", counted_step)
    metrics, _ = run_in_process("trainer.accumulate_grad_batches=4", "logger=none")
    assert sum(samples) == 2 * 512  # two epochs of the 512-sample training split, in whole batches of 64
    assert set(samples) == {metrics["global_batch_size"]} == {64}
    # The run's optimizer; the memory check's probe steps (training.step_memory) update copies of their own.
    assert max(Counter(map(id, updates)).values()) == metrics["global_step"] == 4
    assert metrics["effective_batch_size"] * metrics["global_step"] == sum(samples)


def test_tiny_run_reaches_the_optimum(run_in_process):
    """The acceptance of `python train.py`: within 10% of the exact least-squares validation MSE."""
    metrics, _ = run_in_process("trainer.enable_progress_bar=false", "logger=none", tiny=False)
    assert metrics["status"] == "completed"
    assert metrics["val_mse"] <= 1.10 * metrics["optimal_val_mse"]
    assert metrics["optimum_distance"] < 0.05


@pytest.mark.parametrize(("experiment", "samples"), [("seed_small", 10), ("seed_large", 1000)])
@pytest.mark.slow
def test_seed_experiments_run(run_in_process, experiment, samples):
    metrics, _ = run_in_process(
        f"experiment={experiment}", "logger=none", "trainer.enable_progress_bar=false", tiny=False
    )
    assert metrics["status"] == "completed"
    # The seed's examples: 100 full-batch epochs of all its samples (nothing held out), one update each.
    assert metrics["global_step"] == metrics["epochs"] == 100
    assert metrics["effective_batch_size"] * metrics["global_step"] == 100 * samples


def test_failed_and_interrupted_runs_have_every_key_too(tmp_path, monkeypatch):
    with pytest.raises(RunFailed):
        train(compose_config("optimizer.lr=10000", "logger=none"), tmp_path / "failed")
    calls = []

    def sigterm_at_step_3(self, *args):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Regressor, "on_train_batch_start", sigterm_at_step_3)
    with pytest.raises(Interrupted):
        train(compose_config("logger=none"), tmp_path / "interrupted")
    for status in ("failed", "interrupted"):
        on_disk = json.loads((tmp_path / status / "metrics.json").read_text())
        assert on_disk["status"] == status
        assert on_disk.keys() == SCHEMA, status
    assert json.loads((tmp_path / "interrupted" / "metrics.json").read_text())["step_time_ms"] > 0
