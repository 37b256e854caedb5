"""The experiment menu: callbacks, schedulers, optimizers, debug modes and what a run prints (the Optuna search:
test_search.py)."""

import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import termios
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, cli, compose_config, python
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.profilers import SimpleProfiler
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from experiments.commands.entry import CONFIG_DIR
from experiments.commands.train import train
from experiments.config.errors import ConfigError
from experiments.data.loader import BatchLoader
from experiments.run.signals import Interrupted
from experiments.run.summary import summary_lines

MENU = ["callbacks", "scheduler", "optimizer", "debug", "hparams_search"]
STEPS = 8  # optimizer steps per TINY epoch: 512 training samples, batch 64


def lr_points(run_dir: Path) -> list[float]:
    return [point.value for point in EventAccumulator(str(run_dir / "tensorboard")).Reload().Scalars("train/lr")]


def final_lr(run_dir: Path) -> float:
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    return checkpoint["lr_schedulers"][0]["_last_lr"][0]


# ------------------------------------------------------------------------------------------ callbacks


def test_early_stopping_stops_early_and_records_why(run_in_process):
    metrics, run_dir = run_in_process("callbacks=early_stopping", "trainer.max_epochs=500", "logger=none")
    on_disk = json.loads((run_dir / "metrics.json").read_text())
    assert on_disk["status"] == "completed" and on_disk["stop_reason"] == "patience_exhausted"
    assert on_disk["stopped_epoch"] < 100  # well before 500
    assert on_disk["epochs"] == on_disk["stopped_epoch"] + 1 and on_disk["global_step"] == STEPS * on_disk["epochs"]
    assert "did not improve in the last 3 records" in on_disk["stop_message"]
    assert "stopped early at epoch" in summary_lines(on_disk, run_dir)[0]


def test_without_early_stopping_the_stop_keys_are_null(tiny_run):
    metrics, _ = tiny_run
    assert (metrics["stopped_epoch"], metrics["stop_reason"], metrics["stop_message"]) == (None, None, None)


def test_no_lr_monitor_without_a_scheduler(tiny_run):
    _, run_dir = tiny_run
    assert "train/lr" not in EventAccumulator(str(run_dir / "tensorboard")).Reload().Tags()["scalars"]


# ------------------------------------------------------------------------------------ schedulers


