"""The seed's plain PyTorch loop against the project's Lightning path, timed side by side in one run.

    python scripts/benchmark.py                  # CPU, d=1000, B = 64, 1024, 8192 (about 3 minutes on 2 cores)
    python scripts/benchmark.py --quick          # a tiny smoke run of every measurement (tests use it)
    python scripts/benchmark.py --threads 1      # steadier on a busy machine: no thread waits at a barrier
    python scripts/benchmark.py --device cuda    # the same on a GPU, with 16-mixed rows
    python scripts/benchmark.py --gpu-sweep      # CPU vs GPU, host vs device-resident data, B = 64 ... 65536

The raw loop is the seed's: shuffled batches by `randperm` and index slicing, zero_grad, forward, MSE,
backward, SGD step, on the same data, batch, device and precision. The Lightning path is the project's own
`experiments.commands.train.train` on the real config (default logging to TensorBoard, progress bar on, validation
each epoch), shrunk only by overrides. Both are timed the same way: the clock starts after 5 warm-up steps
and is read every `trainer.log_every_n_steps` steps; a path's step time is the median of those windows
(robust to other work on a shared machine), and the mean over all of them is shown beside it. Lightning's
windows are its own `perf/step_time_ms` points, read back from the run's TensorBoard file, and leave out
validation. The raw loop runs once before and once after the Lightning run, so drifting machine load hits
both. Start-up and memory are measured on the command line, in subprocesses.
"""

import argparse
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning
import torch
from hydra import compose, initialize_config_dir
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from experiments.commands.entry import CONFIG_DIR
from experiments.commands.train import train
from experiments.data import SyntheticRegression
from experiments.data.loader import BatchLoader, EpochShuffle
from experiments.perf import peak_resident_mb, synchronized_clock
from experiments.run.layout import RunPaths

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 5  # PerfMonitor's warm-up steps
WINDOW = 50  # the default trainer.log_every_n_steps: PerfMonitor's windows
TARGETS = {64: (3.0, 1.5), 1024: (1.5, 1.1)}  # B: (Lightning/raw step time required, goal), fp32 on CPU
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def raw_loop(x, y, batch_size: int, steps: int, device: torch.device, precision: str) -> list[tuple[float, int]]:
    """The seed's loop; returns (time, steps done) marks after the warm-up and every WINDOW steps.

    `x` and `y` live on the host (each batch is copied with `.to(device)`, as in the seed) or on `device`.
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], y.shape[1]).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    criterion = torch.nn.MSELoss()
    scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
    # fp32 runs the seed's loop as written; mixed precision adds autocast (and a gradient scaler for fp16).
    autocast = contextlib.nullcontext()
    if precision in AUTOCAST:
        autocast = torch.autocast(device.type, dtype=AUTOCAST[precision])
    marks, step = [], 0
    while step < steps:
        order = torch.randperm(len(x), device=x.device)
        for i in range(len(x) // batch_size):
            index = order[i * batch_size : (i + 1) * batch_size]
            xb, yb = x[index].to(device), y[index].to(device)
            optimizer.zero_grad()
            with autocast:
                loss = criterion(model(xb), yb)
            if scaler:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            step += 1
            if step == WARMUP or (step > WARMUP and step % WINDOW == 0) or step == steps:
                marks.append((synchronized_clock(device), step))
            if step == steps:
                break
    return marks


def windows_ms(marks: list[tuple[float, int]]) -> list[float]:
    """Step time of each full window between marks (the last, partial one is left out, as in TensorBoard)."""
    pairs = zip(marks, marks[1:], strict=False)
    return [1e3 * (t1 - t0) / (s1 - s0) for (t0, s0), (t1, s1) in pairs if s1 % WINDOW == 0]


def mean_ms(marks: list[tuple[float, int]]) -> float:
    (t0, s0), (t1, s1) = marks[0], marks[-1]
    return 1e3 * (t1 - t0) / (s1 - s0)


class BareModule(lightning.LightningModule):
    """The least a LightningModule can be: Lightning's own loop, with nothing of this project's around it."""

    def __init__(self, features: int):
        super().__init__()
        self.net = torch.nn.Linear(features, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class StepClock(lightning.Callback):
    """The raw loop's marks, taken in Lightning's loop."""

    def __init__(self, device: torch.device):
        self.device, self.steps, self.marks = device, 0, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps += 1
        if self.steps == WARMUP or (self.steps > WARMUP and self.steps % WINDOW == 0):
            self.marks.append((synchronized_clock(self.device), self.steps))


def bare_lightning(x, y, batch_size: int, steps: int, device: torch.device, precision: str) -> list[tuple]:
    """Lightning as shipped, on the same batches, with no logger, progress bar, checkpoint or validation:
    what Lightning's loop costs by itself, so that the project's own share of the overhead shows."""
    step_clock = StepClock(device)
    trainer = lightning.Trainer(
        max_steps=steps, accelerator=device.type, devices=1, precision=precision, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[step_clock],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(BareModule(x.shape[1]), train_dataloaders=BatchLoader(x, y, batch_size, EpochShuffle(len(x), 0)))
    return step_clock.marks


def lightning_run(overrides: list[str]) -> tuple[list[float], float, dict]:
    """`experiments.commands.train.train` on the composed config: (window step times, mean step time, metrics)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    with tempfile.TemporaryDirectory() as run_dir:
        # The progress bar draws as in a terminal, into /dev/null; Lightning's notices would bury the table.
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            metrics = train(cfg, Path(run_dir))
        events = EventAccumulator(str(Path(run_dir) / "tensorboard")).Reload()
        windows = [event.value for event in events.Scalars("perf/step_time_ms")]
    return windows, metrics["step_time_ms"], metrics


