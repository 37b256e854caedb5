"""What each speed option of the project's path is worth: the path with one option undone, against the raw loop.

    python scripts/benchmark_options.py                  # CPU, d=1000, B = 64 and 1024, 3 repetitions (~4 min)
    python scripts/benchmark_options.py --threads 1      # one torch thread: steadier on a busy machine
    python scripts/benchmark_options.py --quick          # a tiny smoke run

Each row is the project's path (scripts/benchmark_loop.py's `project_run`) with one option undone, the options being
those that issue 17 weighed (docs/benchmarks.md): Lightning's loop a step an iteration instead of windows of
steps, windows that end at every log step (`window_s=0`, as before issue 40), a fresh batch tensor each step
instead of reused ones, `self.log` for train/loss, Lightning's own TensorBoardLogger, a progress-bar redraw on every
log step, /proc's status file opened each log step. The raw loop and every variant run in each of `--reps`
interleaved repetitions (the variants' order rotating); each figure is its minimum. An option's worth is its row
against the first (nothing undone).
"""

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

import benchmark_loop  # scripts/, beside this file
import torch

from experiments.data import SyntheticRegression
from experiments.data.loader import StepWindows
from experiments.training import log_steps, module, perf, windows


@contextlib.contextmanager
def patched(owner, name: str, value):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def one_step_windows():
    """Lightning's loop runs every optimizer step (a window of one step, as under DDP)."""
    position = windows.position
    return patched(module.windows, "position", lambda trainer, *args: position(trainer, True))


def fresh_batches():
    """Every batch a fresh tensor (`x[index]`), as before."""
    init = StepWindows.__init__

    def no_reuse(self, loader):
        init(self, loader)
        loader.reuse = False

    return patched(StepWindows, "__init__", no_reuse)


def self_log():
    """train/loss through Lightning's `self.log` (its result collection and its logger connector's writes)."""

    def log_steps(self, logged):
        for _, loss, _ in logged:
            self.log("train/loss", loss)

    return patched(module.Regressor, "_log_steps", log_steps)


def redraw_every_log_step():
    return patched(log_steps.LogStepProgressBar, "REDRAW_EVERY_S", 0.0)


def status_by_path():
    return patched(perf, "_own_status", lambda: Path("/proc/self/status").read_bytes())


LIGHTNING_LOGGER = ["logger._target_=lightning.pytorch.loggers.TensorBoardLogger", "~logger.max_queue"]
VARIANTS = {  # name: (extra overrides, the patch that undoes the option)
    "all options": ([], contextlib.nullcontext),
    "a step an iteration": ([], one_step_windows),
    "a window a log step": (["window_s=0"], contextlib.nullcontext),
    "fresh batch tensors": ([], fresh_batches),
    "self.log train/loss": ([], self_log),
    "Lightning's TensorBoardLogger": (LIGHTNING_LOGGER, contextlib.nullcontext),
    "redraw every log step": ([], redraw_every_log_step),
    "/proc status by path": ([], status_by_path),
}


def measure(args, data, batch_size: int) -> list[dict]:
    cpu = torch.device("cpu")
    x, y = data.x_train, data.y_train
    steps = benchmark_loop.choose_steps(x, y, batch_size, cpu, args, "device")
    overrides = [
        f"data.num_samples={args.samples}",
        f"data.num_features={args.features}",
        f"data.batch_size={batch_size}",
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=-1",
    ]
    raws, runs = [], {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for rep in range(args.reps):
        val = (data.x_val, data.y_val)
        raws.append(benchmark_loop.raw_loop(x, y, batch_size, steps, cpu, "32-true", "device", val))
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            extra, undo = VARIANTS[name]
            with undo():
                runs[name].append(benchmark_loop.project_run([*overrides, *extra], steps)[0])
    raw = min(raws)
    rows = []
    for name, metrics in runs.items():
        best = min(metrics, key=lambda m: m["step_time_ms"])
        rows.append({
            "B": batch_size, "undone": name, "steps": steps, "raw_ms": raw, "project_ms": best["step_time_ms"],
            "ratio": best["step_time_ms"] / raw, "data_ms": best["data_ms"], "compute_ms": best["compute_ms"],
            "framework_ms": best["framework_ms"],
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="64,1024")
    parser.add_argument("--features", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--min-steps", type=int, default=60)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch CPU threads of both paths (default: torch's)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.features, args.samples, args.seconds, args.reps, args.batch_sizes = 16, 2048, 0.1, 1, "64"
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    data = SyntheticRegression(num_samples=args.samples, num_features=args.features, seed=0)
    data.setup()
    print(
        f"gpu-lab options: torch {torch.__version__}, {torch.get_num_threads()} CPU threads, d={args.features}, "
        f"{args.samples} samples, {args.reps} interleaved repetitions (minimum of each), load average "
        f"{os.getloadavg()[0]:.1f} at the start"
    )
    rows = []
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        rows += measure(args, data, batch_size)
        print(f"  measured B={batch_size}", file=sys.stderr, flush=True)
    columns = [
        ("B", "{}"), ("undone", "{}"), ("steps", "{}"), ("raw_ms", "{:.3f}"), ("project_ms", "{:.3f}"),
        ("ratio", "{:.2f}"), ("data_ms", "{:.3f}"), ("compute_ms", "{:.3f}"), ("framework_ms", "{:.3f}"),
    ]  # fmt: skip
    cells = [[c for c, _ in columns]] + [[f.format(r[c]) for c, f in columns] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    print("\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells))
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
