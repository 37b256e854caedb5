"""How a command ends, and the exit code of each way (docs/failures.md):
0 completed; 1 the run failed (divergence, out of memory or disk space, a crash); 2 bad input (`ConfigError`);
128 + signal number when interrupted (`run.signals.Interrupted`): 130 for SIGINT (Ctrl-C), 143 for SIGTERM (a
scheduler's stop), 138 for SIGUSR1 (a scheduler's pre-emption warning).
"""

import errno
import os
import shutil
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2

# The errors a write gets when its filesystem is full, or the user's quota on it is.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class RunFailed(RuntimeError):
    """The run cannot go on, for a reason the message explains with what to change."""


class OutOfSpace(RunFailed):
    """A write found its filesystem full: `path` is the file it was writing."""

    def __init__(self, path: Path):
        self.path = Path(path)
        left = free_bytes(self.path)
        space = "unknown" if left is None else f"{left:,} bytes ({left / 2**20:.1f} MiB)"
        if no_inodes_left(self.path):
            space += " and no file entries (inodes)"
        super().__init__(
            f"no space left on device writing {self.path}: {space} left on its filesystem; free some space there "
            "(or choose another hydra.run.dir) and run the same command again: an unfinished run resumes from "
            "its last complete checkpoint"
        )


class Abort(BaseException):
    """An error raised where Hydra would swallow an Exception (its callbacks only warn about those): a
    BaseException, like `Interrupted`, so that it reaches the entry point, which prints `error` and exits
    with `exit_code`."""

    def __init__(self, error: Exception, exit_code: int):
        self.error, self.exit_code = error, exit_code
        super().__init__(str(error))


def full_file(err: OSError, logger, root: Path) -> Path:
    """The file a write that found the disk full was writing: named by the error, or the logger's (TensorBoard's
    event file, written from torch's code, names none), or else the run dir `root`."""
    if getattr(err, "filename", None):
        return Path(err.filename)
    frames = traceback.extract_tb(err.__traceback__)
    if any("tensorboard" in frame.filename for frame in frames):
        return Path(logger.log_dir) if logger else root
    return root


def is_out_of_space(err: BaseException | None) -> bool:
    """Whether `err`, or an error it was raised from, is a full filesystem's."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OutOfSpace) or (isinstance(err, OSError) and err.errno in NO_SPACE):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def free_bytes(path: Path) -> int | None:
    """Bytes free for this user on the filesystem of `path` (or of its nearest existing parent)."""
    for directory in [Path(path), *Path(path).parents]:
        if directory.exists():
            try:
                return shutil.disk_usage(directory).free
            except OSError:
                return None
    return None


def no_inodes_left(path: Path) -> bool:
    """Whether the filesystem of `path` has run out of inodes (it counts them, and none is left)."""
    for directory in [Path(path), *Path(path).parents]:
        if directory.exists():
            try:
                stats = os.statvfs(directory)
            except OSError:
                return False
            return stats.f_files > 0 and stats.f_favail == 0
    return False


def out_of_memory(error: str, batch_size: int, accumulate: int, advice: str) -> RunFailed:
    """`error`: torch's message's first line; `advice`: what batch.effective would choose (batch_fit.suggestion)."""
    smaller = max(batch_size // 2, 1)
    return RunFailed(
        f"out of device memory with data.batch_size={batch_size} ({error}); try a smaller data.batch_size, e.g. "
        f"data.batch_size={smaller} trainer.accumulate_grad_batches={accumulate * 2}, which keeps the effective "
        f"batch; {advice}"
    )


@contextmanager
def quiet_full_disk_in_threads() -> Iterator[None]:
    """While the block runs, a full disk in a background thread (TensorBoard's event writer) prints no
    traceback of its own: the writer raises the same error again in the main thread, which reports it once."""
    previous = threading.excepthook

    def hook(args) -> None:
        if not is_out_of_space(args.exc_value):
            previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous
