"""The seed's loop as an expert writes it, against the project's Lightning path, side by side in one run.

    python scripts/benchmark.py                  # CPU, d=1000, B = 64, 1024, 16384, 5 repetitions (~4 min, 2 cores)
    python scripts/benchmark.py --quick          # a tiny smoke run of every measurement (tests use it)
    python scripts/benchmark.py --threads 1      # one torch thread for both paths
    python scripts/benchmark.py --device cuda    # the same on a GPU (data on the device), with bf16/16-mixed rows
    python scripts/benchmark.py --gpu-sweep      # CPU vs GPU, pageable, pinned and device data, B = 64 ... 65536
    python scripts/benchmark.py --ddp            # `train.py trainer.devices=2` vs raw DDP x2, CPU, gloo (~25 min)
    python scripts/benchmark.py --ddp --quick    # its tiny smoke run (tests use it)

raw: the seed's loop in plain PyTorch as an expert writes it, on the same data, batch, device and precision:
each epoch a `randperm`, batches gathered with `index_select` into two reused tensors, then zero_grad, forward,
`mse_loss`, backward, `SGD.step`; after each epoch the validation split's MSE, as the project validates (a pass
over 50 MB of validation data at d=1000 slows the next steps of either loop by about 5%: the caches it evicts).
project: `experiments.commands.train.train` on the real config, shrunk only by overrides: TensorBoard logging,
the progress bar (drawn into /dev/null), a validation each epoch, last.ckpt.

A path's step time is its steady state: the raw loop's (T(N) - T(N1)) / (N - N1) with N1 = N / 5 steps, the
project's own `step_time_ms` (PerfMonitor: after 5 warm-up steps, validation and last.ckpt's saves left out,
their cost printed on its own line), checked against the benchmark's own clock on the same run (`check_ms`: a
callback's marks from step N / 5 on, validation and saves taken out). The two paths run the same number of
steps, one after the other, in `--reps` interleaved repetitions (raw first, then the project first, ...): each
side's figure is its minimum, the least disturbed by the other work of a shared machine. Start-up, memory and
`--help` are measured on the command line, in subprocesses.
"""

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import benchmark_ddp  # scripts/, beside this file
import lightning
import torch
from hydra import compose, initialize_config_dir

