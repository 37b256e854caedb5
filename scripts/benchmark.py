"""The seed's loop as an expert writes it, against the project's Lightning path, side by side in one run.

    python scripts/benchmark.py                  # CPU, d=1000, B = 64, 1024, 16384, 5 repetitions (~4 min, 2 cores)
    python scripts/benchmark.py --quick          # a tiny smoke run of every measurement (tests use it)
    python scripts/benchmark.py --threads 1      # one torch thread for both paths
    python scripts/benchmark.py --device cuda    # the same on a GPU (data on the device), with bf16/16-mixed rows
    python scripts/benchmark.py --gpu-sweep      # CPU vs GPU, pageable, pinned and device data, B = 64 ... 65536
    python scripts/benchmark.py --ddp            # `train.py trainer.devices=2` vs raw DDP x2, CPU, gloo (~25 min)
    python scripts/benchmark.py --ddp --quick    # its tiny smoke run (tests use it)
    python scripts/benchmark.py --mlp            # model=mlp at d=1000, hidden [2048, 2048] vs a raw MLP loop, mfu,
                                                 # compile, the Linear, DDP x2 (scripts/benchmark_mlp.py; ~20 min)
    python scripts/benchmark.py --mlp --quick    # its tiny smoke run (tests use it)

Each row of the table: the seed's loop as an expert writes it (raw) against `experiments.commands.train.train`
(project), the same steps in this process, each side's minimum over `--reps` interleaved repetitions
(scripts/benchmark_loop.py says how each is timed). The lines after it: start-up, memory, `--help` and last.ckpt's
cost, from the command line in subprocesses (scripts/benchmark_command.py). `--ddp`: whole processes
(scripts/benchmark_ddp.py).
"""

import argparse
import logging
import os
import sys

import benchmark_ddp  # scripts/, beside this file
import benchmark_mlp
import lightning
import torch
from benchmark_command import checkpoint_cost, command_lines
from benchmark_loop import measure, table, verdicts

from experiments.data import SyntheticRegression


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
    parser.add_argument("--mlp", action="store_true", help="model=mlp against a raw MLP loop, mfu, compile, DDP x2 "
                        "(scripts/benchmark_mlp.py; python scripts/benchmark_mlp.py --help: its options)")  # fmt: skip
    parser.add_argument(
        "--gpu-sweep", action="store_true", help="CPU vs GPU, host vs device data, B = 64 ... 65536 (needs CUDA)"
    )
    args, rest = parser.parse_known_args()
    if rest and not args.mlp:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    if args.ddp or args.mlp:
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
    if args.mlp:  # its own options (scripts/benchmark_mlp.py), --quick among them
        benchmark_mlp.main(benchmark_mlp.parse_args([*args.rest, *(["--quick"] if args.quick else [])]))
        return
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
        f"each row: {args.reps} interleaved repetitions of each side; raw_ms: the seed's loop (an "
        "expert's: index_select into reused tensors); project_ms: experiments.commands.train.train's own "
        "step_time_ms (steady state, validation and last.ckpt saves left out), each side's minimum; ratio: the "
        "median of the repetitions' paired project/raw ratios, ratio_range: their least and greatest (as --ddp's); "
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
