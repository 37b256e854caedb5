"""Faults of a run's processes: a signal anywhere (SIGTERM, SIGINT) stops a run that resumes exactly, bit for bit as
one never interrupted; a hard kill (SIGKILL) loses at most what its last checkpoint had not saved; a second run in
a busy dir (a run's, a DDP run's, a sweep's, a requeued SLURM job's) is refused or waits (docs/failures.md). The
faults of DDP ranks: test_faults_ranks.py."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from background import start, start_train, wait_for
from conftest import ROOT, TINY, cli, compose_config, logged_tags, python
from faults import (
    ENDLESS,
    MANY_EPOCHS,
    MANY_STEPS,
    RESUMABLE,
    assert_bit_identical,
    errors,
    final_state,
    last_step,
    loss_steps,
    saved,
    start_long,
    starts,
    weights,
)

from experiments.commands.train import train
from experiments.data.loader import BatchLoader
from experiments.run.signals import Interrupted
from experiments.training.module import Regressor

# ------------------------------------------------------------------------------ interruption and resume


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final state of a run that was never interrupted, for each list of extra overrides."""
    states = {}

    def run(*overrides: str) -> dict:
        if overrides not in states:
            run_dir = tmp_path_factory.mktemp("uninterrupted")
            train(compose_config(*RESUMABLE, *overrides), run_dir)
            states[overrides] = final_state(run_dir)
        return states[overrides]

    return run


# (class and method that send the signal, at its n-th call, extra overrides, (global_step, epoch) where the run
# stops). 8 training batches per epoch; the run stops at the end of the optimizer step that the signal falls in.
# Lightning's per-batch hooks run once a window (experiments.training.windows): a step a window when every step is a log
# step (TINY), several otherwise; a window draws its micro-batches with `BatchLoader.next_batch`.
INTERRUPTIONS = {
    "mid-epoch": (Regressor, "on_train_batch_start", 5, (), (5, 0)),
    "first batch": (Regressor, "on_train_batch_start", 1, (), (1, 0)),
    "last batch of an epoch": (Regressor, "on_train_batch_start", 16, (), (16, 1)),
    "during validation": (Regressor, "on_validation_batch_start", 1, (), (9, 1)),  # after epoch 0: at the next step
    # the 4th micro-step is in the 2nd window of 3: the run stops after micro-step 6, at optimizer step 2
    "mid accumulation": (BatchLoader, "next_batch", 4, ("trainer.accumulate_grad_batches=3",), (2, 0)),
    # log steps 4, 8, ...: after the 5 warm-up steps (a window each), steps 6 to 8 are one window
    "mid-window": (BatchLoader, "next_batch", 7, ("trainer.log_every_n_steps=4",), (7, 0)),
}


