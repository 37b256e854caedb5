"""A run dir is never overwritten: an unfinished run resumes itself exactly, a completed one is left alone, and a
dir that holds another config's run is refused with nothing changed."""

import csv
import hashlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from background import start, wait_for
from conftest import ROOT, TINY, cli, compose_config, final_weights, logged_tags, python
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from experiments.commands.train import train
from experiments.config.errors import ConfigError
from experiments.run.signals import Interrupted
from experiments.run.state import State, identity, inspect
from experiments.training.module import Regressor

# momentum: optimizer state to restore; window_s=0: a window a step (where the perf/* points fall does not depend
# on the machine's pace, so that the resumed run's can be compared with the uninterrupted run's)
RESUMABLE = ["trainer.max_epochs=3", "optimizer.momentum=0.9", "window_s=0"]


def scalar_steps(run_dir: Path) -> dict[str, list[int]]:
    """Every scalar tag's steps as TensorBoard's own reader shows them (one list per tag, in file order)."""
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    return {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def snapshot(run_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    metrics = train(compose_config(*RESUMABLE), run_dir)
    assert metrics["status"] == "completed"
    return run_dir


def test_an_interrupted_run_started_again_in_its_dir_resumes_exactly(tmp_path, monkeypatch, uninterrupted):
    run_dir = tmp_path / "run"
    calls = []

    def sigterm_at_batch_11(self, *args):  # mid second epoch (8 batches an epoch)
        calls.append(args)
        if len(calls) == 11:
            os.kill(os.getpid(), signal.SIGTERM)

    with monkeypatch.context() as patch:
        patch.setattr(Regressor, "on_train_batch_start", sigterm_at_batch_11)
        with pytest.raises(Interrupted):
            train(compose_config(*RESUMABLE), run_dir)
    assert inspect(run_dir, compose_config(*RESUMABLE)).state is State.UNFINISHED

    metrics = train(compose_config(*RESUMABLE), run_dir)  # no ckpt_path: the dir's own checkpoint
    assert metrics["status"] == "completed" and metrics["global_step"] == 24
    resumed, reference = final_weights(run_dir), final_weights(uninterrupted)
    assert [k for k in reference if not torch.equal(resumed[k], reference[k])] == []
    # Event files of both starts in one dir; TensorBoard shows each step once, exactly those of the uninterrupted run.
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) > 1
    steps, reference_steps = scalar_steps(run_dir), scalar_steps(uninterrupted)
    assert steps.keys() == reference_steps.keys()
    for tag, reference_tag_steps in reference_steps.items():
        if tag.startswith("perf/"):  # timed after a warm-up of 5 steps in each process: a gap, never a repeat
            assert len(set(steps[tag])) == len(steps[tag]) and set(steps[tag]) < set(reference_tag_steps)
        else:
            assert steps[tag] == reference_tag_steps, tag


@pytest.mark.slow
def test_a_completed_run_started_again_does_nothing_and_says_so(tmp_path):
    run_dir = tmp_path / "run"
    args = ("trainer.max_epochs=1", f"hydra.run.dir={run_dir}")
    assert cli(*args).returncode == 0
    before = snapshot(run_dir)
    again = cli(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"nothing to do: {run_dir} holds this config's completed run" in again.stdout
    assert f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'} with a larger trainer.max_epochs" in again.stdout
    assert snapshot(run_dir) == before  # Hydra's rewritten .hydra/ files included

    # Another config in the same dir: one line, exit 2, and still nothing changed. Then a setting that cannot
    # change the result (the progress bar) is the same config.
    other = cli("trainer.max_epochs=2", f"hydra.run.dir={run_dir}")
    assert other.returncode == 2
    error = [line for line in other.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and f"hydra.run.dir={run_dir} holds a run of another config" in error[0]
    assert snapshot(run_dir) == before
    assert cli(*args, "trainer.enable_progress_bar=true").returncode == 0
    assert snapshot(run_dir) == before


@pytest.mark.slow
def test_bad_input_in_a_run_dir_leaves_nothing_behind(tmp_path):
    # Refused by a check, and by a check once the data is read: not even Hydra's .hydra/ and log file are left.
    run_dir = tmp_path / "run"
    assert cli("optimizer.lr=-1", f"hydra.run.dir={run_dir}").returncode == 2
    assert not run_dir.exists()
    assert cli("data=file", f"data.path={tmp_path / 'missing.csv'}", f"hydra.run.dir={run_dir}").returncode == 2
    assert not run_dir.exists()
    # A dir that holds anything else is not the start's own: it is left as Hydra left it.
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine\n")
    assert cli("optimizer.lr=-1", f"hydra.run.dir={tmp_path / 'kept'}").returncode == 2
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == [".hydra", ".lock", "notes.txt"]


def test_a_dir_without_a_recorded_config_is_refused(tmp_path):
    # e.g. a run made before runs recorded their config, or files put there by hand
    (tmp_path / "metrics.json").write_text('{"status": "completed"}')
    with pytest.raises(ConfigError, match="holds a run whose config is unrecorded"):
        train(compose_config(), tmp_path)


def test_same_config_ignores_how_a_run_is_started_not_what_it_trains():
    base = identity(compose_config())
    assert identity(compose_config("ckpt_path=x.ckpt", "trainer.enable_progress_bar=true")) == base
    assert identity(compose_config("optimizer.lr=0.02")) != base
    assert identity(compose_config("trainer.devices=2")) != base


@pytest.mark.slow
def test_a_sweep_stopped_in_its_second_job_and_run_again_completes_every_job(tmp_path):
    sweep = tmp_path / "sweep"
    command = [python(), "train.py", "-m", *TINY, "data.num_samples=1000", "data.batch_size=4"]
    command += ["trainer.max_epochs=3", "optimizer.lr=0.01,0.02,0.03", f"hydra.sweep.dir={sweep}"]
    first = start(command, log=tmp_path / "first.log")
    # The second job is training (not still setting up).
    wait_for(lambda: "train/loss" in logged_tags(sweep / "1"), "job 1's first step", first, timeout=180, every=0.1)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 128 + signal.SIGTERM
    assert json.loads((sweep / "1" / "metrics.json").read_text())["status"] == "interrupted"
    assert not (sweep / "2").exists()
    job0 = snapshot(sweep / "0")

    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert snapshot(sweep / "0") == job0  # the completed job's files, Hydra's .hydra/ included, byte for byte
    rows = list(csv.DictReader((sweep / "results.csv").open()))
    assert [(row["job"], row["status"]) for row in rows] == [("0", "completed"), ("1", "completed"), ("2", "completed")]
    assert "Restoring states from the checkpoint" in again.stderr + again.stdout  # job 1 resumed, not restarted


@pytest.mark.slow
def test_a_finished_run_resumed_under_the_same_budget_is_refused_and_writes_nothing(tmp_path):
    runs = tmp_path / "outputs" / "runs"
    assert cli("trainer.max_epochs=1", "logger=none", f"hydra.run.dir={runs / 'first'}").returncode == 0
    again = cli("trainer.max_epochs=1", "logger=none", "ckpt_path=last", f"hydra.run.dir={runs / 'second'}")
    [line] = [line for line in again.stderr.splitlines() if line.startswith("error:")]
    assert again.returncode == 2 and line.startswith(f"error: ckpt_path={runs / 'first' / 'checkpoints' / 'last.ckpt'}")
    assert "trainer.max_epochs=1 is done, nothing is left to train" in line and "trainer.max_epochs=2" in line, line
    assert not (runs / "second").exists()  # no run dir without a checkpoint
    # The advice works: a larger budget trains on from it, one epoch more.
    on = cli("trainer.max_epochs=2", "logger=none", "ckpt_path=last", f"hydra.run.dir={runs / 'second'}")
    assert on.returncode == 0, on.stderr[-2000:]
    first, second = (json.loads((runs / d / "metrics.json").read_text()) for d in ("first", "second"))
    assert second["global_step"] == 2 * first["global_step"]
    assert (runs / "second" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow
def test_train_log_holds_the_runs_own_lines(tmp_path):
    # stdout is not a terminal here: the epoch lines are printed, and each printed line of the run is in train.log.
    run_dir = tmp_path / "run"
    done = cli("trainer.enable_progress_bar=true", f"hydra.run.dir={run_dir}")
    assert done.returncode == 0, done.stderr[-2000:]
    logged = [line.split("  ", 1)[1] for line in (run_dir / "train.log").read_text().splitlines()]  # after the time
    ours = ("epoch ", "status ", "val_mse ", "run dir ")
    printed = [line for line in done.stdout.splitlines() if line.startswith(ours)]
    assert len(printed) == 2 + 3 and all(line in logged for line in printed), (printed, logged)
    # A run that fails: its error line too, last.
    failed = cli("optimizer.lr=10000", "trainer.max_epochs=10", f"hydra.run.dir={tmp_path / 'failed'}")
    assert failed.returncode == 1
    assert (tmp_path / "failed" / "train.log").read_text().splitlines()[-1].split("  ", 1)[1].startswith(
        "error: training diverged"
    )
