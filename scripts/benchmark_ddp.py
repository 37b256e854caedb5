"""`python scripts/benchmark.py --ddp`: the project's `python train.py trainer.devices=2` against an expert's raw DDP
loop (scripts/raw_ddp.py), and against one device, on the CPU over gloo.

Whole processes, timed from the outside: a side's time a step is the difference of two run lengths divided by the
difference of their steps (start-up, data, the exact optimum for metrics.json cancel out). Each repetition runs
every side at both lengths, the sides in a rotated order; the ratio project / raw is taken within a repetition
(pairing runs that met the same load), and the median over `--reps` repetitions is reported with its least and
greatest. Beside it, the project's own figures from the long run's metrics.json (medians): `step_time_ms` and its
parts, and `clock`: its step_time_ms / the outside clock's step (the breakdown tells the truth when near 1).
Beside them the two runs' own clocks (the raw ranks' steady state, the project's step_time_ms), paired the same way
(`own_ratio`): start-up, whose time varies most on a shared machine, stays out of it.
The project runs as a user types it (TensorBoard, progress bar, last.ckpt at each epoch's end), with no validation.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# Long differences: a whole process's start-up (imports, data, the exact optimum) varies by up to two seconds
# between runs even on an idle machine (startup_s 6.7-8.5 s in four DDP runs at B=4096); with (300, 900) steps at
# B=4096 one repetition's ratio ranged 0.49-2.72, with (300, 2100) 0.76-1.80. Each difference is now 15-20 s of
# steps.
LENGTHS = {64: (1500, 9000), 1024: (1000, 9000), 4096: (300, 4300)}  # B: the short and the long run's steps
TARGETS = {64: 1.20, 1024: 1.15, 4096: 1.10}  # B: project DDP x2 at most this times raw DDP x2
FRAMEWORK_SHARE = 0.10  # framework_ms under this share of a DDP step
CLOCK_AGREEMENT = 0.20  # the run's step_time_ms within this of the outside clock's step
SINGLE = (64, 4096)  # the batches at which one device runs too (the account of DDP on a CPU: docs/benchmarks.md)


def timed(command: list[str]) -> tuple[float, str]:
    """(the command's wall seconds, its output)."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"error: {' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return seconds, done.stdout


def raw(args, batch: int, steps: int) -> tuple[float, dict]:
    command = [
        sys.executable,
        "scripts/raw_ddp.py",
        f"--batch-size={batch}",
        f"--steps={steps}",
        f"--device={args.device}",
    ]
    seconds, out = timed([*command, f"--features={args.features}", f"--samples={args.samples}"])
    return seconds, {"step_time_ms": float(out.split("ms a step")[0].split()[-1])}  # the ranks' own clock


def project(args, batch: int, steps: int, devices: int) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "train.py", f"trainer.devices={devices}", f"data.batch_size={batch}"]
        command += [f"data.num_features={args.features}", f"data.num_samples={args.samples}"]
        command += [f"trainer.max_steps={steps}", "trainer.max_epochs=-1", "trainer.limit_val_batches=0"]
        command += ["trainer.accelerator=gpu"] if args.device == "cuda" else []  # NCCL, the data on the GPUs
        seconds, _ = timed([*command, f"hydra.run.dir={run_dir}"])
        return seconds, json.loads((Path(run_dir) / "metrics.json").read_text())


SIDES = {
    "raw": lambda args, b, n: raw(args, b, n),
    "ddp": lambda args, b, n: project(args, b, n, 2),
    "single": lambda args, b, n: project(args, b, n, 1),
}


def measure(args, batch: int) -> dict:
    short, long = args.lengths.get(batch, LENGTHS.get(batch, (1000, 3000)))
    sides = [s for s in SIDES if s != "single" or batch in args.single]
    per_step = {side: [] for side in sides}
    metrics, raw_own, single_own = [], [], []
    for rep in range(args.reps):
        shift = rep % len(sides)
        for side in sides[shift:] + sides[:shift]:
            t_short, _ = SIDES[side](args, batch, short)
            t_long, m = SIDES[side](args, batch, long)
            per_step[side].append(1e3 * (t_long - t_short) / (long - short))
            if side == "ddp":
                metrics.append(m)
            if side == "raw":
                raw_own.append(m["step_time_ms"])
            if side == "single":
                single_own.append(m["step_time_ms"])
        print(f"  B={batch} repetition {rep + 1}: " + ", ".join(f"{s} {v[-1]:.3f} ms" for s, v in per_step.items()),
              file=sys.stderr, flush=True)  # fmt: skip
    ratios = [d / r for d, r in zip(per_step["ddp"], per_step["raw"], strict=True)]
    clocks = [m["step_time_ms"] / d for m, d in zip(metrics, per_step["ddp"], strict=True)]
    own_ratios = [m["step_time_ms"] / r for m, r in zip(metrics, raw_own, strict=True)]
    own = {k: statistics.median(m[k] for m in metrics) for k in PARTS}
    row = {
        "B": batch,
        "steps": f"{short}/{long}",
        "raw_ms": statistics.median(per_step["raw"]),
        "ddp_ms": statistics.median(per_step["ddp"]),
        "ratio": statistics.median(ratios),
        "ratio_range": f"{min(ratios):.2f}-{max(ratios):.2f}",
        "single_ms": statistics.median(per_step["single"]) if "single" in per_step else None,
        **own,
        "clock": statistics.median(clocks),
        "raw_own_ms": statistics.median(raw_own),
        "own_ratio": statistics.median(own_ratios),
        "single_own_ms": statistics.median(single_own) if single_own else None,
        "framework_pct": 100 * own["framework_ms"] / statistics.median(per_step["ddp"]),
    }
    return row


