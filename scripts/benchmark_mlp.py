"""`python scripts/benchmark.py --mlp`: the project's `python train.py model=mlp` against an expert's raw MLP loop, at
compute-bound sizes, with the model's FLOPs against the machine's measured matmul rate, torch.compile beside eager,
the seed's Linear at the same batches, and DDP x2 against a raw DDP MLP loop.

    python scripts/benchmark.py --mlp             # CPU, fp32, d=1000, hidden [2048, 2048], B = 64 and 1024, 5 reps
    python scripts/benchmark.py --mlp --quick     # tiny sizes: everything runs (tests use it)

Whole processes, both sides: the raw loop is this file run as `--raw` (a process of its own, as the project's is),
the project `train.py` as a user types it (TensorBoard, progress bar, last.ckpt at each epoch's end; no validation:
its time is left out of a step anyway, and data=teacher's reference needs no least-squares solve). A side's step
time is its own steady state: the raw loop's (T(N) - T(N/5)) / (N - N/5), the project's `step_time_ms` (after 5
warm-up steps). Each repetition runs every row's sides one after the other in a rotated order; a row's ratio is
taken within a repetition (pairing runs that met the same load), and the median over `--reps` repetitions is
reported with its least and greatest.

raw: an `nn.Sequential` of Linear and GELU layers of the same widths, the data's rows gathered with `index_select`
into two reused tensors, zero_grad, forward, MSE, backward, `SGD.step`. The matmul rate (`peak`) is measured here,
at the start and the end of the benchmark (the best of square products and of the run's own shapes), not read
from the runs' cache: mfu = the project's model_tflops / this rate.
"""

import argparse
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
TARGETS = {64: 1.10, 1024: 1.05}  # B: the project's MLP step at most this times the raw loop's (CPU, fp32)
LINEAR_TARGET = 1.10  # the seed's Linear at both batches
MFU_TARGET = 0.6  # at B=1024: the project's model FLOPs rate at least this share of the measured matmul rate
DDP_TARGET = 1.10  # DDP x2 at B=1024 against raw DDP x2
SECONDS = 6.0  # about this long a run's steps (the raw loop's estimate)


def mlp(features: int, hidden: list[int]) -> torch.nn.Sequential:
    widths, layers = [features, *hidden], []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(widths[-1], 1))


def raw(args) -> None:
    """One process of the raw loop: prints {"step_ms": ...}. Under --ranks 2, DDP over gloo, a thread a rank."""
    if args.ranks > 1:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))  # as Lightning sets it for DDP on a CPU
        dist.init_process_group("gloo")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples - round(0.2 * args.samples), args.features, generator=generator)
    y = torch.randn(len(x), 1, generator=generator)
    torch.manual_seed(0)
    model = mlp(args.features, args.hidden) if args.hidden else torch.nn.Linear(args.features, 1)
    if args.ranks > 1:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    share = args.batch_size // args.ranks
    offset = share * (int(os.environ.get("RANK", 0)))
    xb, yb = torch.empty(share, x.shape[1]), torch.empty(share, 1)
    step, start = 0, args.steps // 5
    while step < args.steps:
        order = torch.randperm(len(x), generator=generator)
        for i in range(len(x) // args.batch_size):
            index = order[i * args.batch_size + offset : i * args.batch_size + offset + share]
            torch.index_select(x, 0, index, out=xb)
            torch.index_select(y, 0, index, out=yb)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            optimizer.step()
            step += 1
            if step == start:
                began = time.perf_counter()
            if step == args.steps:
                break
    if args.ranks == 1 or int(os.environ["RANK"]) == 0:
        print(json.dumps({"step_ms": 1e3 * (time.perf_counter() - began) / (args.steps - start)}))
    if args.ranks > 1:
        dist.barrier()
        dist.destroy_process_group()


def raw_step_ms(args, batch_size: int, hidden: list[int], steps: int, *, ranks: int = 1) -> float:
    command = [sys.executable, __file__, "--raw", f"--batch-size={batch_size}", f"--steps={steps}",
               f"--features={args.features}", f"--samples={args.samples}", f"--ranks={ranks}",
               f"--hidden={','.join(map(str, hidden))}"]  # fmt: skip
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   *command[1:]]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["step_ms"]


