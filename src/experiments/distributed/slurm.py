"""SLURM: one pre-emption mechanism instead of two, and the requeue after a SIGUSR1 warning.

Lightning's own SLURM auto-requeue saves a checkpoint from inside its SIGUSR1 handler, wherever the step is, and
requeues. Here it is switched off (`plugins()`); `failures.Interruption` handles SIGUSR1 like SIGTERM (stop at the
next optimizer-step boundary, save the exact position), and once the run has written everything, rank 0 asks
SLURM to requeue the job (`requeue_after`). The requeued job keeps its SLURM_JOB_ID, so scripts/slurm.sbatch
starts it in the same run dir and `experiments.run.state` resumes it. `scontrol requeue` sends SIGTERM itself: a
SIGTERM is a stop, and the requeue (if any) is SLURM's.
"""

import os
import signal
import subprocess
import sys

from lightning.fabric.plugins.environments import SLURMEnvironment

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
