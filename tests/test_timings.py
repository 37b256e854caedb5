"""Tests that compare timings within a run or against the test's own clock: each runs `alone` (no other test beside
it, tests/conftest.py), and this file runs last, so that an `alone` test waiting for the running tests to end keeps no
other test from starting (docs/testing.md#workers). The step breakdown's parts (training.perf): slowing one part
raises that part alone; the start-up and wall time of a run against the user's clock."""

import json
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import cli, with_tests_on_path
from lightning.pytorch.callbacks import Callback

from experiments.data import SyntheticRegression
from experiments.training.module import Regressor


class Sleep(torch.nn.Module):
    """A linear model whose forward also sleeps: compute the breakdown must find."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds, self.linear = seconds, torch.nn.Linear(8, 1)

    def forward(self, x):
        time.sleep(self.seconds)
        return self.linear(x)


class SlowCallback(Callback):
    """Framework time: a callback that sleeps after every window of steps (here a step each: log_every_n_steps=1)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(0.010)


def breakdown(net: torch.nn.Module | None = None, *callbacks: Callback) -> dict:
    """The step breakdown (PerfMonitor's summary) of 3 epochs of 8 steps, a window a step (window_s=0, each step a
    log step: a callback's hook runs every step)."""
    from experiments.training.perf import PerfMonitor

    data = SyntheticRegression(num_samples=640, num_features=8, batch_size=64, seed=0)
    data.setup()
    sgd = lambda params: torch.optim.SGD(params, lr=0.05)  # noqa: E731
    module = Regressor(net or torch.nn.Linear(8, 1), sgd, data.feature_mean, data.feature_std, window_s=0)
    perf = PerfMonitor(global_batch_size=64)
    trainer = L.Trainer(
        max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[perf, *callbacks], limit_val_batches=0, log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    m = perf.summary
    parts = m["data_ms"] + m["transfer_ms"] + m["compute_ms"] + m["comm_ms"] + m["framework_ms"]
    assert parts == pytest.approx(m["step_time_ms"])
    return m


# Each part is measured on its own clock, not derived: slowing one part raises that part alone. The other parts
# of the tiny model take well under a millisecond a step; 2 ms is room for a busy machine.
UNMOVED_MS = 2.0


@pytest.mark.alone
def test_a_slow_forward_raises_compute_ms_alone():
    base, slow = breakdown(), breakdown(Sleep(0.005))
    assert slow["compute_ms"] - base["compute_ms"] >= 5
    assert abs(slow["data_ms"] - base["data_ms"]) < UNMOVED_MS
    assert abs(slow["framework_ms"] - base["framework_ms"]) < UNMOVED_MS


@pytest.mark.alone
def test_a_slow_callback_raises_framework_ms_alone():
    base, slow = breakdown(), breakdown(None, SlowCallback())
    assert slow["framework_ms"] - base["framework_ms"] >= 10
    assert abs(slow["data_ms"] - base["data_ms"]) < UNMOVED_MS
    assert abs(slow["compute_ms"] - base["compute_ms"]) < UNMOVED_MS


@pytest.mark.alone
def test_a_slow_batch_raises_data_ms_alone(monkeypatch):
    base = breakdown()
    gather = torch.index_select  # what forms a training batch (experiments.data.loader)

    def slow_gather(*args, **kwargs):
        time.sleep(0.0025)
        return gather(*args, **kwargs)

    monkeypatch.setattr(torch, "index_select", slow_gather)
    slow = breakdown()
    assert slow["data_ms"] - base["data_ms"] >= 5  # two gathers a batch: its x and its y
    assert abs(slow["compute_ms"] - base["compute_ms"]) < UNMOVED_MS
    assert abs(slow["framework_ms"] - base["framework_ms"]) < UNMOVED_MS


def ddp_breakdown(run_dir: Path, seconds: float) -> dict:
    """Rank 0's step breakdown of a DDP x2 run from the command line whose rank 1 sleeps `seconds` a forward pass."""
    model = ["model._target_=slow_rank.SlowOnRankOne", f"+model.seconds={seconds}"]
    args = ["trainer.devices=2", "data.num_samples=2560", "trainer.log_every_n_steps=8", "logger=none", *model]
    done = cli(*args, f"hydra.run.dir={run_dir}", env=with_tests_on_path())
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.alone
@pytest.mark.slow
def test_a_slow_rank_raises_the_other_ranks_comm_ms_not_its_compute(tmp_path):
    # Rank 0 computes as fast as ever, then waits in each all-reduce for rank 1, 5 ms slower a step: its comm_ms
    # (experiments.distributed.comm) takes the wait, its compute_ms does not.
    base, slow = ddp_breakdown(tmp_path / "base", 0.0), ddp_breakdown(tmp_path / "slow", 0.005)
    assert base["comm_ms"] > 0 and base["compute_ms"] > 0
    assert slow["comm_ms"] - base["comm_ms"] >= 4
    assert abs(slow["compute_ms"] - base["compute_ms"]) < UNMOVED_MS
    assert abs(slow["framework_ms"] - base["framework_ms"]) < UNMOVED_MS
    parts = slow["data_ms"] + slow["transfer_ms"] + slow["compute_ms"] + slow["comm_ms"] + slow["framework_ms"]
    assert parts == pytest.approx(slow["step_time_ms"])


@pytest.mark.alone
def test_a_slow_save_of_last_ckpt_is_checkpoint_save_ms_not_a_steps_time(run_in_process, tmp_path, monkeypatch):
    # 4 epochs of 8 steps, last.ckpt at each epoch's end: 50 ms more a save would be 6 ms more a step if the step
    # clock counted saves (it leaves them out, as it leaves out validation: experiments.training.perf).
    from experiments.run.files import AtomicCheckpointIO

    base, _ = run_in_process("trainer.max_epochs=4", "logger=none", run_dir=tmp_path / "base")
    save = AtomicCheckpointIO.save_checkpoint

    def slow_save(self, *args, **kwargs):
        time.sleep(0.050)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", slow_save)
    slow, _ = run_in_process("trainer.max_epochs=4", "logger=none", run_dir=tmp_path / "slow")
    assert slow["checkpoints_saved"] == base["checkpoints_saved"] == 4
    assert slow["checkpoint_save_ms"] - base["checkpoint_save_ms"] >= 40  # the sleep, less a busy base
    assert abs(slow["step_time_ms"] - base["step_time_ms"]) < UNMOVED_MS
    assert abs(slow["framework_ms"] - base["framework_ms"]) < UNMOVED_MS


@pytest.mark.alone  # the test's clock against the run's: a busy neighbour would delay the start or the exit
def test_startup_and_wall_time_match_the_users_clock(tmp_path):
    started = time.time()
    result = cli("logger=none", f"hydra.run.dir={tmp_path}", timeout=120, interpreter=sys.executable)  # its start
    waited = time.time() - started
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    # The process starts after `started` and ends before `waited` is read; after metrics.json is written
    # only the interpreter's exit remains.
    assert waited - 3.0 < metrics["wall_time_s"] <= waited
    assert 0 < metrics["startup_s"] < metrics["wall_time_s"]
    assert metrics["startup_s"] > 1.0  # the imports of torch and Lightning count: the user waited for them
