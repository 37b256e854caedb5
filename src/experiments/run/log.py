"""The run's own lines (its epoch lines, its closing summary, its error) in the terminal and in `<run dir>/train.log`.

The log file is opened as the run starts training in its dir (rank 0), and closed when the command's job ends: a
start that is refused or has nothing to do writes none, and a resumed run appends to its own. Hydra's job logging
writes no file (conf/config.yaml: `hydra/job_logging: stdout`): it made an empty train.log in every run dir.
"""

import logging
import sys
from pathlib import Path

LOG = logging.getLogger("experiments.run.log")
LOG.propagate = False  # the terminal has the line already (printed), the log file alone takes it here
LOG.setLevel(logging.INFO)


class _LogFile(logging.FileHandler):
    """A full disk (or a dir gone) drops the log's lines: the run's own error line says what happened, and a
    traceback of the log, or an error of its own, would only bury it. Opening the file (delayed to the first line)
    and closing it raise outside logging's own handleError, so they are caught here too."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            super().emit(record)
        except OSError:
            pass

    def handleError(self, record: logging.LogRecord) -> None:
        pass

    def close(self) -> None:
        try:
            super().close()
        except OSError:
            pass


def say(text: str, file=None) -> None:
    """Print `text` (stdout unless `file`), and put each of its lines in the run's log file when one is open."""
    print(text, file=file or sys.stdout, flush=True)
    for line in text.splitlines():
        if line.strip():
            LOG.info(line)


def open_log(path: Path) -> None:
    """Lines from now on also go to `path` (appended: a resumed run goes on in its file), made at the first line."""
    close_log()
    handler = _LogFile(path, encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s  %(message)s"))
    LOG.addHandler(handler)


def close_log() -> None:
    for handler in list(LOG.handlers):
        LOG.removeHandler(handler)
        handler.close()
