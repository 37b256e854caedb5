"""What several CPU processes cost, said before a run pays it: DDP on a CPU gives the same result as one process
(docs/strategies.md) and, at the sizes the lab measured, takes longer; more processes than cores take turns on them.
"""

import os
import sys

import lightning as L

from experiments.run.log import say

# docs/benchmarks.md "DDP on CPU" (python scripts/benchmark.py --ddp, 2-core VM, d=1000 features, 2 processes over
# gloo, the worse of two runs): ms an optimizer step, one process against DDP x2, by global batch.
MEASURED_FEATURES = 1000
MEASURED = {64: (0.265, 1.610), 4096: (3.169, 5.122)}  # batch: (one process, DDP x2)


def cores() -> int:
    """The cores this process may run on (a container's or SLURM's share, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_processes_note(processes: int, nodes: int, batch_size: int, features: int, available: int) -> str | None:
    """One line when `processes` CPU processes a node (DDP) cost more than they give; None when they do not."""
    setting = f"trainer.devices={processes}" + (f" x trainer.num_nodes={nodes}" if nodes > 1 else "")
    docs = "docs/strategies.md#ddp-on-a-cpu"
    if processes > available:
        return (
            f"note: {setting} starts {processes} CPU processes on {available} cores: they take turns on the cores "
            f"and every step waits for the slowest (4 processes on 2 cores ran 6x slower than trainer.devices=1); "
            f"the result is the same with fewer ({docs})"
        )
    largest = max(MEASURED)
    if processes > 1 and batch_size * features <= largest * MEASURED_FEATURES:
        ratios = [ddp / one for one, ddp in MEASURED.values()]
        return (
            f"note: {setting} runs DDP over CPU processes, which gives the same result as one process and, up to "
            f"batch {largest:,} x {MEASURED_FEATURES:,} features (this run: {batch_size:,} x {features:,}), took "
            f"{min(ratios):.1f}x to {max(ratios):.1f}x as long a step as trainer.devices=1 in the lab's measurements: "
            f"a study of DDP, not a speed-up ({docs})"
        )
    return None


def say_what_cpu_processes_cost(trainer: L.Trainer, batch_size: int, features: int) -> None:
    """The note, on stderr and in train.log, when the trainer runs CPU processes that cost more than they give."""
    if trainer.strategy.root_device.type == "cpu" and trainer.world_size > 1:
        note = cpu_processes_note(trainer.num_devices, trainer.num_nodes, batch_size, features, cores())
        if note:
            say(note, file=sys.stderr)
