"""The cluster path on a real one-node SLURM cluster (scripts/local_slurm.sh): sbatch with DDP over 2 tasks, and
pre-emption by `scontrol requeue` (SIGTERM) and by SIGUSR1, each resuming in the same run dir bit for bit.

Skipped only where SLURM is not installed (no `sinfo`); CI sets GPU_LAB_REQUIRE_SLURM=1, so a skip fails there.
"""

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from background import wait_for
from conftest import ROOT, TINY, compose_config, final_weights, logged_tags, metrics

from experiments.commands.train import train

pytestmark = pytest.mark.slurm
LOCAL_CONF = Path(os.environ.get("GPU_LAB_SLURM_DIR", "/tmp/gpu-lab-slurm")) / "slurm.conf"


@pytest.fixture(scope="module", autouse=True)
def cluster():
    if shutil.which("sinfo") is None:
        if os.environ.get("GPU_LAB_REQUIRE_SLURM"):
            pytest.fail("GPU_LAB_REQUIRE_SLURM=1 but SLURM is not installed")
        pytest.skip("SLURM is not installed (no sinfo); scripts/local_slurm.sh runs a local cluster")
    if "SLURM_CONF" not in os.environ and LOCAL_CONF.exists():
        os.environ["SLURM_CONF"] = str(LOCAL_CONF)  # the local cluster, started by scripts/local_slurm.sh
    up = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    assert up.returncode == 0 and up.stdout.strip(), f"no SLURM cluster answers: {up.stderr}"


def submit(tmp_path: Path, name: str, *args: str, options: tuple[str, ...] = ()) -> str:
    command = ["sbatch", "--parsable", f"--job-name={name}", f"--output={tmp_path}/{name}-%j.out", *options]
    command += ["scripts/slurm.sbatch", "trainer.accelerator=cpu", *TINY, *args, f"hydra.run.dir={tmp_path / name}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip().split(";")[0]


def state(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    return out.stdout.strip()  # "" once the job has left the queue


def wait_until(condition, what: str, timeout: float = 240) -> None:
    wait_for(condition, what, timeout=timeout, every=0.5)  # at the scheduler's pace: squeue asks slurmctld


def test_sbatch_ddp_over_two_tasks_gives_the_weights_of_one_device(tmp_path):
    job = submit(tmp_path, "ddp", options=("--nodes=1", "--ntasks-per-node=2"))
    wait_until(lambda: state(job) == "", "the DDP job to end")
    record = metrics(tmp_path / "ddp")
    assert record.get("status") == "completed", (tmp_path / f"ddp-{job}.out").read_text()[-3000:]
    assert (record["world_size"], record["devices"], record["num_nodes"]) == (2, 2, 1)
    train(compose_config(), tmp_path / "one")
    ddp, one = final_weights(tmp_path / "ddp"), final_weights(tmp_path / "one")
    for name, tensor in one.items():  # the project's tolerance (tests/test_strategies.py)
        assert torch.allclose(ddp[name].double(), tensor.double(), rtol=1e-5, atol=0), name


# 200 steps an epoch, 30 epochs (about 12 s), so that the signal, which SLURM takes a second or two to deliver,
# lands mid-run; momentum: optimizer state to restore.
LONG = [
    "data.num_samples=1000",
    "data.batch_size=4",
    "trainer.max_epochs=30",
    "optimizer.momentum=0.9",
    "optimizer.lr=0.01",
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    train(compose_config(*LONG), run_dir)
    return final_weights(run_dir)


@pytest.mark.parametrize("preemption", ["scontrol requeue", "SIGUSR1"])
@pytest.mark.slow
def test_a_preempted_job_is_requeued_and_resumes_bit_for_bit(tmp_path, uninterrupted, preemption):
    name = "preempted-" + preemption.split()[-1].lower()
    run_dir = tmp_path / name
    job = submit(tmp_path, name, *LONG)
    # Steps on disk: training is under way (a signal before the first step stops the run with nothing saved).
    wait_until(lambda: "train/loss" in logged_tags(run_dir), "training to start")
    if preemption == "SIGUSR1":  # as `--signal=USR1@90` does: to the job's steps, not the batch shell
        subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
    else:
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
    wait_until(lambda: metrics(run_dir).get("status") == "interrupted" or state(job) == "", "the stop")
    interrupted = metrics(run_dir)
    log = lambda: "".join(p.read_text() for p in tmp_path.glob(f"{name}-*.out"))[-3000:]  # noqa: E731
    assert interrupted.get("status") == "interrupted" and 0 < interrupted["global_step"] < 6000, log()

    moved = []

    def requeued_then_done() -> bool:
        now = state(job)
        if now == "PENDING" and not moved:  # a requeued job's begin time is about two minutes away: move it, once
            # Not `now`: slurmd refuses a credential of the same second as the one it revoked when the first run
            # was killed ("Killing non-startable batch JobId=N: Job credential revoked"), ending the job.
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+3"], timeout=30)
            moved.append(job)
        return now == "" or metrics(run_dir).get("status") == "completed"

    wait_until(requeued_then_done, "the requeued job to complete")
    wait_until(lambda: state(job) == "", "the job to leave the queue", timeout=60)
    assert metrics(run_dir).get("status") == "completed", log()
    resumed = final_weights(run_dir)
    assert [k for k in uninterrupted if not torch.equal(resumed[k], uninterrupted[k])] == []


@pytest.mark.slow
def test_submitit_slurm_sweep_of_ddp_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    command = [sys.executable, "train.py", "-m", *TINY, "trainer.accelerator=cpu", "optimizer.lr=0.01,0.02"]
    command += ["hydra/launcher=submitit_slurm", "hydra.launcher.tasks_per_node=2", "trainer.devices=2"]
    command += ["hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2", "hydra.launcher.timeout_min=10"]
    command += [f"hydra.launcher.name=submitit-{tmp_path.name}", f"hydra.sweep.dir={sweep}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = list(csv.DictReader((sweep / "results.csv").open()))
    assert [(row["status"], row["world_size"]) for row in rows] == [("completed", "2")] * 2
