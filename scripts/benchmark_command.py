"""The project's command line as a user meets it, for `python scripts/benchmark.py`: start-up against the bare import,
peak memory against the dataset, `--help`, and what writing last.ckpt at each epoch's end costs; each from
`python train.py` (or eval.py, predict.py) in a subprocess.
"""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.run.layout import RunPaths
from experiments.training.perf import peak_resident_mb

ROOT = Path(__file__).resolve().parents[1]


def cli_run(overrides: list[str]) -> tuple[dict, float, float]:
    """`python train.py OVERRIDES` as a user types it: (its metrics.json, wall seconds, peak RSS in MB).

    The peak is the whole process's, data set-up included: sampled every 10 ms from here, because the run's
    own `peak_memory_mb` counts from the start of training only.
    """
    with tempfile.TemporaryDirectory() as run_dir, tempfile.TemporaryFile("w+") as stderr:
        command = [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"]
        start = time.perf_counter()
        child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        peak = 0.0
        while child.poll() is None:
            peak = max(peak, (peak_resident_mb(child.pid) or 0.0))
            time.sleep(0.01)
        seconds = time.perf_counter() - start
        if child.returncode:
            stderr.seek(0)
            sys.exit(f"error: {' '.join(command)} failed:\n{stderr.read()[-2000:]}")
        return json.loads(RunPaths(run_dir).metrics.read_text()), seconds, peak


def command_lines(args) -> list[str]:
    """Start-up against the bare import, peak memory against the dataset, and `--help`, from the command line."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, lightning"], check=True)
    import_s = time.perf_counter() - start
    common = [f"data.num_features={args.features}", "trainer.max_steps=20", "trainer.max_epochs=-1"]
    run, run_s, peak = cli_run([*common, f"data.num_samples={args.samples}", "data.batch_size=64"])
    small = max(256, args.samples // 64)
    _, _, baseline = cli_run([*common, f"data.num_samples={small}", "data.batch_size=64"])
    dataset_mb = args.samples * (args.features + 1) * 4 / 2**20
    bound = 2 * dataset_mb + baseline
    limit = import_s + 3
    helps = {}
    for script in ("train.py", "eval.py", "predict.py"):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            subprocess.run([sys.executable, script, "--help"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            times.append(time.perf_counter() - start)
        helps[script] = min(times)
    slowest = max(helps.values())
    return [
        f"start-up: `python -c 'import torch, lightning'` {import_s:.1f} s; `python train.py` (this data) "
        f"to its first step {run['startup_s']:.1f} s, whole command {run_s:.1f} s",
        f"  target: start-up <= import + 3 s = {limit:.1f} s: {'met' if run['startup_s'] <= limit else 'MISSED'}",
        f"memory: dataset {dataset_mb:.0f} MB; peak RSS of that command {peak:.0f} MB (while training: "
        f"{run['peak_memory_mb']:.0f} MB); framework baseline (same command, {small} samples) {baseline:.0f} MB",
        f"  target: peak <= 2 x dataset + baseline = {bound:.0f} MB: {'met' if peak <= bound else 'MISSED'}",
        "help: " + ", ".join(f"`python {s} --help` {t:.2f} s" for s, t in helps.items()) + " (the least of 3)",
        f"  target: under 1.5 s: {'met' if slowest < 1.5 else 'MISSED'}",
    ]


def checkpoint_cost(args) -> list[str]:
    """What writing last.ckpt at every epoch's end costs (the default, `checkpoint.every_n_epochs=1`): the mean
    time of one save, written whole and flushed to disk, against the training time of the epoch it ends."""
    data = [f"data.num_features={args.features}", f"data.num_samples={args.samples}"]
    run, _, _ = cli_run([*data, "trainer.max_epochs=3"])
    steps = run["global_step"] // max(run["epochs"], 1)
    epoch_ms = steps * run["step_time_ms"]
    return [
        f"last.ckpt at each epoch's end (d={args.features}, B={run['global_batch_size']}, {steps} steps an epoch): "
        f"{run['checkpoint_save_ms']:.1f} ms a save (mean of {run['checkpoints_saved']}), "
        f"{100 * run['checkpoint_save_ms'] / epoch_ms:.1f}% of the epoch's {epoch_ms:.0f} ms of training steps"
    ]