def project_run(args, batch_size: int, hidden: list[int], steps: int, *extra: str) -> dict:
    """`python train.py ...` in a process of its own: its metrics.json, and its wall seconds."""
    model = ["model=mlp", f"model.hidden=[{','.join(map(str, hidden))}]"] if hidden else []
    with tempfile.TemporaryDirectory() as run_dir:
        data = ["data=teacher", f"data.num_features={args.features}", f"data.num_samples={args.samples}"]
        steps = [f"data.batch_size={batch_size}", f"trainer.max_steps={steps}", "trainer.max_epochs=-1"]
        command = [sys.executable, "train.py", *model, *data, *steps, "trainer.limit_val_batches=0", *extra,
                   f"hydra.run.dir={run_dir}"]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ,
                              "GPU_LAB_CACHE": run_dir})  # fmt: skip  (the benchmark measures the rate itself)
        if done.returncode:
            sys.exit(f"error: {' '.join(command)} failed:\n{done.stderr[-2000:]}")
        metrics = json.loads((Path(run_dir) / "metrics.json").read_text())
        return metrics | {"wall_s": time.perf_counter() - start}


def matmul_rate(args, batch_sizes: list[int]) -> float:
    """TFLOP/s: the best of square products (experiments.training.mfu) and of the runs' own forward products."""
    from experiments.training.mfu import measure_matmul_tflops

    best = measure_matmul_tflops(torch.device("cpu"), torch.float32)
    widths = [args.features, *args.hidden_sizes]
    for b in batch_sizes:
        for k, n in zip(widths, widths[1:], strict=False):
            a, w = torch.randn(b, k), torch.randn(k, n)
            out = a @ w
            times = []
            for _ in range(5):
                start = time.perf_counter()
                torch.mm(a, w, out=out)
                times.append(time.perf_counter() - start)
            best = max(best, 2 * b * k * n / min(times) / 1e12)
    return best


def steps_for(args, batch_size: int, hidden: list[int]) -> int:
    """About `SECONDS` of the raw loop (from a short raw run), at least `--min-steps` (--quick: that)."""
    if args.quick:
        return args.min_steps
    per_step = raw_step_ms(args, batch_size, hidden, 20) / 1e3
    return max(args.min_steps, round(SECONDS / per_step))


def summary(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})"