# However the run is bounded, cosine reaches eta_min (0) exactly at its last optimizer step.
@pytest.mark.parametrize(
    ("bound", "steps"),
    [
        (["trainer.max_epochs=3"], 3 * STEPS),
        (["trainer.max_epochs=-1", "trainer.max_steps=10"], 10),
        (["trainer.max_epochs=3", "trainer.accumulate_grad_batches=2"], 3 * STEPS // 2),
        (["trainer.max_epochs=3", "trainer.limit_train_batches=5"], 15),
    ],
    ids=["max_epochs", "max_steps", "accumulation", "limit_train_batches"],
)
def test_cosine_falls_to_zero_over_the_run(run_in_process, bound, steps):
    metrics, run_dir = run_in_process("scheduler=cosine", *bound)
    lrs = lr_points(run_dir)  # the lr each step used, a point per micro-step (log_every_n_steps=1)
    assert metrics["global_step"] == steps and len(lrs) >= steps
    assert lrs[0] == pytest.approx(0.05) and all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    assert lrs[-1] < 0.05 * lrs[0]  # the last step runs at lr0 * (1 + cos(pi (n-1)/n)) / 2
    assert abs(final_lr(run_dir)) < 1e-9  # T_max was the run's step count: longer would stop short of 0


def test_step_scheduler_multiplies_the_lr_every_step_size_steps(run_in_process):
    _, run_dir = run_in_process("scheduler=step", "scheduler.step_size=4", "scheduler.gamma=0.5")
    lrs = lr_points(run_dir)
    assert lrs[:4] == pytest.approx([0.05] * 4) and lrs[4:8] == pytest.approx([0.025] * 4)
    assert lrs[-1] == pytest.approx(0.05 * 0.5 ** (len(lrs) // 4 - 1))


def test_onecycle_warms_up_to_the_optimizer_lr_then_anneals(run_in_process):
    _, run_dir = run_in_process("scheduler=onecycle", "trainer.max_epochs=3")
    lrs = lr_points(run_dir)
    peak = lrs.index(max(lrs))
    assert lrs[0] == pytest.approx(0.05 / 25) and max(lrs) == pytest.approx(0.05, rel=0.05)
    assert 0.2 < peak / len(lrs) < 0.4  # pct_start=0.3
    assert lrs[-1] < 1e-3 * 0.05


def test_a_scheduler_on_an_unbounded_run_is_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="max_epochs=-1 with trainer.max_steps=-1"):
        train(compose_config("scheduler=cosine", "trainer.max_epochs=-1"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_an_interrupted_run_with_a_scheduler_resumes_exactly(tmp_path, monkeypatch):
    overrides = ["scheduler=cosine", "trainer.max_epochs=3", "optimizer.momentum=0.9", "logger=none"]
    train(compose_config(*overrides), tmp_path / "uninterrupted")
    calls = []

    draw = BatchLoader.next_batch

    def signal_at_step_11(self, *args):
        calls.extend([args] if self.drop_last else [])  # training batches (validation's keep every row)
        if len(calls) == 11:  # mid-epoch, mid-schedule, mid-window: the run stops once the step is done
            os.kill(os.getpid(), signal.SIGTERM)
        return draw(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(BatchLoader, "next_batch", signal_at_step_11)
        with pytest.raises(Interrupted):
            train(compose_config(*overrides), tmp_path / "interrupted")
    checkpoint = tmp_path / "interrupted" / "checkpoints" / "last.ckpt"
    assert torch.load(checkpoint, weights_only=False)["global_step"] == 11
    train(compose_config(*overrides, f"ckpt_path={checkpoint}"), tmp_path / "resumed")

    a, b = (
        torch.load(tmp_path / d / "checkpoints" / "last.ckpt", weights_only=False) for d in ("resumed", "uninterrupted")
    )
    assert a["global_step"] == b["global_step"] == 3 * STEPS
    for name, tensor in b["state_dict"].items():
        assert torch.equal(a["state_dict"][name], tensor), name
    assert a["lr_schedulers"] == b["lr_schedulers"]  # last_epoch, _last_lr, ... bit for bit
    assert a["optimizer_states"][0]["param_groups"][0]["lr"] == b["optimizer_states"][0]["param_groups"][0]["lr"]


# ------------------------------------------------------------------------------------------ optimizers


def test_adam_trains(run_in_process):
    metrics, run_dir = run_in_process("optimizer=adam", "optimizer.lr=0.05", "trainer.max_epochs=4", "logger=none")
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["optimizer_states"][0]
    assert "exp_avg_sq" in state["state"][0]  # Adam's own state, not SGD's
    assert metrics["val_mse"] < 2 * metrics["optimal_val_mse"]


# ------------------------------------------------------------------------------------------ debug modes


def test_debug_limit_and_overfit_run_the_batches_they_say(run_in_process, tmp_path):
    limit, _ = run_in_process("debug=limit", "logger=none")
    assert (limit["status"], limit["global_step"], limit["epochs"]) == ("completed", 2 * 3, 2)
    # Its own run dir: a dir that holds the limit run refuses another config (experiments.run.state).
    overfit, _ = run_in_process(
        "debug=overfit", "logger=none", "optimizer.lr=0.5", "trainer.max_epochs=50", run_dir=tmp_path / "overfit"
    )
    assert overfit["global_step"] == 50  # one batch an epoch, 50 epochs
    # The same batch every epoch: the loss falls to that one batch's residual, below the noise of fresh data.
    assert overfit["train_loss"] < overfit["optimal_val_mse"]


def test_debug_profiler_writes_into_the_run_dir(tmp_path):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["debug=profiler"], return_hydra_config=True)
    cfg.hydra.runtime.output_dir = str(tmp_path)  # what Hydra sets in a run
    HydraConfig.instance().set_config(cfg)
    try:
        profiler = instantiate(cfg.trainer.profiler)
    finally:
        HydraConfig.instance().cfg = None
    assert isinstance(profiler, SimpleProfiler) and Path(profiler.dirpath) == tmp_path


def run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`python train.py ARGS` from another directory, so that outputs/ lands there, not in the repository."""
    command = [python(), str(ROOT / "train.py"), *TINY, *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


SUMMARY = re.compile(
    r"status      completed\n"
    r"val_mse     [\d.e-]+ = [\d.]+ x the optimum [\d.e-]+\n"
    r"speed       [\d,]+ samples/s, [\d.]+ ms a step, peak memory [\d,]+ MB\n"
    r"run dir     (\S+)\n$"
)


@pytest.fixture(scope="module")
def debug_runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("cwd")
    return cwd, {mode: run_cli(cwd, f"debug={mode}") for mode in ("fdr", "profiler")}


@pytest.mark.parametrize("mode", ["fdr", "profiler"])
def test_cli_debug_runs_land_under_outputs_debug(debug_runs, mode):
    cwd, results = debug_runs
    result = results[mode]
    assert result.returncode == 0, result.stderr[-2000:]
    run_dir = Path(SUMMARY.search(result.stdout)[1])
    assert run_dir.parent == cwd / "outputs" / "debug"
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "completed"
    if mode == "profiler":
        assert "FIT Profiler Report" in (run_dir / "fit-profiler.txt").read_text()
    else:
        assert json.loads((run_dir / "metrics.json").read_text())["global_step"] == 1


@pytest.mark.slow
def test_debug_runs_never_become_ckpt_path_last(debug_runs):
    cwd, _ = debug_runs
    result = run_cli(cwd, "ckpt_path=last")
    assert result.returncode == 2 and "no run in" in result.stderr and "outputs/runs" in result.stderr


# ------------------------------------------------------------------------------------------ run summary


def test_a_run_ends_with_the_summary_block_and_without_lightnings_chatter(debug_runs):
    _, results = debug_runs
    result = results["profiler"]
    assert SUMMARY.search(result.stdout), result.stdout[-1000:]
    printed = result.stdout + result.stderr
    assert printed.count("GPU available: False, used: False") == 1  # which accelerator was used stays, once
    for chatter in ("💡 Tip", "litlogger", "TPU available", "LeafSpec"):
        assert chatter not in printed, chatter


def test_a_failed_run_summary_says_what_is_unmeasured(tmp_path):
    lines = summary_lines({"status": "failed", "val_mse": None, "optimal_val_mse": 0.01}, tmp_path)
    assert lines[0] == "status      failed" and "not measured" in lines[1] and "n/a samples/s" in lines[2]


def test_the_summary_gives_no_ratio_to_an_exact_fit(tmp_path):
    exact = summary_lines({"status": "completed", "val_mse": 2e-6, "optimal_val_mse": 3.6e-30}, tmp_path)[1]
    assert "the optimum fits exactly" in exact and " x the optimum" not in exact
    noisy = summary_lines({"status": "completed", "val_mse": 0.0102, "optimal_val_mse": 0.01}, tmp_path)[1]
    assert "1.0200 x the optimum" in noisy


EPOCH_LINE = re.compile(
    r"^epoch (\d+)/2  step (\d+)  train/loss \S+  val/mse \S+ = \d+\.\d{4} x the optimum  [\d,]+ samples/s$", re.M
)


@pytest.mark.slow
def test_a_log_file_gets_a_line_per_epoch_never_a_redraw(tmp_path):
    # stdout a pipe, as under SLURM, nohup or CI: no bar, no carriage return, no model-summary table.
    done = cli("trainer.enable_progress_bar=true", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert [(m[1], m[2]) for m in EPOCH_LINE.finditer(done.stdout)] == [("1", str(STEPS)), ("2", str(2 * STEPS))]
    printed = done.stdout + done.stderr
    assert "\r" not in printed and "it/s" not in printed
    assert "Total params" not in printed  # Lightning's model summary: only when asked for


@pytest.mark.slow
def test_a_terminal_gets_the_bar_and_the_model_summary_when_asked(tmp_path):
    leader, follower = pty.openpty()  # a terminal for the run's stdout and stderr, 120 columns wide
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    command = [python(), "train.py", *TINY, "trainer.enable_progress_bar=true",
               "trainer.enable_model_summary=true", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    run = subprocess.Popen(command, cwd=ROOT, stdout=follower, stderr=follower)
    os.close(follower)
    printed = b""
    while True:
        try:
            chunk = os.read(leader, 65536)  # read as it comes, so that the run never waits on a full terminal
        except OSError:  # the run ended and closed the terminal
            break
        if not chunk:
            break
        printed += chunk
    assert run.wait(timeout=300) == 0, printed[-2000:]
    text = printed.decode(errors="replace")
    assert "\r" in text and "it/s" in text and not EPOCH_LINE.search(text.replace("\r\n", "\n"))
    assert "Total params" in text
