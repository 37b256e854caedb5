"""Faults inside training: a loss that diverges stops the run at its step with a hint (in process, through the CLI,
in a sweep where only that job fails); weights that diverged between loss checks never reach a checkpoint; running
out of device memory suggests a smaller batch; and the same seed gives the same weights bit for bit, which every
exact resume rests on (docs/failures.md)."""

import json
import subprocess

import pytest
import torch
from conftest import ROOT, TINY, cli, compose_config, python
from faults import errors, final_state, saved
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from experiments.commands.train import train
from experiments.run.exits import RunFailed
from experiments.training import module
from experiments.training.module import Regressor

# ------------------------------------------------------------------------------------ divergence, memory


def test_divergence_stops_at_the_step_with_a_hint(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(RunFailed, match=r"diverged.*at step \d+.*lower optimizer\.lr") as err:
        train(compose_config("optimizer.lr=10000", "trainer.max_epochs=10"), run_dir)
    step = int(str(err.value).split("at step ")[1].split()[0])
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "failed"
    # TensorBoard was flushed: every step before the diverged one is on disk, one train/loss point each.
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert len(events.Scalars("train/loss")) == step
    assert step < 10 * 8  # it stopped early, not at the end of training


@pytest.mark.slow
def test_cli_divergence_exits_1_with_the_message(tmp_path):
    result = cli("optimizer.lr=10000", "trainer.max_epochs=10", f"hydra.run.dir={tmp_path / 'run'}", timeout=60)
    assert result.returncode == 1
    assert "error: training diverged" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_in_a_sweep_only_the_diverged_job_fails(tmp_path):
    command = [python(), "train.py", "-m", *TINY, "optimizer.lr=0.05,10000", f"hydra.sweep.dir={tmp_path}"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "diverged" in result.stderr
    status = [json.loads((tmp_path / job / "metrics.json").read_text())["status"] for job in ("0", "1")]
    assert status == ["completed", "failed"]


def test_out_of_memory_suggests_a_smaller_batch(tmp_path, monkeypatch):
    def out_of_memory(self, batch, batch_idx):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Regressor, "training_step", out_of_memory)
    with pytest.raises(RunFailed, match=r"data\.batch_size=32 trainer\.accumulate_grad_batches=2") as err:
        train(compose_config(), tmp_path / "run")
    assert "out of device memory with data.batch_size=64" in str(err.value)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["status"] == "failed"


@pytest.mark.cuda
def test_real_gpu_out_of_memory_suggests_a_smaller_batch(tmp_path, monkeypatch):
    def allocate_too_much(self, batch, batch_idx):
        return torch.empty(2**50, device=self.device).sum()  # 4 PiB

    monkeypatch.setattr(Regressor, "training_step", allocate_too_much)
    with pytest.raises(RunFailed, match=r"out of device memory.*smaller data\.batch_size") as err:
        train(compose_config("trainer.accelerator=gpu"), tmp_path / "run")
    assert "or let the lab choose with batch.effective=64: measured now, it would train" in str(err.value)


# ------------------------------------------------------------------------------------ a diverged checkpoint


def test_weights_that_diverged_between_loss_checks_never_reach_a_checkpoint(tmp_path, monkeypatch):
    """On a GPU the loss is read once a window, before the window's last backward pass, so the steps of a window
    can make the weights non-finite unseen. Here the CPU run checks no loss at all, so that only the check before
    each save stands between diverged weights and last.ckpt. At lr=1.5 the error grows at every step (x ~ N(0, 1):
    the loss's curvature is 2) and the weights pass float32's range within a few epochs of 8 steps, after some
    finite checkpoints."""
    monkeypatch.setattr(module, "check_loss", lambda loss, trainer, step, batch_idx: None)
    cfg = compose_config("optimizer.lr=1.5", "trainer.max_epochs=40", "trainer.log_every_n_steps=100000", "logger=none")
    with pytest.raises(RunFailed, match=r"training diverged: .* found before saving a checkpoint, which was not saved"):
        train(cfg, tmp_path / "run")
    last = saved(tmp_path / "run")
    assert 0 < last["epoch"] < 39 and all(torch.isfinite(t).all() for t in last["state_dict"].values())
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["status"] == "failed"


@pytest.mark.cuda
def test_on_a_gpu_weights_that_diverged_between_log_steps_never_reach_a_checkpoint(tmp_path):
    args = ["trainer.accelerator=gpu", "optimizer.lr=1.5", "trainer.max_epochs=40", "trainer.log_every_n_steps=100000"]
    done = cli(*args, f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 1
    assert "found before saving a checkpoint, which was not saved" in errors(done.stderr)[0]
    last = saved(tmp_path / "run")
    assert all(torch.isfinite(t).all() for t in last["state_dict"].values())


# ------------------------------------------------------------------------------------------ determinism


def test_same_seed_same_weights_bit_for_bit(tmp_path):
    weights = {}
    for name, seed in [("a", 3), ("b", 3), ("c", 4)]:
        train(compose_config(f"seed={seed}", "logger=none"), tmp_path / name)
        weights[name] = final_state(tmp_path / name)["weights"]
    assert all(torch.equal(weights["a"][k], weights["b"][k]) for k in weights["a"])
    assert not torch.equal(weights["a"]["net.weight"], weights["c"]["net.weight"])  # the seed matters