def main(args) -> None:
    hidden, batches = args.hidden_sizes, args.batch_list
    print(f"gpu-lab MLP benchmark: torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
          f"d={args.features}, hidden {hidden}, B={batches}, {args.reps} repetitions, load average "
          f"{os.getloadavg()[0]:.1f} at the start")  # fmt: skip
    peak_before = matmul_rate(args, batches)
    rows = {}  # name: (global batch, hidden widths, steps, extra overrides)
    for b in batches:
        steps = steps_for(args, b, hidden)
        rows[f"mlp B={b}"] = (b, hidden, steps, ())
        rows[f"linear B={b}"] = (b, [], steps_for(args, b, []), ())
    compiled_b = batches[-1]
    results = {name: [] for name in rows} | {"compile": [], "ddp": []}
    records = {name: [] for name in rows} | {"compile": []}
    for rep in range(args.reps):
        names = list(rows)
        names = names[rep % len(names) :] + names[: rep % len(names)]
        for name in names:
            b, widths, steps, extra = rows[name]
            done = {}
            for side in ("raw", "project") if rep % 2 == 0 else ("project", "raw"):
                run = raw_step_ms if side == "raw" else project_run
                done[side] = run(args, b, widths, steps, *extra)
            raw_ms, run = done["raw"], done["project"]
            results[name].append(run["step_time_ms"] / raw_ms)
            records[name].append(run)
        # torch.compile beside eager, at the larger batch (the eager run is the mlp row's of this repetition)
        steps = rows[f"mlp B={compiled_b}"][2]
        compiled = project_run(args, compiled_b, hidden, steps, "compile=true")
        eager = records[f"mlp B={compiled_b}"][-1]
        results["compile"].append(compiled["step_time_ms"] / eager["step_time_ms"])
        steps_cost = steps * (compiled["step_time_ms"] - eager["step_time_ms"]) / 1e3
        records["compile"].append(compiled | {"compile_s": compiled["wall_s"] - eager["wall_s"] - steps_cost})
        if args.ranks > 1:
            ddp_steps = max(args.min_steps, steps // 2)
            raw_ms = raw_step_ms(args, compiled_b, hidden, ddp_steps, ranks=args.ranks)
            run = project_run(args, compiled_b, hidden, ddp_steps, f"trainer.devices={args.ranks}")
            results["ddp"].append(run["step_time_ms"] / raw_ms)
    peak = max(peak_before, matmul_rate(args, batches))
    print(f"measured fp32 matmul rate (best of square products and the runs' shapes, before and after): {peak:.4f} "
          f"TFLOP/s (before {peak_before:.4f})")  # fmt: skip
    print("row            project/raw (median, range)   project step_ms   model_tflops   mfu (of the measured rate)")
    for name in rows:
        runs = records[name]
        step = statistics.median(r["step_time_ms"] for r in runs)
        tflops = statistics.median(r["model_tflops"] for r in runs)
        print(f"{name:<14} {summary(results[name]):<29} {step:>15.3f} {tflops:>14.4g}   {tflops / peak:.3g}")
    compile_s = statistics.median(r["compile_s"] for r in records["compile"])
    print(f"compile=true at B={compiled_b}: compiled/eager step {summary(results['compile'])}, compile time about "
          f"{compile_s:.1f} s (wall time over eager's, less the steps' difference)")  # fmt: skip
    if results["ddp"]:
        print(f"DDP x{args.ranks} at B={compiled_b}: project/raw DDP {summary(results['ddp'])}")
    print("verdicts (the median ratio; cpu, fp32):")
    for b in batches:
        median = statistics.median(results[f"mlp B={b}"])
        bound = TARGETS.get(b)
        if bound:
            print(f"  MLP B={b}: project/raw {median:.3f} (at most {bound}): {'met' if median <= bound else 'MISSED'}")
        median = statistics.median(results[f"linear B={b}"])
        print(f"  Linear B={b}: project/raw {median:.3f} (at most {LINEAR_TARGET}): "
              f"{'met' if median <= LINEAR_TARGET else 'MISSED'}")  # fmt: skip
    if 1024 in batches:
        mfu = statistics.median(r["model_tflops"] for r in records["mlp B=1024"]) / peak
        print(f"  MLP B=1024: mfu {mfu:.3f} of the measured rate (at least {MFU_TARGET}): "
              f"{'met' if mfu >= MFU_TARGET else 'MISSED'}")  # fmt: skip
    if results["ddp"] and compiled_b == 1024:
        median = statistics.median(results["ddp"])
        print(f"  DDP x2 B=1024: project/raw DDP {median:.3f} (at most {DDP_TARGET}): "
              f"{'met' if median <= DDP_TARGET else 'MISSED'}")  # fmt: skip


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--raw", action="store_true", help="(internal) one process of the raw loop")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that everything runs")
    parser.add_argument("--features", type=int, default=1000)
    parser.add_argument("--hidden", default="2048,2048", help="hidden widths, comma-separated (empty: Linear)")
    parser.add_argument("--batch-sizes", default="64,1024")
    parser.add_argument("--samples", type=int, default=40960, help="train + validation (80/20)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2, help="DDP ranks of the DDP row (1: no DDP row)")
    parser.add_argument("--batch-size", type=int, help="(--raw) the global batch")
    parser.add_argument("--steps", type=int, help="(--raw) steps")
    parser.add_argument("--min-steps", type=int, default=30)
    args = parser.parse_args(argv)
    if args.quick:
        args.features, args.hidden, args.batch_sizes, args.samples = 16, "32,32", "16,64", 1024
        args.reps, args.min_steps = 1, 12
    args.hidden_sizes = [int(h) for h in args.hidden.split(",") if h] if not args.raw else []
    args.hidden = [int(h) for h in args.hidden.split(",") if h] if args.raw else args.hidden
    args.batch_list = [int(b) for b in args.batch_sizes.split(",")]
    return args


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.raw:
        raw(arguments)
    else:
        main(arguments)
