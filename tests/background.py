"""A command in the background, and a wait for what it does: a test starts a run, waits until the run has reached a
point (a step logged, a checkpoint saved, a line printed, a job left the queue), then acts on it (a signal, a kill, a
second command) or reads what it left.

`start` sends the command's stdout and stderr to a file: a pipe that no one reads while the test waits could fill
and block the command. `wait_for` polls a condition and fails naming what it waited for, with the command's exit
status and its last output where the command ended first or the time ran out.

Which interpreter a command names: `python()` (conftest.py: the pre-imported one's shim, tests/prefork.py) unless the
test is about the process itself. A test that reads the command's pid from what it wrote (a lock's holder), looks
at its children (DDP ranks) or SIGKILLs it names `sys.executable`: the shim's pid is not the run's, and a SIGKILL of
the shim ends the run a moment later, time in which it can save. A command hears SIGINT as a terminal's does:
conftest.py's `sigint_heard` runs before each test (an ignored SIGINT would be ignored by the command too)."""

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from conftest import ROOT, python, shrink


class Started(subprocess.Popen):
    """A `subprocess.Popen` whose stdout and stderr go to the file `log`."""

    def __init__(self, command: list[str], log: Path, cwd: Path = ROOT, **popen):
        self.log = Path(log)
        with self.log.open("w") as out:  # the command has its own copy of the file
            super().__init__(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, text=True, **popen)

    def output(self, last: int = 3000) -> str:
        """The last `last` characters of what it printed so far."""
        return self.log.read_text(errors="replace")[-last:]


def start(command: list[str], log: Path, cwd: Path = ROOT, **popen) -> Started:
    """`command` in the background from `cwd` (the repository root), its output in `log`; `popen`: env, ..."""
    return Started(command, log, cwd, **popen)


def start_train(*args: str, log: Path, tiny: bool = True, interpreter: str | None = None, **popen) -> Started:
    """`python train.py ARGS` as conftest.cli runs it (TINY first), in the background."""
    return start([interpreter or python(), "train.py", *(shrink(args) if tiny else args)], log, **popen)


def wait_for(
    condition: Callable[[], object],
    what: str,
    process: subprocess.Popen | None = None,
    timeout: float = 300,
    every: float = 0.05,
) -> float:
    """Call `condition` every `every` seconds until it is true; returns the seconds that took. Fails (an
    AssertionError naming `what`) after `timeout` seconds, or as soon as `process` has ended without the condition
    holding: with its exit status, and its last output where it is `Started`."""
    began = time.monotonic()
    while not condition():
        ended = process is not None and process.poll() is not None
        if ended and condition():  # it did it just before it ended
            break
        if ended or time.monotonic() - began > timeout:
            why = f"the command ended (exit {process.returncode}) first" if ended else f"not after {timeout:g} s"
            output = f"; its last output ({process.log}):\n{process.output()}" if isinstance(process, Started) else ""
            raise AssertionError(f"waiting for {what}: {why}{output}")
        time.sleep(every)
    return time.monotonic() - began
