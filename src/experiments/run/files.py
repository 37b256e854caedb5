"""The one way this project writes a file: whole or not at all (metrics.json, checkpoints, results.csv, ...).

A write that finds its filesystem full raises `OutOfSpace` naming the file, and leaves the file as it was (the
last complete checkpoint stays the last checkpoint). A write cut short by a kill (SIGKILL, a power loss) leaves
its temporary file behind; `remove_stray_temps` removes those at the next start in that dir, once the start
holds the dir's lock (experiments.run.lock), so that it never takes a running run's file.
"""

import os
import re
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from experiments.run.exits import OutOfSpace, is_out_of_space

UMASK = os.umask(0o022)  # reading the umask means setting it: put it straight back
os.umask(UMASK)

# `.<name>.<8 characters of mkstemp>.tmp`: the temporary files of `replacing`, and nothing else.
TEMP_PREFIX, TEMP_SUFFIX = ".", ".tmp"
STRAY_TEMP = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")


@contextmanager
def replacing(path: Path, put_in_place: Callable[[Path, Path], None] | None = None) -> Iterator[Path]:
    """The one way this project writes a file whole or not at all: write to the yielded temporary path beside
    `path`; when the block ends, the file is flushed to disk and renamed over `path` (and the rename made
    durable); when it raises, the temporary file is removed and `path` is left as it was.

    Beside the target, not in the system's temp dir: a rename within one filesystem is atomic, a move across
    two is a copy that a crash can cut in half. `put_in_place(tmp, path)` does the flush and the rename
    (default: `_put_in_place`, before the block's end returns).
    """
    path = Path(path)
    tmp = _temporary(path)
    with _abandoning(tmp, path):
        yield tmp
    (put_in_place or _put_in_place)(tmp, path)


def _temporary(path: Path) -> Path:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f"{TEMP_PREFIX}{path.name}.", suffix=TEMP_SUFFIX)
    except OSError as err:
        if is_out_of_space(err):
            raise OutOfSpace(path) from err
        raise
    os.fchmod(fd, 0o666 & ~UMASK)  # mkstemp makes the file private (0600); give it a new file's mode
    os.close(fd)
    return Path(name)


@contextmanager
def _abandoning(tmp: Path, path: Path) -> Iterator[None]:
    """On any error in the block: remove `tmp` and leave `path` as it was; a full disk is OutOfSpace(path)."""
    try:
        yield
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if is_out_of_space(err) and not isinstance(err, OutOfSpace):
            raise OutOfSpace(path) from err
        raise


def _put_in_place(tmp: Path, path: Path) -> None:
    """Flush the written `tmp` to disk and rename it over `path`, durably."""
    with _abandoning(tmp, path):
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())  # where a filesystem allocates late, a full one says so here
        os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)


def write_atomic(path: Path, content: str | bytes) -> None:
    with replacing(path) as tmp:
        if isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            tmp.write_text(content)


def remove_stray_temps(directory: Path, recursive: bool = True) -> list[Path]:
    """Remove the temporary files that writes cut short by a kill left in `directory`; returns them."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = directory.rglob(f"{TEMP_PREFIX}*{TEMP_SUFFIX}") if recursive else directory.glob(f"{TEMP_PREFIX}*")
    stray = [p for p in found if STRAY_TEMP.match(p.name) and p.is_file()]
    for path in stray:
        path.unlink(missing_ok=True)
    return stray


class _RecordingFile:
    """A file for `torch.save` that keeps the OSError of a failed write: torch's zip writer turns it into a
    RuntimeError without its errno ("unexpected pos ..."), which would hide a full disk."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, atomic on every filesystem (`trainer.plugins`).

    Lightning serializes the checkpoint into memory, then writes it through an fsspec transaction whose
    temporary file sits in the system's temp dir and is copied over at the end: twice the checkpoint in memory,
    a stray file in /tmp after a kill, and, when /tmp is another filesystem, a copy that a crash can cut in half.
    Here `torch.save` writes straight into the temporary file of `replacing`, like every file of a run.

    `storage_options=IN_PLACE_LATER` returns once the file is written and leaves its fsync and rename to a thread
    (about 1 ms on this project's machine, on the path of every rank under DDP: the others wait for rank 0 at the
    next all-reduce). The fsync waits on the disk, not the CPU, and releases the GIL; Lightning's AsyncCheckpointIO
    moves the whole save to a thread, whose pickling competes with training for the GIL and a core
    (docs/benchmarks.md). Every other call, `load_checkpoint` and Lightning's `teardown` (on every way out of a
    fit) first wait for that rename and raise its error, so files land in order and none is left pending.
    """

    def __init__(self):
        super().__init__()
        self._finisher: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options not in (None, IN_PLACE_LATER):
            raise TypeError(f"{type(self).__name__} takes storage_options=IN_PLACE_LATER or none")
        self.wait()
        later = self._put_in_place_later if storage_options is not None else None
        with replacing(Path(path), later) as tmp, open(tmp, "wb") as file:
            recording = _RecordingFile(file)
            try:
                torch.save(checkpoint, recording)
            except RuntimeError as err:
                if recording.error is not None:
                    raise recording.error from err
                raise

    def _put_in_place_later(self, tmp: Path, path: Path) -> None:
        if self._finisher is None:
            self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-in-place")
        self._pending = self._finisher.submit(_put_in_place, tmp, path)

    def wait(self) -> None:
        """Wait until the last save is in place; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def load_checkpoint(self, *args, **kwargs):
        self.wait()
        return super().load_checkpoint(*args, **kwargs)

    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            if self._finisher is not None:
                self._finisher.shutdown()
                self._finisher = None


IN_PLACE_LATER = {"in_place": "later"}  # AtomicCheckpointIO's one storage option
