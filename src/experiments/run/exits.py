"""How a command ends, and the exit code of each way (docs/failures.md):
0 completed; 1 the run failed (divergence, out of memory, a crash); 2 bad input (`ConfigError`);
128 + signal number when interrupted (`run.signals.Interrupted`): 130 for SIGINT (Ctrl-C), 143 for SIGTERM (a
scheduler's stop), 138 for SIGUSR1 (a scheduler's pre-emption warning).
"""

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


class RunFailed(RuntimeError):
    """The run cannot go on, for a reason the message explains with what to change."""


def out_of_memory(error: str, batch_size: int, accumulate: int, advice: str) -> RunFailed:
    """`error`: torch's message's first line; `advice`: what batch.effective would choose (batch_fit.suggestion)."""
    smaller = max(batch_size // 2, 1)
    return RunFailed(
        f"out of device memory with data.batch_size={batch_size} ({error}); try a smaller data.batch_size, e.g. "
        f"data.batch_size={smaller} trainer.accumulate_grad_batches={accumulate * 2}, which keeps the effective "
        f"batch; {advice}"
    )