PARTS = ("step_time_ms", "data_ms", "compute_ms", "comm_ms", "framework_ms")
COLUMNS = [
    ("B", "{}"), ("steps", "{}"), ("raw_ms", "{:.3f}"), ("ddp_ms", "{:.3f}"), ("ratio", "{:.2f}"),
    ("ratio_range", "{}"), ("single_ms", "{:.3f}"), ("step_time_ms", "{:.3f}"), ("clock", "{:.2f}"),
    ("raw_own_ms", "{:.3f}"), ("own_ratio", "{:.2f}"), ("single_own_ms", "{:.3f}"),
    ("data_ms", "{:.3f}"), ("compute_ms", "{:.3f}"), ("comm_ms", "{:.3f}"), ("framework_ms", "{:.3f}"),
    ("framework_pct", "{:.1f}"),
]  # fmt: skip


def cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def verdicts(rows: list[dict], features: int, device: str) -> list[str]:
    if features != 1000 or device != "cpu":
        return ["targets: judged at d=1000 on the CPU only"]
    lines = []
    for row in rows:
        b = row["B"]
        if b in TARGETS:
            met = "met" if row["ratio"] <= TARGETS[b] else "MISSED"
            lines.append(f"target B={b}: DDP x2 / raw DDP x2 {row['ratio']:.2f} (at most {TARGETS[b]}): {met}")
        met = "met" if row["framework_pct"] < 100 * FRAMEWORK_SHARE else "MISSED"
        lines.append(f"target B={b}: framework_ms {row['framework_pct']:.1f}% of a DDP step (under 10%): {met}")
        met = "met" if abs(row["clock"] - 1) <= CLOCK_AGREEMENT else "MISSED"
        lines.append(f"target B={b}: step_time_ms / outside clock {row['clock']:.2f} (within 20%): {met}")
    return lines


def allreduce_ms(args) -> float:
    """A gloo all_reduce of the seed's gradients (d + 1 floats) between two processes, timed alone: the median of
    `--reps` runs of scripts/raw_ddp.py --allreduce."""
    times = []
    for _ in range(args.reps):
        calls = 200 if args.quick else 2000
        command = [sys.executable, "scripts/raw_ddp.py", f"--allreduce={calls}", f"--features={args.features}"]
        command += [f"--device={args.device}"]
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout
        times.append(float(out.split(":")[-1].split()[0]))
    return statistics.median(times)


def main(args) -> None:
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        sys.exit(f"error: --ddp --device cuda needs 2 CUDA GPUs; {torch.cuda.device_count()} visible to PyTorch")
    args.single = SINGLE
    args.lengths = {}
    if args.quick:
        args.features, args.samples, args.reps = 16, 2048, 1  # a smoke run: every side once, the figures noise
        args.lengths = {64: (20, 60)}
        args.single = ()
    batches = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else list(LENGTHS)
    if args.quick and not args.batch_sizes:
        batches = [64]
    print(
        f"gpu-lab DDP benchmark: {os.cpu_count()} CPUs, {'NCCL, 2 GPUs' if args.device == 'cuda' else 'gloo'}, "
        f"d={args.features}, {args.samples} samples, no "
        f"validation; load average {os.getloadavg()[0]:.1f} at the start"
    )
    print(
        f"each row: {args.reps} interleaved repetitions; *_ms: per step from the difference of two whole-process run "
        "lengths (steps: short/long), medians; raw: scripts/raw_ddp.py (DDP x2); ddp: `python train.py "
        "trainer.devices=2`; single: `python train.py` (one process); ratio = ddp / raw within a repetition, its "
        "median and range; step_time_ms and its parts: the DDP run's own metrics.json; clock = step_time_ms / ddp_ms; "
        "raw_own_ms: the raw loop's own steady-state clock (long runs), own_ratio = step_time_ms / raw_own_ms within a "
        "repetition: the two runs' own clocks, start-up left out (on a noisy machine the steadier comparison); "
        "single_own_ms: the one-process run's "
        "step_time_ms"
    )
    rows = [measure(args, b) for b in batches]
    cells = [[n for n, _ in COLUMNS]] + [[cell(r[n], f) for n, f in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    print()
    print("\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells))
    print("\n".join(verdicts(rows, args.features, args.device)))
    backend = "NCCL" if args.device == "cuda" else "gloo"
    print(f"{backend} all_reduce of the seed's {args.features + 1} gradients, timed alone: {allreduce_ms(args):.3f} ms")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
