"""How close a run's steps come to what the machine can do: the model's training FLOPs a second (`model_tflops`)
against this machine's measured matmul rate at the run's precision (`peak_tflops`), and their ratio (`mfu`).

The model's FLOPs are counted from its Linear layers (experiments.models.mlp.train_flops_per_sample: 6 x their
parameters a sample), whatever the model's class. The peak is measured, not taken from a data sheet: the best rate
of square matrix products of growing size (a single 2048^3 product on a busy 2-core VM reads 10-20% low), at most
a few seconds, once per machine, device, dtype and thread count; the figure is cached in
`$GPU_LAB_CACHE` (default ~/.cache/gpu-lab)/matmul_rate.json.
"""

import json
import os
import platform
import time
from pathlib import Path

import torch

from experiments.models.mlp import train_flops_per_sample
from experiments.run.files import write_atomic

# The dtype a precision's matrix products run in (mixed precision: the autocast dtype).
DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64, "32": torch.float32}
SIZES = (512, 1024, 2048, 4096, 8192)  # the square products tried, smallest first, while the budget allows
REPEATS = 3  # timings of each size: the best counts
BUDGET_S = 3.0  # the measurement's time, at most about this (the last size tried is the one that still fits)


def precision_dtype(precision: str) -> torch.dtype:
    return DTYPES.get(str(precision).split("-")[0], torch.float32)


def cache_file() -> Path:
    return Path(os.environ.get("GPU_LAB_CACHE") or Path.home() / ".cache" / "gpu-lab") / "matmul_rate.json"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, budget_s: float = BUDGET_S) -> float:
    """The best rate of `REPEATS` timed n x n products for n in SIZES, growing while the next size's timings (8
    times this one's) fit in what is left of `budget_s`."""
    best, began = 0.0, time.perf_counter()
    for n in SIZES:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        out = torch.mm(a, b)  # warm-up: the library's first call, the pages of `out`
        times = []
        for _ in range(REPEATS):
            _sync(device)
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            _sync(device)
            times.append(time.perf_counter() - start)
        best = max(best, 2 * n**3 / min(times) / 1e12)
        left = budget_s - (time.perf_counter() - began)
        if 8 * sum(times) > left:
            break
    return best


def _machine_key(device: torch.device, dtype: torch.dtype, threads: int) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    dtype_name = str(dtype).removeprefix("torch.")
    return f"{platform.node()}|{device.type}|{name}|{dtype_name}|{threads} threads|torch {torch.__version__}"


def peak_tflops(device: torch.device, precision: str) -> float:
    """One device's matmul rate at `precision`, measured once and cached. On the CPU the host's: with a thread for
    each core this process may use (DDP ranks on one host share its cores, and Lightning gives each fewer threads).

    A rate measured while the host was busier than now (a higher load average) is measured again, and the higher
    kept: a shared machine's other work makes the rate read low, never high."""
    dtype = precision_dtype(precision)
    threads = len(os.sched_getaffinity(0)) if device.type == "cpu" else 0
    key = _machine_key(device, dtype, threads)
    path = cache_file()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    load = os.getloadavg()[0]
    known = cached.get(key)
    if known and (device.type != "cpu" or load >= known["load"] - 1):
        return known["tflops"]
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        rate = measure_matmul_tflops(device, dtype)
    finally:
        torch.set_num_threads(before)
    if known and known["tflops"] > rate:
        rate = known["tflops"]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = {"tflops": rate, "load": load, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
        write_atomic(path, json.dumps(cached | {key: entry}, indent=1, sort_keys=True) + "\n")
    except OSError:
        pass  # a read-only home: measured again next time, never a failed run
    return rate


def utilization(net: torch.nn.Module, samples_per_sec: float | None, device: torch.device, precision: str,
                copies: int = 1) -> dict:  # fmt: skip
    """metrics.json's model_params, model_tflops, peak_tflops and mfu (the last three null without a speed).
    `copies`: how many of `device`'s measured rate the run had (its GPUs; a host's cores count once)."""
    record = {"model_params": sum(p.numel() for p in net.parameters())}
    if not samples_per_sec:
        return record
    model = train_flops_per_sample(net) * samples_per_sec / 1e12
    peak = peak_tflops(device, precision) * copies
    return record | {"model_tflops": model, "peak_tflops": peak, "mfu": model / peak if peak else None}


def run_utilization(trainer, net: torch.nn.Module, speed: dict, status: str) -> dict:
    """A run's record (train.py's finish): model_params; on rank 0 of a run that did not fail, also model_tflops,
    peak_tflops and mfu. Each GPU adds its rate; CPU ranks on one host share its cores, whose rate counts once."""
    samples_per_sec = speed.get("samples_per_sec") if status != "failed" and trainer.is_global_zero else None
    device = trainer.strategy.root_device
    copies = trainer.num_nodes * (trainer.num_devices if device.type == "cuda" else 1)
    return utilization(net, samples_per_sec, device, str(trainer.precision), copies)
