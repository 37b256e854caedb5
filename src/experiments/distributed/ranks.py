"""Which rank this process is, and what a rank > 0 must not do (write files, outlive its launcher).

No Lightning here: `train.py` reads the rank before Hydra starts.
"""

import os
import signal
import threading
import time
from typing import NamedTuple


class Rank(NamedTuple):
    zero: bool  # global rank 0: the process that writes the run's files
    started_by_launcher: bool  # a launcher started it as a rank and waits for it: it should end with it


def this_rank() -> Rank:
    """Which rank this process is, as the launcher that started it announced it in the environment; the one
    reading of rank for the whole project, before any process group exists (Lightning's own, `trainer.
    global_rank`, is known only once the Trainer is built).

    - torchrun sets RANK (the global rank) and LOCAL_RANK for every rank, 0 included; it is their parent.
    - Lightning's DDP launcher re-runs train.py for ranks > 0 with LOCAL_RANK and NODE_RANK set; rank 0 is
      the user's own process. Inside a one-task SLURM job its children inherit SLURM_PROCID=0.
    - srun sets SLURM_PROCID (the global rank) for each task; slurmstepd, not a rank, is their parent.
    - By hand on several nodes (Lightning's launcher on each), NODE_RANK > 0 says the node is not the first.
    A process that none of them started (the user's `python train.py`) is rank 0.
    """
    env = os.environ
    if "RANK" in env:
        zero = int(env["RANK"]) == 0
    else:
        zero = all(int(env.get(key, 0)) == 0 for key in ("SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))
    return Rank(zero=zero, started_by_launcher="LOCAL_RANK" in env)


def silent_rank_overrides(args: list[str]) -> list[str]:
    """Hydra overrides that keep a rank > 0 from writing: no `.hydra/`, no log file, no run dir of its own.

    Under torchrun or SLURM every rank runs Hydra, and each would make its own timestamped run dir. Rank 0's
    dir is the run's: ranks > 0 write nothing there (Lightning loggers and checkpoints write on rank 0, and
    `ModelCheckpoint` broadcasts rank 0's dir), so they stay in the working directory unless told a dir.
    """
    if this_rank().zero:
        return []
    overrides = ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
    if not any(a.startswith("hydra.run.dir=") for a in args):
        overrides.append("hydra.run.dir=.")
    return overrides


def end_with_parent() -> None:
    """In a rank that a launcher started (Lightning's for ranks > 0, torchrun, srun): end when the launcher does.

    When rank 0 dies, the ranks it started wait in their next collective; gloo notices the closed connection
    at once, but NCCL may wait out its timeout (minutes). Lightning's `_ChildProcessObserver` covers the
    other direction only (rank 0 ends every rank when a child dies, within 5 s). SIGKILL, because a rank
    stuck inside a collective does not run Python signal handlers.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        # gloo's error ends this rank by itself, with a line naming the lost rank (distributed.lost_rank): give it
        # the time to say so before ending a rank that NCCL leaves waiting.
        time.sleep(3.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()
