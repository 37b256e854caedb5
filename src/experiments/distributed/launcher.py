"""Lightning's DDP launcher, made to start its ranks into the current Hydra job rather than a sweep of their own."""

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig

from experiments import internals

# The repository's `train.py`: what ranks > 0 run, whatever process started the job (a joblib worker's own
# `sys.argv` and `__main__` belong to joblib, not to this program).
ENTRY = Path(__file__).resolve().parents[3] / "train.py"


def _rank_command(local_rank: int) -> tuple[list[str], str]:
    """The command Lightning's launcher runs for rank `local_rank` of the current Hydra job.

    Lightning's own version re-runs `sys.argv`: inside a multirun that is `-m` and the whole sweep, so each
    rank starts a sweep of its own and the job hangs (Lightning #11300, Hydra #2070). Here the rank runs
    this job alone: its config name, its own overrides, its output dir, as a single run.
    """
    hydra = HydraConfig.get()
    output_dir = hydra.runtime.output_dir.replace("\\", "\\\\").replace('"', '\\"')
    command = [sys.executable, str(ENTRY)]
    if hydra.job.config_name:
        command.append(f"--config-name={hydra.job.config_name}")
    command += [*hydra.overrides.task, f'hydra.run.dir="{output_dir}"']
    return command, hydra.runtime.cwd


@contextmanager
def ranks_join_this_job() -> Iterator[None]:
    """While a job runs, Lightning's DDP launcher starts its ranks into this job; afterwards the process is as
    it was, so that the next job of a sweep (in this process or the same joblib worker) starts its own ranks.

    The launcher leaves MASTER_ADDR, MASTER_PORT, NODE_RANK, LOCAL_RANK and WORLD_SIZE in `os.environ`, and a
    set LOCAL_RANK tells Lightning that the ranks were started externally; the process group also outlives
    `trainer.fit`.

    The launcher's command is replaced through `internals.rank_command` (Lightning 2.6 has no public hook for it)
    for the duration of one job, and Lightning's put back after it, which reaches every DDP run.
    """
    environment = dict(os.environ)
    try:
        with internals.rank_command(_rank_command):
            yield
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for key in set(os.environ) - set(environment):
            del os.environ[key]
        os.environ.update(environment)
