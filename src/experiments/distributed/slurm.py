"""SLURM: one pre-emption mechanism instead of two, and the requeue after a SIGUSR1 warning.

Lightning's own SLURM auto-requeue saves a checkpoint from inside its SIGUSR1 handler, wherever the step is, and
requeues. Here it is switched off (`plugins()`); `failures.Interruption` handles SIGUSR1 like SIGTERM (stop at the
next optimizer-step boundary, save the exact position), and once the run has written everything, rank 0 asks
SLURM to requeue the job (`requeue_after`). The requeued job keeps its SLURM_JOB_ID, so scripts/slurm.sbatch
starts it in the same run dir and `experiments.run.state` resumes it. `scontrol requeue` sends SIGTERM itself: a
SIGTERM is a stop, and the requeue (if any) is SLURM's.

A rank that lost a peer ends its job step (`end_step_after`): srun waits for every task's exit from its node's
slurmstepd, and a node whose processes died (or that died) never sends it, so the job would wait out its time
limit with no rank left.
"""

import atexit
import os
import signal
import subprocess
import sys

from lightning.fabric.plugins.environments import SLURMEnvironment

from experiments.distributed.lost_rank import peer_gone
from experiments.distributed.ranks import this_rank


def plugins() -> list:
    """Trainer plugins for a run inside a SLURM job step: Lightning's SLURM environment without its requeue."""
    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def job_id() -> str | None:
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    return f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ.get("SLURM_JOB_ID")


def requeue_after(signum: int) -> None:
    """After a SIGUSR1 (SLURM's `--signal=USR1@<seconds>` warning), requeue this job; rank 0 only."""
    job = job_id()
    if signum != signal.SIGUSR1 or job is None or not this_rank().zero:
        return
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    state = "requeued" if done.returncode == 0 else f"could not requeue ({done.stderr.strip()})"
    print(f"SLURM job {job} {state}", file=sys.stderr)


def end_step_after(err: BaseException) -> None:
    """After gloo's error for a lost peer (or distributed.lost_rank's line, which keeps gloo's words), in a SLURM
    step of several tasks: cancel the step as this process exits. srun then stops waiting for the lost node's tasks
    after KillWait and exits non-zero, and the job ends FAILED (a node that SLURM itself finds down is requeued:
    --requeue). At the exit, not at once: the cancel also ends this rank within KillWait, and on a busy node the run's
    record, its summary and its `error: lost rank` line could take longer than that."""
    job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    if job is None or step is None or int(os.environ.get("SLURM_NTASKS", "1")) < 2:
        return
    if peer_gone(err) is None:
        return
    atexit.register(_cancel_step, job, step)


def _cancel_step(job: str, step: str) -> None:
    try:
        subprocess.run(["scancel", "--quiet", f"{job}.{step}"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass  # no scancel here: the job waits for its time limit, as without this
