"""The signals that stop a run, and how a stop travels: `Interrupted`, exit 128 + the signal's number.

Free of heavy imports: every command installs these handlers before Hydra composes its config.
"""

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

# The signals that stop a run: Ctrl-C, a scheduler's stop (SIGTERM), and a scheduler's pre-emption warning
# (SIGUSR1, e.g. SLURM's `--signal=USR1@60`), which is treated like SIGTERM.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Interrupted(BaseException):
    """A stop asked for by a signal. A BaseException, like KeyboardInterrupt, so that a Hydra sweep stops
    rather than recording a failed job and starting the next one. `checkpoint` is None when the signal came
    before training started: there was nothing to save."""

    def __init__(self, signum: int, checkpoint: str | None):
        self.signum = signum
        self.checkpoint = checkpoint
        name = signal.Signals(signum).name
        if checkpoint is None:
            message = f"interrupted by {name} before training started; nothing was saved"
        else:
            message = f"interrupted by {name}; resume with ckpt_path={checkpoint}"
        super().__init__(message)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _stop_now(signum: int, frame) -> None:
    raise Interrupted(signum, None)


@contextmanager
def handling_signals(handler: Callable[[int, object], None]) -> Iterator[None]:
    """`handler` for every signal of SIGNALS while the block runs, then the previous handlers again."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = install(handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def stopping_at_once() -> AbstractContextManager:
    """While a command starts (Hydra composes, the run sets up), a signal ends it at once: nothing to save."""
    return handling_signals(_stop_now)


def install(handler: Callable[[int, object], None]) -> dict:
    """`handler` for every signal of SIGNALS from now on; returns the handlers it replaced."""
    return {signum: signal.signal(signum, handler) for signum in SIGNALS}
