"""python scripts/benchmark_log_interval.py [--reps 5] [--intervals 50 10]

The default problem at two logging intervals (`trainer.log_every_n_steps`), in one process, interleaved: each run's
own steady-state step_time_ms (metrics.json: warm-up, validation and saves left out), the second interval's over the
first's paired within each repetition, median and range. The interval sets how often Lightning's loop runs (a window
of steps ends at each log step), how often perf/* figures are read and train/loss is written (docs/speed.md); it does
not change the maths: each run's val_mse is printed, and is the same at every interval.
"""

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from experiments.commands.entry import CONFIG_DIR
from experiments.commands.train import train


def run(interval: int, root: Path) -> dict:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(
            "config", overrides=[f"trainer.log_every_n_steps={interval}", "trainer.enable_progress_bar=false"]
        )
    return train(cfg, Path(tempfile.mkdtemp(prefix=f"log{interval}_", dir=root)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--intervals", type=int, nargs=2, default=[50, 10])
    args = parser.parse_args()
    first, second = args.intervals
    print(f"log interval {second} against {first}: default problem, {args.reps} interleaved repetitions; "
          f"load average {os.getloadavg()[0]:.1f} at the start")  # fmt: skip
    ratios = []
    with tempfile.TemporaryDirectory() as root:
        for rep in range(args.reps):
            order = (first, second) if rep % 2 == 0 else (second, first)
            step = {}
            for interval in order:
                m = run(interval, Path(root))
                step[interval] = m["step_time_ms"]
                print(f"  rep {rep} interval {interval:>3}: step_time_ms {m['step_time_ms']:.4f}  framework_ms "
                      f"{m['framework_ms']:.4f}  val_mse {m['val_mse']:.7g}")  # fmt: skip
            ratios.append(step[second] / step[first])
    print(f"step_time_ms at {second} / at {first}: median {statistics.median(ratios):.3f}, range "
          f"{min(ratios):.3f}-{max(ratios):.3f}; load average {os.getloadavg()[0]:.1f} at the end")  # fmt: skip


if __name__ == "__main__":
    main()
