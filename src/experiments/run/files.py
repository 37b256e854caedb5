"""The one way this project writes a file: whole or not at all (metrics.json, checkpoints, results.csv, ...)."""

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lightning.fabric.plugins import TorchCheckpointIO

UMASK = os.umask(0o022)  # reading the umask means setting it: put it straight back
os.umask(UMASK)


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """The one way this project writes a file whole or not at all: write to the yielded temporary path beside
    `path`; when the block ends, the file is flushed to disk and renamed over `path` (and the rename made
    durable); when it raises, the temporary file is removed and `path` is left as it was.

    Beside the target, not in the system's temp dir: a rename within one filesystem is atomic, a move across
    two is a copy that a crash can cut in half.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        os.fchmod(fd, 0o666 & ~UMASK)  # mkstemp makes the file private (0600); give it a new file's mode
        os.close(fd)
        yield tmp
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
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


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, atomic on every filesystem (`trainer.plugins`).

    Lightning writes through an fsspec transaction whose temporary file sits in the system's temp dir; when
    that is another filesystem than the run dir, the final move is a copy, and a crash during it leaves half
    a checkpoint. Here the checkpoint goes through `replacing`, like every file of a run.
    """

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        with replacing(Path(path)) as tmp:
            super().save_checkpoint(checkpoint, tmp, storage_options)
