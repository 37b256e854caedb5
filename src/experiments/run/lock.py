"""One run per run dir at a time: an flock(2) lock on `<dir>/.lock`, held for as long as the run's process lives.

The kernel drops the lock when its holder dies, however it dies (SIGKILL, the out-of-memory killer), so a dead
run never leaves a stale lock and the next start in the dir resumes at once. The file also says who holds it
(pid, host, since when), for the one line that refuses a second run; it is emptied when the holder lets go.

A single run's dir is locked by `LockRunDir`, a Hydra callback, before Hydra writes anything into it (its
`.hydra/` and log file), and a sweep's dir before the sweep writes anything; each job of a sweep locks its own
dir when it starts (`experiments.commands.train.train`, which also locks for a caller without Hydra). Only the
writing rank locks: the other ranks of a DDP run, torchrun or srun write nothing. A lock that this process
already holds is held on (re-entrant), so the callback and the task can both ask for it.
"""

import atexit
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from experiments.config.errors import ConfigError
from experiments.distributed.ranks import this_rank
from experiments.run.exits import EXIT_BAD_INPUT, Abort

LOCK_FILE = ".lock"  # the name RunPaths.lock and SweepPaths.lock give it
# A requeued SLURM job can start while the step of its previous start is still being killed: it waits for that
# one (the same SLURM_JOB_ID) this long, polling each second, before it is refused like any other second run.
SAME_JOB_WAIT_S = 120.0
# Filesystems where flock is not supported (some network and FUSE filesystems): the run goes on unlocked.
NOT_SUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

_held: dict[Path, int] = {}  # this process's locks: resolved dir -> the descriptor of its locked file


class RunDirBusy(ConfigError):
    """Another process holds the dir's lock."""


def _holder_record() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.now().astimezone().isoformat(timespec="seconds"),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "command": " ".join(sys.argv),
    }


def _read_holder(path: Path) -> dict:
    for _ in range(20):  # the holder writes its record just after it takes the lock
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    return {}


def _busy(what: str, setting: str, holder: dict) -> RunDirBusy:
    pid = holder.get("pid", "unknown")
    slurm = f", SLURM job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return RunDirBusy(
        f"{what} is in use by another run: pid {pid} on {holder.get('host', 'an unknown host')} since "
        f"{holder.get('since', 'an unknown time')}{slurm} ({holder.get('command', 'command unknown')}); "
        f"allowed: wait for it to end (or stop it), or another {setting}"
    )


def acquire(directory: Path, what: str | None = None, setting: str = "hydra.run.dir") -> bool:
    """Lock `directory` (made if needed) for this process; True when this call took the lock, False when this
    process held it already (or the filesystem has no locks). Raises `RunDirBusy` when another process holds it.
    `what` names the dir in that message (default `setting=directory`)."""
    directory = Path(directory).resolve()
    if directory in _held:
        return False
    what = what or f"{setting}={directory}"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    waiting_since = time.monotonic()
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # never inherited by a rank's exec
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = _read_holder(path)
            job = os.environ.get("SLURM_JOB_ID")
            if job and holder.get("slurm_job") == job and time.monotonic() - waiting_since < SAME_JOB_WAIT_S:
                if time.monotonic() - waiting_since < 1:
                    print(f"waiting for the previous start of SLURM job {job} (pid {holder.get('pid')}) to end",
                          file=sys.stderr)  # fmt: skip
                time.sleep(1.0)
                continue
            raise _busy(what, setting, holder) from None
        except OSError as err:
            os.close(fd)
            if err.errno not in NOT_SUPPORTED:
                raise
            print(f"warning: {path}: this filesystem has no locks ({err.strerror}); a second run in this dir "
                  "would not be refused", file=sys.stderr)  # fmt: skip
            return False
        try:  # a refused fresh start may have removed the file between our open and our lock: lock the new one
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_holder_record()) + "\n").encode(), 0)
    except OSError:  # a full disk: the lock holds all the same, its holder is then named "unknown"
        pass
    _held[directory] = fd
    return True


def release(directory: Path) -> None:
    """Let go of `directory`'s lock, if this process holds it, and empty its record."""
    fd = _held.pop(Path(directory).resolve(), None)
    if fd is not None:
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            os.close(fd)


def holds(directory: Path) -> bool:
    return Path(directory).resolve() in _held


@contextmanager
def holding(directory: Path, what: str | None = None, setting: str = "hydra.run.dir") -> Iterator[bool]:
    """Hold `directory`'s lock while the block runs; a lock this process held before is left held after it.
    Yields whether this call took it."""
    taken = acquire(directory, what, setting)
    try:
        yield taken
    finally:
        if taken:
            release(directory)


@atexit.register
def _release_all() -> None:  # the kernel drops the locks anyway; this empties their records
    for directory in list(_held):
        release(directory)


def _acquire_or_abort(directory: Path, setting: str) -> Path:
    try:
        acquire(directory, setting=setting)
    except RunDirBusy as err:
        raise Abort(err, EXIT_BAD_INPUT) from None  # Hydra's callbacks would only warn about a ConfigError
    return Path(directory).resolve()


class LockRunDir(Callback):
    """Hydra callback (conf/config.yaml, `hydra.callbacks`): lock a run's dir, or a sweep's, before Hydra writes
    anything into it, so that a second run (or sweep) in it is refused with nothing written."""

    def __init__(self):
        self.locked: list[Path] = []

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        if this_rank().zero:
            self.locked.append(_acquire_or_abort(Path(config.hydra.run.dir), "hydra.run.dir"))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if this_rank().zero:
            sweep_dir = _acquire_or_abort(Path(config.hydra.sweep.dir), "hydra.sweep.dir")
            self.locked.append(sweep_dir)
            from experiments.run.files import remove_stray_temps  # loads torch: only once the lock is held

            remove_stray_temps(sweep_dir, recursive=False)  # results.csv's; each job cleans its own dir

    def on_run_end(self, config: DictConfig, **kwargs) -> None:
        self._release()

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        self._release()

    def _release(self) -> None:
        while self.locked:
            release(self.locked.pop())