def choose_steps(x, y, batch_size: int, device: torch.device, precision: str, seconds: float, least: int) -> int:
    """Enough steps for about `seconds` of the raw loop, in whole windows, at least `least`."""
    marks = raw_loop(x, y, batch_size, WARMUP + 20, device, precision)
    per_step = (marks[-1][0] - marks[0][0]) / 20
    steps = WARMUP + WINDOW * round(seconds / per_step / WINDOW)
    return max(least, min(steps, WARMUP + 40 * WINDOW))


def measure(args, data, device: torch.device, placement: str, batch_size: int, precision: str) -> dict:
    """One row: the raw loop, the Lightning path, the raw loop again."""
    on_device = placement == "device" and device.type != "cpu"
    pinned = placement == "pinned"
    x, y = (data.x_train.to(device), data.y_train.to(device)) if on_device else (data.x_train, data.y_train)
    steps = choose_steps(x, y, batch_size, device, precision, args.seconds, args.min_steps)
    raw_marks = [raw_loop(x, y, batch_size, steps, device, precision)]
    bare = statistics.median(windows_ms(bare_lightning(x, y, batch_size, steps, device, precision)))
    overrides = [
        f"data.num_samples={args.samples}",
        f"data.num_features={args.features}",
        f"data.batch_size={batch_size}",
        f"data.on_device={str(on_device).lower()}",
        f"data.pin_memory={str(pinned).lower()}",
        f"trainer.accelerator={device.type}",
        f"trainer.precision={precision}",
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=-1",
    ]
    lightning_windows, lightning_mean, metrics = lightning_run(overrides)
    raw_marks.append(raw_loop(x, y, batch_size, steps, device, precision))
    raw_windows = [w for marks in raw_marks for w in windows_ms(marks)]
    raw = statistics.median(raw_windows)
    light = statistics.median(lightning_windows)
    step_bytes = 8 * batch_size * args.features
    return {
        "device": device.type,
        "data": placement if device.type != "cpu" else "host",
        "precision": precision,
        "B": batch_size,
        "steps": steps,
        "raw_ms": raw,
        "bare_ms": bare,
        "lightning_ms": light,
        "bare_ratio": bare / raw,
        "ratio": light / raw,
        "ratio_mean": lightning_mean / statistics.mean(mean_ms(m) for m in raw_marks),
        "raw_GBps": step_bytes / raw / 1e6,
        "lightning_GBps": step_bytes / light / 1e6,
        "transfer_ms": metrics["transfer_ms"],
        # The project's step, broken down (metrics.json, steady state): framework_pct is Lightning's share.
        "data_ms": metrics["data_ms"],
        "compute_ms": metrics["compute_ms"],
        "framework_ms": metrics["framework_ms"],
        "framework_pct": 100 * metrics["framework_ms"] / metrics["step_time_ms"],
        "compute_vs_raw": metrics["compute_ms"] / raw,
        "data_device": metrics["data_device"],
    }


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