from experiments import internals
from experiments.commands.entry import CONFIG_DIR
from experiments.commands.train import train
from experiments.data import SyntheticRegression
from experiments.run.layout import RunPaths
from experiments.training.clocks import synchronized_clock
from experiments.training.last_checkpoint import LastCheckpoint
from experiments.training.perf import peak_resident_mb

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {64: 1.25, 1024: 1.10}  # B: the project's step at most this times the raw loop's (CPU, fp32, d=1000)
FRAMEWORK_SHARE = {16384: 0.10}  # B: framework_ms at most this share of the project's step
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def raw_loop(x, y, batch_size: int, steps: int, device: torch.device, precision: str, placement: str, val=None):
    """Milliseconds a step of the seed's loop, steady state: from step steps // 5 to the last.

    `val` (x, y): after every epoch the MSE of the validation split, in batches of `batch_size`, as the project
    validates; its time is left out, as the project's is.

    `x` and `y` are on the device (placement "device"), or on the host: pageable (each batch gathered into a
    reused host tensor, then copied into a reused device tensor) or pinned (two pinned tensors in turn, each
    reused once its copy is done, so that a copy overlaps the next gather).
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], y.shape[1]).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
    autocast = torch.autocast(device.type, dtype=AUTOCAST[precision]) if precision in AUTOCAST else None
    pinned = placement == "pinned"
    shapes = [(batch_size, x.shape[1]), (batch_size, y.shape[1])]
    host = [tuple(torch.empty(shape, pin_memory=pinned) for shape in shapes) for _ in range(2 if pinned else 1)]
    copied = [None] * len(host)  # the event after each host pair's last copy (pinned)
    xb, yb = torch.empty(batch_size, x.shape[1], device=device), torch.empty(batch_size, y.shape[1], device=device)
    start, step = steps // 5, 0
    while True:
        order = torch.randperm(len(x), device=x.device)
        for i in range(len(x) // batch_size):
            index = order[i * batch_size : (i + 1) * batch_size]
            if x.device.type == torch.device(device).type:
                torch.index_select(x, 0, index, out=xb)
                torch.index_select(y, 0, index, out=yb)
            else:
                k = step % len(host)
                if copied[k] is not None:
                    copied[k].synchronize()
                hx, hy = host[k]
                torch.index_select(x, 0, index, out=hx)
                torch.index_select(y, 0, index, out=hy)
                xb.copy_(hx, non_blocking=pinned)
                yb.copy_(hy, non_blocking=pinned)
                if pinned:
                    copied[k] = torch.cuda.Event()
                    copied[k].record()
            optimizer.zero_grad()
            with autocast or contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(model(xb), yb)
            if scaler:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            step += 1
            if step == start:
                began = synchronized_clock(device)
            if step == steps:
                return 1e3 * (synchronized_clock(device) - began) / (steps - start)
        if val is not None:
            validating = synchronized_clock(device)
            with torch.no_grad():
                mse = sum(torch.nn.functional.mse_loss(model(a), b, reduction="sum")
                          for a, b in zip(val[0].split(batch_size), val[1].split(batch_size), strict=True))  # fmt: skip
                mse.item()
            if step >= start:
                began += synchronized_clock(device) - validating


class StepClock(lightning.Callback):
    """The benchmark's own clock on the project's run: a mark at the end of every window of steps (where
    Lightning's hooks run, training.windows) and the time spent in validation and saving last.ckpt (the run's
    own count of it), for `check_ms`."""

    latest = None  # the clock of the latest run: the config builds it, the benchmark reads it

    def __init__(self):
        self.marks, self.validating, self.in_validation = [], None, 0.0
        StepClock.latest = self

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        processed = internals.micro_batches_done(trainer)[1]  # the window's micro-batches too
        saver = next(c for c in trainer.callbacks if isinstance(c, LastCheckpoint))
        paused = self.in_validation + saver.seconds_saving  # validation and last.ckpt's saves are not steps
        self.marks.append((synchronized_clock(pl_module.device), processed, paused))

    def on_validation_start(self, trainer, pl_module):
        self.validating = synchronized_clock(pl_module.device)

    def on_validation_end(self, trainer, pl_module):
        self.in_validation += synchronized_clock(pl_module.device) - self.validating

    def step_ms(self, steps: int) -> float:
        """Milliseconds a step from step steps // 5 to the last mark, validation and saves left out."""
        (t0, s0, v0) = next(m for m in self.marks if m[1] >= steps // 5)
        (t1, s1, v1) = self.marks[-1]
        return 1e3 * ((t1 - t0) - (v1 - v0)) / max(s1 - s0, 1)


CLOCK = f"{__name__}.StepClock"  # instantiated by the project's callbacks group (+callbacks.benchmark_clock)


def project_run(overrides: list[str], steps: int) -> tuple[dict, float]:
    """`experiments.commands.train.train` on the composed config: (its metrics, the outside clock's step ms)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"+callbacks.benchmark_clock._target_={CLOCK}"])
    with tempfile.TemporaryDirectory() as run_dir:
        # The progress bar draws as in a terminal, into /dev/null; Lightning's notices would bury the table.
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            metrics = train(cfg, Path(run_dir))
    return metrics, StepClock.latest.step_ms(steps)


def choose_steps(x, y, batch_size: int, device: torch.device, args, placement: str) -> int:
    """Enough steps for about `--seconds` of the raw loop, at least `--min-steps`."""
    per_step = raw_loop(x, y, batch_size, 50, device, "32-true", placement) / 1e3
    return max(args.min_steps, round(args.seconds / per_step))


def measure(args, data, device: torch.device, placement: str, batch_size: int, precision: str) -> dict:
    """One row: `--reps` interleaved repetitions of the raw loop and the project, each side's minimum."""
    on_device = placement == "device" and device.type != "cpu"
    x, y = (data.x_train.to(device), data.y_train.to(device)) if on_device else (data.x_train, data.y_train)
    val = (data.x_val.to(device), data.y_val.to(device))  # the project validates on the device too
    steps = choose_steps(x, y, batch_size, device, args, placement)
    overrides = [
        f"data.num_samples={args.samples}",
        f"data.num_features={args.features}",
        f"data.batch_size={batch_size}",
        f"data.on_device={str(on_device).lower()}",
        f"data.pin_memory={str(placement == 'pinned').lower()}",
        f"trainer.accelerator={device.type}",
        f"trainer.precision={precision}",
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=-1",
    ]
    raws, runs = [], []
    for rep in range(args.reps):
        for side in ("raw", "project") if rep % 2 == 0 else ("project", "raw"):
            if side == "raw":
                raws.append(raw_loop(x, y, batch_size, steps, device, precision, placement, val))
            else:
                runs.append(project_run(overrides, steps))
    raw = min(raws)
    metrics, check = min(runs, key=lambda run: run[0]["step_time_ms"])
    project = metrics["step_time_ms"]
    return {
        "device": device.type,
        "data": placement if device.type != "cpu" else "host",
        "precision": precision,
        "B": batch_size,
        "steps": steps,
        "raw_ms": raw,
        "project_ms": project,
        "ratio": project / raw,
        "check_ms": check,
        "raw_spread": max(raws) / raw,  # how much the repetitions of a side differed: the machine's noise
        "project_spread": max(m["step_time_ms"] for m, _ in runs) / project,
        "data_ms": metrics["data_ms"],
        "transfer_ms": metrics["transfer_ms"],
        "compute_ms": metrics["compute_ms"],
        "framework_ms": metrics["framework_ms"],
        "framework_pct": 100 * metrics["framework_ms"] / project,
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


COLUMNS = [
    ("device", "{}"), ("data", "{}"), ("precision", "{}"), ("B", "{}"), ("steps", "{}"), ("raw_ms", "{:.3f}"),
    ("project_ms", "{:.3f}"), ("ratio", "{:.2f}"), ("check_ms", "{:.3f}"), ("raw_spread", "{:.2f}"),
    ("project_spread", "{:.2f}"), ("data_ms", "{:.3f}"), ("transfer_ms", "{:.3f}"), ("compute_ms", "{:.3f}"),
    ("framework_ms", "{:.3f}"), ("framework_pct", "{:.1f}"),
]  # fmt: skip


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
    cells = [[name for name, _ in COLUMNS]] + [[fmt.format(row[name]) for name, fmt in COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]


def verdicts(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        if row["device"] != "cpu" or row["precision"] != "32-true":
            continue
        if row["B"] in TARGETS:
            bound = TARGETS[row["B"]]
            verdict = "met" if row["ratio"] <= bound else "MISSED"
            lines.append(f"target B={row['B']}: project/raw {row['ratio']:.2f} (at most {bound}): {verdict}")
        if row["B"] in FRAMEWORK_SHARE:
            bound = FRAMEWORK_SHARE[row["B"]]
            verdict = "met" if row["framework_pct"] <= 100 * bound else "MISSED"
            lines.append(
                f"target B={row['B']}: framework_ms {row['framework_pct']:.1f}% of a step "
                f"(under {100 * bound:.0f}%): {verdict}"
            )
    return lines


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batch-sizes", help="comma-separated global batch sizes (default: 64,1024,16384)")
    parser.add_argument("--features", type=int, default=1000, help="d, the number of features")
    parser.add_argument("--samples", type=int, default=65536, help="dataset size: train + validation (80/20)")
    parser.add_argument("--precisions", help="default: 32-true on the CPU; 32-true,bf16-mixed,16-mixed on a GPU")
    parser.add_argument("--seconds", type=float, default=3.0, help="about this long a run of the raw loop")
    parser.add_argument("--min-steps", type=int, default=60, help="at least this many steps a run")
    # Five: a burst of a shared machine's other work seldom hits all five runs of one side.
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions of each side")
    parser.add_argument("--threads", type=int, help="torch CPU threads of both paths (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that everything runs")
    parser.add_argument("--ddp", action="store_true", help="DDP x2 against raw DDP x2 (scripts/benchmark_ddp.py)")
    parser.add_argument(
        "--gpu-sweep", action="store_true", help="CPU vs GPU, host vs device data, B = 64 ... 65536 (needs CUDA)"
    )
    args = parser.parse_args()
    if args.ddp:
        return args
    if args.quick:
        args.features, args.samples, args.seconds, args.reps = 16, 2048, 0.1, 2
        args.batch_sizes, args.precisions = args.batch_sizes or "16,64", args.precisions or "32-true"
    if args.gpu_sweep:
        args.device, args.samples = "cuda", 2 * 65536  # the largest batch needs 65536 training samples
        args.batch_sizes = args.batch_sizes or "64,256,1024,4096,16384,65536"
        args.seconds, args.reps = 1.0, 2  # 30 rows in a few minutes of device time
    args.batch_sizes = args.batch_sizes or "64,1024,16384"
    args.precisions = args.precisions or ("32-true,bf16-mixed,16-mixed" if args.device == "cuda" else "32-true")
    return args


def main() -> None:
    args = parse_args()
    if args.ddp:
        benchmark_ddp.main(args)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda (or --gpu-sweep) needs a CUDA GPU; none is visible to PyTorch")
    for name in ("lightning.pytorch", "lightning.fabric"):  # their start-up notices would bury the table
        logging.getLogger(name).setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    gpu = torch.device("cuda") if args.device == "cuda" else None
    precisions = args.precisions.split(",")
    data = SyntheticRegression(num_samples=args.samples, num_features=args.features, seed=0)
    data.setup()
    if max(batch_sizes) > len(data.x_train):
        sys.exit(f"error: --batch-sizes {max(batch_sizes)} exceeds the {len(data.x_train)} training samples")

    print(
        f"gpu-lab benchmark: torch {torch.__version__}, lightning {lightning.__version__}, "
        f"{torch.get_num_threads()} CPU threads" + (f", {torch.cuda.get_device_name(gpu)}" if gpu else "")
        + f", load average {os.getloadavg()[0]:.1f} at the start"
    )  # fmt: skip
    print(
        f"dataset: {args.samples} x {args.features} float32 + 1 target = "
        f"{args.samples * (args.features + 1) * 4 / 2**20:.0f} MB ({len(data.x_train)} train, {len(data.x_val)} val)"
    )
    print(
        f"each row: {args.reps} interleaved repetitions of each side, its minimum; raw_ms: the seed's loop (an "
        "expert's: index_select into reused tensors); project_ms: experiments.commands.train.train's own "
        "step_time_ms (steady state, validation and last.ckpt saves left out); ratio = project_ms / raw_ms; "
        "check_ms: the same run "
        "on the benchmark's clock; *_spread: slowest / fastest repetition; the project's step = data_ms + "
        "transfer_ms + compute_ms + framework_ms (the rest: Lightning's loop, callbacks, logging), framework_pct "
        "its share; data: host = pageable host memory, pinned = host, batches in pinned memory, device = on the GPU"
    )
    if "16-mixed" in precisions and not gpu:
        print("16-mixed: skipped on CPU (Lightning runs float16 mixed precision on CUDA only)")
        precisions.remove("16-mixed")
    if args.gpu_sweep:
        setups = [(torch.device("cpu"), "host", "32-true"), (gpu, "host", "32-true"), (gpu, "pinned", "32-true")]
        setups += [(gpu, "device", p) for p in precisions]
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
        print("\n".join(command_lines(args)))
        print("\n".join(checkpoint_cost(args)))
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