# SIGINT takes the same path as SIGTERM: one point is enough for it.
@pytest.mark.parametrize(
    ("point", "signum"),
    [
        *(pytest.param(p, signal.SIGTERM, id=f"{p}-SIGTERM") for p in INTERRUPTIONS),
        pytest.param("mid-epoch", signal.SIGINT, id="mid-epoch-SIGINT"),
    ],
)
def test_interrupted_anywhere_then_resumed_equals_uninterrupted(tmp_path, monkeypatch, uninterrupted, point, signum):
    cls, hook, at_call, overrides, (step, epoch) = INTERRUPTIONS[point]
    calls = []
    original = getattr(cls, hook)

    def send_signal(self, *args):
        calls.append(args)
        if len(calls) == at_call:
            os.kill(os.getpid(), signum)
        return original(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(cls, hook, send_signal)
        with pytest.raises(Interrupted) as stop:
            train(compose_config(*RESUMABLE, *overrides), tmp_path / "interrupted")
    assert stop.value.exit_code == 128 + signum
    metrics = json.loads((tmp_path / "interrupted" / "metrics.json").read_text())
    assert (metrics["status"], metrics["global_step"], metrics["epochs"]) == ("interrupted", step, epoch)
    assert (final_state(tmp_path / "interrupted")["global_step"], final_state(tmp_path / "interrupted")["epoch"]) == (
        step,
        epoch,
    )

    checkpoint = tmp_path / "interrupted" / "checkpoints" / "last.ckpt"
    train(compose_config(*RESUMABLE, *overrides, f"ckpt_path={checkpoint}"), tmp_path / "resumed")
    assert_bit_identical(final_state(tmp_path / "resumed"), uninterrupted(*overrides))


@pytest.mark.parametrize(
    ("signum", "resume_with"),
    [pytest.param(signal.SIGTERM, "file", id="SIGTERM-file"), pytest.param(signal.SIGINT, "last", id="SIGINT-last")],
)
@pytest.mark.slow
def test_cli_signal_mid_epoch_then_resume_is_exact(tmp_path, uninterrupted, signum, resume_with):
    runs = tmp_path / "runs"
    runs.mkdir()
    process = start_long(runs / "interrupted")
    try:
        wait_for(lambda: last_step(runs / "interrupted") >= 100, "step 100", process, timeout=120)
        process.send_signal(signum)
        code = process.wait(timeout=60)
    finally:
        process.kill()
    log = (runs / "interrupted.log").read_text()
    assert code == 128 + signum, log[-2000:]
    assert f"interrupted by {signal.Signals(signum).name}; resume with ckpt_path=" in log
    metrics = json.loads((runs / "interrupted" / "metrics.json").read_text())
    assert metrics["status"] == "interrupted" and metrics["epochs"] == 0  # mid-epoch: 200 steps an epoch
    assert 100 <= metrics["global_step"] < 200

    ckpt = runs / "interrupted" / "checkpoints" / "last.ckpt" if resume_with == "file" else "last"
    resumed = start_long(runs / "resumed", f"ckpt_path={ckpt}")
    assert resumed.wait(timeout=120) == 0, resumed.output()
    # The CLI runs the same `train` as a test does in process: its uninterrupted result is the reference.
    assert_bit_identical(final_state(runs / "resumed"), uninterrupted(*MANY_STEPS))


# ------------------------------------------------------------------------------------- a hard kill (SIGKILL)


@pytest.mark.slow
def test_a_run_killed_with_sigkill_resumes_from_its_last_epoch_bit_for_bit(tmp_path):
    reference = tmp_path / "reference"
    assert cli(*MANY_EPOCHS, f"hydra.run.dir={reference}").returncode == 0

    run_dir = tmp_path / "run"
    killed = start_train(*MANY_EPOCHS, f"hydra.run.dir={run_dir}", log=tmp_path / "killed.log",
                         interpreter=sys.executable)  # fmt: skip
    # Two epochs saved, by default.
    wait_for(lambda: (saved(run_dir) or {}).get("epoch", -1) >= 1, "epoch 1's checkpoint", killed)
    killed.kill()
    killed.wait()
    assert not (run_dir / "metrics.json").exists()  # killed mid-run: no record but the checkpoint
    at = saved(run_dir)
    assert at["loops"] and at["epoch"] >= 1

    # A write cut short by SIGKILL (here: of last.ckpt itself) leaves its temporary file, and last.ckpt whole.
    # (The kill above may have cut a save of its own: its temporary file is there already, and goes the same way.)
    def strays() -> set[Path]:
        return {p for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")}

    before = strays()
    cut = "import os, sys\nfrom experiments.run.files import replacing\nwith replacing(sys.argv[1]) as tmp:\n"
    cut += "    tmp.write_bytes(b'half a checkpoint')\n    os.kill(os.getpid(), 9)\n"
    subprocess.run([sys.executable, "-c", cut, str(run_dir / "checkpoints" / "last.ckpt")], cwd=ROOT)
    [stray] = strays() - before
    assert saved(run_dir)["global_step"] == at["global_step"]

    again = cli(*MANY_EPOCHS, f"hydra.run.dir={run_dir}")  # the same command
    assert again.returncode == 0, again.stderr[-3000:]
    assert not stray.exists() and strays() == set()  # removed at the start, under the dir's lock
    assert "note: resuming" not in again.stderr  # the same code: nothing to say
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "completed"
    resumed, uninterrupted = weights(run_dir), weights(reference)
    assert [k for k in uninterrupted if not torch.equal(resumed[k], uninterrupted[k])] == []
    assert [s["resumed_from"] for s in starts(run_dir)][1]["global_step"] == at["global_step"]
    # The steps the killed run logged after its checkpoint are there once: TensorBoard shows the reference's.
    assert loss_steps(run_dir) == loss_steps(reference)


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_starts_over_with_one_curve(tmp_path):
    args = ["data.num_samples=20000", "trainer.max_epochs=1"]  # 250 steps before the first save
    reference = tmp_path / "reference"
    assert cli(*args, f"hydra.run.dir={reference}").returncode == 0
    run_dir = tmp_path / "run"
    killed = start_train(*args, f"hydra.run.dir={run_dir}", log=tmp_path / "killed.log", interpreter=sys.executable)
    wait_for(lambda: "train/loss" in logged_tags(run_dir), "a logged step", killed)
    killed.kill()
    killed.wait()
    assert saved(run_dir) is None
    again = cli(*args, f"hydra.run.dir={run_dir}")
    assert again.returncode == 0, again.stderr[-3000:]
    events = [list((d / "tensorboard").glob("events.out.tfevents.*")) for d in (run_dir, reference)]
    assert len(events[0]) > len(events[1])  # the killed start's file is there too
    assert loss_steps(run_dir) == loss_steps(reference)  # the killed start's steps dropped: each step once
    resumed, uninterrupted = weights(run_dir), weights(reference)
    assert [k for k in uninterrupted if not torch.equal(resumed[k], uninterrupted[k])] == []


@pytest.mark.slow
def test_last_ckpt_is_written_every_epoch_and_every_n_steps_when_asked(tmp_path):
    # TINY: 2 epochs of 8 steps. Default: each epoch's end. every_n_train_steps=3: steps 3, 6, ..., 15 too.
    by_epoch = cli(f"hydra.run.dir={tmp_path / 'epochs'}")
    by_steps = cli("checkpoint.every_n_train_steps=3", "checkpoint.every_n_epochs=0", f"hydra.run.dir={tmp_path / 's'}")
    assert by_epoch.returncode == 0 and by_steps.returncode == 0, by_steps.stderr[-2000:]
    epochs, steps = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("epochs", "s"))
    assert epochs["checkpoints_saved"] == 2 and epochs["checkpoint_save_ms"] > 0
    assert steps["checkpoints_saved"] == 5  # 3, 6, 9, 12, 15; step 16, the end, is the final save
    assert saved(tmp_path / "s")["global_step"] == 16


# ------------------------------------------------------------------------------------ two runs in one dir


@pytest.mark.slow
def test_a_second_run_in_a_busy_dir_is_refused_naming_the_holder_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    holder = start_train(*ENDLESS, f"hydra.run.dir={run_dir}", log=tmp_path / "holder.log", interpreter=sys.executable)
    try:
        wait_for(lambda: saved(run_dir) is not None, "the holder's first checkpoint", holder)
        hydra_files = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
        event_files = sorted((run_dir / "tensorboard").iterdir())

        second = cli(*ENDLESS, "optimizer.lr=0.01", f"hydra.run.dir={run_dir}")
        assert second.returncode == 2
        [error] = errors(second.stderr)
        assert f"hydra.run.dir={run_dir.resolve()} is in use by another run: pid {holder.pid} on " in error
        assert f"on {socket.gethostname()} since " in error and "Traceback" not in second.stderr
        assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == hydra_files  # its overrides: not
        assert sorted((run_dir / "tensorboard").iterdir()) == event_files

        # eval.py reads a running run's checkpoint (it writes into a dir of its own).
        command = [python(), "eval.py", f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"]
        evaluation = subprocess.run([*command, f"hydra.run.dir={tmp_path / 'eval'}"], cwd=ROOT, capture_output=True)
        assert evaluation.returncode == 0, evaluation.stderr[-2000:]
    finally:
        holder.kill()
        holder.wait()

    # The lock died with its holder: the same command resumes at once.
    resumed = start_train(*ENDLESS, f"hydra.run.dir={run_dir}", log=tmp_path / "resumed.log")
    wait_for(lambda: len(starts(run_dir)) == 2, "the second start in provenance.json", resumed)
    resumed.send_signal(signal.SIGTERM)
    assert resumed.wait(timeout=300) == 128 + signal.SIGTERM
    assert starts(run_dir)[1]["resumed_from"]["global_step"] > 0


@pytest.mark.slow
def test_a_ddp_run_holds_its_dir_from_rank_0(tmp_path):
    run_dir = tmp_path / "run"
    holder = start_train(*ENDLESS, "trainer.devices=2", f"hydra.run.dir={run_dir}", log=tmp_path / "holder.log",
                         interpreter=sys.executable)  # fmt: skip
    try:
        wait_for(lambda: saved(run_dir) is not None, "the holder's first checkpoint", holder)
        second = cli(*ENDLESS, "trainer.devices=2", f"hydra.run.dir={run_dir}")
        assert second.returncode == 2
        assert f"pid {holder.pid} on " in errors(second.stderr)[0]
    finally:
        holder.send_signal(signal.SIGTERM)  # the ranks stop together and save
        holder.wait(timeout=300)
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "interrupted"


@pytest.mark.slow
def test_a_second_sweep_in_a_busy_sweep_dir_is_refused_and_writes_nothing(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["train.py", "-m", *TINY, *ENDLESS, "optimizer.lr=0.01,0.02", f"hydra.sweep.dir={sweep}"]
    first = start([sys.executable, *args], log=tmp_path / "first.log")  # its pid is named
    try:
        wait_for(lambda: saved(sweep / "0") is not None, "job 0's first checkpoint", first)
        # Every file but those the first sweep rewrites as it trains (its curves and checkpoints).
        moving = {"tensorboard", "checkpoints"}
        files = {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file() and not moving & set(p.parts)}
        second = subprocess.run([python(), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2
        [error] = errors(second.stderr)
        assert f"hydra.sweep.dir={sweep.resolve()} is in use by another run: pid {first.pid}" in error
        assert {p: p.read_bytes() for p in files} == files
        assert not (sweep / "1").exists()
    finally:
        first.kill()
        first.wait()


@pytest.mark.slow
def test_a_requeued_slurm_job_waits_for_its_previous_start_and_another_job_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    hold = "import sys, time\nfrom experiments.run import lock\nlock.acquire(sys.argv[1])\nprint('held', flush=True)\n"
    hold += "time.sleep(600)\n"
    job = {**os.environ, "SLURM_JOB_ID": "4242"}
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run_dir)], cwd=ROOT, env=job, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        other = cli(f"hydra.run.dir={run_dir}", env={**os.environ, "SLURM_JOB_ID": "4243"})
        assert other.returncode == 2 and "SLURM job 4242" in errors(other.stderr)[0]

        same = start_train(f"hydra.run.dir={run_dir}", log=tmp_path / "same.log", env=job)  # the job, requeued
        waiting = "waiting for the previous start of SLURM job 4242"
        wait_for(lambda: waiting in same.log.read_text(), repr(waiting), same)
    finally:
        holder.kill()
        holder.wait()
    assert same.wait(timeout=300) == 0, same.output()
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "completed"