def startup_and_memory(args) -> list[str]:
    """Start-up against the bare import, and peak memory against the dataset, from the command line."""
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
    return [
        f"start-up: `python -c 'import torch, lightning'` {import_s:.1f} s; `python train.py` (this data) "
        f"to its first step {run['startup_s']:.1f} s, whole command {run_s:.1f} s",
        f"  target: start-up <= import + 3 s = {limit:.1f} s: {'met' if run['startup_s'] <= limit else 'MISSED'}",
        f"memory: dataset {dataset_mb:.0f} MB; peak RSS of that command {peak:.0f} MB (while training: "
        f"{run['peak_memory_mb']:.0f} MB); framework baseline (same command, {small} samples) {baseline:.0f} MB",
        f"  target: peak <= 2 x dataset + baseline = {bound:.0f} MB: {'met' if peak <= bound else 'MISSED'}",
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


def table(rows: list[dict]) -> list[str]:
    columns = [
        ("device", "{}"), ("data", "{}"), ("precision", "{}"), ("B", "{}"), ("steps", "{}"),
        ("raw_ms", "{:.3f}"), ("bare_ms", "{:.3f}"), ("lightning_ms", "{:.3f}"), ("bare_ratio", "{:.2f}"),
        ("ratio", "{:.2f}"), ("ratio_mean", "{:.2f}"),
        ("raw_GBps", "{:.2f}"), ("lightning_GBps", "{:.2f}"), ("transfer_ms", "{:.3f}"),
        ("data_ms", "{:.3f}"), ("compute_ms", "{:.3f}"), ("framework_ms", "{:.3f}"), ("framework_pct", "{:.0f}"),
        ("compute_vs_raw", "{:.2f}"),
    ]  # fmt: skip
    cells = [[name for name, _ in columns]] + [[fmt.format(row[name]) for name, fmt in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]


def verdicts(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        if row["device"] == "cpu" and row["precision"] == "32-true" and row["B"] in TARGETS:
            required, goal = TARGETS[row["B"]]
            verdict = "goal met" if row["ratio"] <= goal else "met" if row["ratio"] <= required else "MISSED"
            ratio = f"Lightning/raw {row['ratio']:.2f} (required <= {required}, goal {goal})"
            lines.append(f"target B={row['B']}: {ratio}: {verdict}")
    return lines


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batch-sizes", help="comma-separated global batch sizes (default: 64,1024,8192)")
    parser.add_argument("--features", type=int, default=1000, help="d, the number of features")
    parser.add_argument("--samples", type=int, default=40960, help="dataset size: train + validation (80/20)")
    parser.add_argument("--precisions", help="default: 32-true,bf16-mixed,16-mixed (16-mixed: CUDA only)")
    parser.add_argument("--seconds", type=float, default=2.0, help="raw-loop seconds per measurement")
    parser.add_argument("--min-steps", type=int, help=f"at least this many steps (default {WARMUP + 10 * WINDOW})")
    parser.add_argument("--threads", type=int, help="torch CPU threads of both paths (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that everything runs")
    parser.add_argument(
        "--gpu-sweep", action="store_true", help="CPU vs GPU, host vs device data, B = 64 ... 65536 (needs CUDA)"
    )
    args = parser.parse_args()
    if args.quick:
        args.features, args.samples, args.seconds = 16, 2048, 0.1
        args.batch_sizes, args.precisions = args.batch_sizes or "16,64", args.precisions or "32-true"
        args.min_steps = args.min_steps or WARMUP + 2 * WINDOW
    if args.gpu_sweep:
        args.device, args.samples = "cuda", 2 * 65536  # the largest batch needs 65536 training samples
        args.batch_sizes = args.batch_sizes or "64,256,1024,4096,16384,65536"
        # 30 rows within a few minutes of device time: the CPU rows at the largest batches are slow.
        args.seconds, args.min_steps = 1.0, args.min_steps or WARMUP + 2 * WINDOW
    args.batch_sizes = args.batch_sizes or "64,1024,8192"
    args.min_steps = args.min_steps or WARMUP + 10 * WINDOW
    return args


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda (or --gpu-sweep) needs a CUDA GPU; none is visible to PyTorch")
    for name in ("lightning.pytorch", "lightning.fabric"):  # their start-up notices would bury the table
        logging.getLogger(name).setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    gpu = torch.device("cuda") if args.device == "cuda" else None
    precisions = (args.precisions or "32-true,bf16-mixed,16-mixed").split(",")
    data = SyntheticRegression(num_samples=args.samples, num_features=args.features, seed=0)
    data.setup()
    if max(batch_sizes) > len(data.x_train):
        sys.exit(f"error: --batch-sizes {max(batch_sizes)} exceeds the {len(data.x_train)} training samples")

    print(
        f"gpu-lab benchmark: torch {torch.__version__}, lightning {lightning.__version__}, "
        f"{torch.get_num_threads()} CPU threads" + (f", {torch.cuda.get_device_name(gpu)}" if gpu else "")
    )
    print(
        f"dataset: {args.samples} x {args.features} float32 + 1 target = "
        f"{args.samples * (args.features + 1) * 4 / 2**20:.0f} MB ({len(data.x_train)} train, {len(data.x_val)} val)"
    )
    print(
        "step time: median of windows of 50 steps after 5 warm-up steps; ratio = lightning/raw (ratio_mean: "
        "over all windows); bare = Lightning as shipped with no logger, progress bar, checkpoint or validation; "
        "GB/s = 8*B*d bytes / step time: the float32 batch, read by the forward product and again by the "
        "weight gradient; the project's step = data_ms (forming the batch) + transfer_ms + compute_ms (forward, "
        "backward, update) + framework_ms (the rest: Lightning), framework_pct its share; compute_vs_raw = "
        "compute_ms / raw_ms (the raw step is all compute and slicing); data: host = pageable host memory, "
        "pinned = host, batches gathered into pinned memory, device = resident on the GPU"
    )
    if "16-mixed" in precisions and not gpu:
        print("16-mixed: skipped on CPU (Lightning runs float16 mixed precision on CUDA only)")
        precisions.remove("16-mixed")
    if args.gpu_sweep:
        setups = [(torch.device("cpu"), "host", "32-true"), (gpu, "host", "32-true"), (gpu, "pinned", "32-true")]
        setups += [(gpu, "device", "32-true")]
        setups += [(gpu, "device", p) for p in precisions if p != "32-true"]
    else:
        setups = [(gpu or torch.device("cpu"), "device", p) for p in precisions]
    rows = []
    for device, placement, precision in setups:
        for batch_size in batch_sizes:
            rows.append(measure(args, data, device, placement, batch_size, precision))
            print(f"  measured {device.type} {placement} {precision} B={batch_size}", file=sys.stderr, flush=True)
    print()
    print("\n".join(table(rows)))
    # The targets are set for the seed's width, d=1000.
    print("\n".join(verdicts(rows)) if args.features == 1000 else "targets: judged at d=1000 only")
    if not args.gpu_sweep:
        print("\n".join(startup_and_memory(args)))
        print("\n".join(checkpoint_cost(args)))


if __name__ == "__main__":
    main()
