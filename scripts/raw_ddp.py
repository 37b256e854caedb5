"""The seed's loop as an expert writes it for DDP on CPU: the reference that `scripts/benchmark.py --ddp` times.

    python scripts/raw_ddp.py --batch-size 64 --steps 1500          # two ranks over gloo, d=1000, 65,536 samples
    python scripts/raw_ddp.py --allreduce 2000                      # a gloo all_reduce of d+1 floats, timed alone

Each rank: one torch thread, data of the project's sizes (its training split: 80% of `--samples`, drawn as
experiments.data.SyntheticRegression draws them, without importing the project: each rank would pay Lightning's
import), a `DistributedDataParallel(Linear)`, and every global batch taken from one `randperm` an epoch (the same
on both ranks), the rank's contiguous share gathered with `index_select` into two reused tensors; zero_grad, forward,
MSE, backward (DDP's all-reduce of the gradients), SGD. No validation, no logging, no checkpoint. The benchmark
times the whole process from the outside; the ranks print their own step time too.
"""

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel


def rank_main(rank: int, args) -> None:
    torch.set_num_threads(1)  # one core a rank, as Lightning sets it for DDP on a 2-core CPU
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    try:
        if args.allreduce:
            allreduce_alone(rank, args)
        else:
            train(rank, args)
    finally:
        dist.destroy_process_group()


def train(rank: int, args) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples - round(0.2 * args.samples), args.features, generator=generator)
    y = x @ (torch.randn(args.features, 1, generator=generator) / args.features**0.5) + 0.1 * torch.randn(len(x), 1)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(x.shape[1], y.shape[1]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    share = args.batch_size // args.ranks
    xb, yb = torch.empty(share, x.shape[1]), torch.empty(share, y.shape[1])
    generator = torch.Generator().manual_seed(0)  # the same order on every rank
    step, start = 0, args.steps // 5
    while step < args.steps:
        order = torch.randperm(len(x), generator=generator)
        for i in range(len(x) // args.batch_size):
            index = order[i * args.batch_size + rank * share : i * args.batch_size + (rank + 1) * share]
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
    if rank == 0:
        print(f"raw DDP x{args.ranks}: {1e3 * (time.perf_counter() - began) / (args.steps - start):.3f} ms a step")


def allreduce_alone(rank: int, args) -> None:
    """Milliseconds a gloo all_reduce of the seed's gradients (d weights and a bias) costs, nothing else running."""
    grads = torch.ones(args.features + 1)
    for _ in range(50):
        dist.all_reduce(grads)
    began = time.perf_counter()
    for _ in range(args.allreduce):
        dist.all_reduce(grads)
    if rank == 0:
        ms = 1e3 * (time.perf_counter() - began) / args.allreduce
        print(f"all_reduce of {args.features + 1} float32: {ms:.4f} ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--features", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=65536, help="train + validation (80/20), as the project")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--allreduce", type=int, default=0, help="time this many all_reduce calls instead")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(rank_main, args=(args,), nprocs=args.ranks)


if __name__ == "__main__":
    main()
