"""A run dir that this node cannot write (a read-only or foreign file system, as compute nodes sometimes mount the
shared one): refused in one line, exit 2, before Hydra makes the dir (its own `mkdir` would end in a traceback).

A Hydra callback (`hydra.callbacks` of conf/config.yaml, eval.yaml and predict.yaml), run before the lock's, on
the writing rank only: ranks > 0 write nothing.
"""

import os
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from experiments.config.errors import ConfigError
from experiments.distributed.ranks import this_rank
from experiments.run.exits import EXIT_BAD_INPUT, Abort


def why_not_writable(directory: Path) -> str | None:
    """Why this process cannot make or write `directory`, naming the dir that stops it; None when it can."""
    existing = Path(os.path.abspath(directory))
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        return f"{existing} is on a read-only file system"
    # access(2) asks the file system itself: root is refused too where the server (NFS root_squash) refuses it.
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this process (uid {os.getuid()}): permission denied"
    return None


def check_writable(directory: Path, setting: str) -> None:
    if (reason := why_not_writable(directory)) is not None:
        error = ConfigError(
            f"{setting}={directory} cannot be written: {reason}; allowed: a dir this node can write, e.g. "
            f"{setting}=<a dir on a writable file system>"
        )
        raise Abort(error, EXIT_BAD_INPUT)  # Hydra's callbacks would only warn about an Exception


class WritableRunDir(Callback):
    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        if this_rank().zero:
            check_writable(Path(config.hydra.run.dir), "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if this_rank().zero:
            check_writable(Path(config.hydra.sweep.dir), "hydra.sweep.dir")
