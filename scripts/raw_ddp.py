"""The seed's loop as an expert writes it for DDP on CPU: the reference that `scripts/benchmark.py --ddp` times.

    python scripts/raw_ddp.py --batch-size 64 --steps 1500          # two ranks over gloo, d=1000, 65,536 samples
    python scripts/raw_ddp.py --allreduce 2000                      # a gloo all_reduce of d+1 floats, timed alone
    python scripts/raw_ddp.py --device cuda                         # a GPU a rank, NCCL, the data on the GPUs

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
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=args.ranks)
    try:
        if args.allreduce:
            allreduce_alone(rank, args)
        else:
            train(rank, args)
        # Leave together: a rank that tears gloo down while its peer still holds the pair ends in SIGABRT
        # ("terminate called without an active exception"), seen once in CI.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train(rank: int, args) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples - round(0.2 * args.samples), args.features, generator=generator)
    y = x @ (torch.randn(args.features, 1, generator=generator) / args.features**0.5) + 0.1 * torch.randn(len(x), 1)
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    x, y = x.to(device), y.to(device)  # on a GPU the data lives there, as the project's data.on_device=auto keeps it
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(x.shape[1], y.shape[1]).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    share = args.batch_size // args.ranks
    xb, yb = torch.empty(share, x.shape[1], device=device), torch.empty(share, y.shape[1], device=device)
    generator = torch.Generator(device=device).manual_seed(0)  # the same order on every rank
    step, start = 0, args.steps // 5
    while step < args.steps:
        order = torch.randperm(len(x), generator=generator, device=device)
        for i in range(len(x) // args.batch_size):
            index = order[i * args.batch_size + rank * share : i * args.batch_size + (rank + 1) * share]
            torch.index_select(x, 0, index, out=xb)
            torch.index_select(y, 0, index, out=yb)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            optimizer.step()
            step += 1
            if step == start:
                began = synchronized_clock(device)
            if step == args.steps:
                break
    synchronized_clock(device)
    if rank == 0:
        print(f"raw DDP x{args.ranks}: {1e3 * (time.perf_counter() - began) / (args.steps - start):.3f} ms a step")


def allreduce_alone(rank: int, args) -> None:
    """Milliseconds a gloo all_reduce of the seed's gradients (d weights and a bias) costs, nothing else running."""
    grads = torch.ones(args.features + 1, device=f"cuda:{rank}" if args.device == "cuda" else "cpu")
    for _ in range(50):
        dist.all_reduce(grads)
    began = time.perf_counter()
    for _ in range(args.allreduce):
        dist.all_reduce(grads)
    if rank == 0:
        ms = 1e3 * (time.perf_counter() - began) / args.allreduce
        print(f"all_reduce of {args.features + 1} float32: {ms:.4f} ms")


def synchronized_clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


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
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, a GPU a rank")
    parser.add_argument("--allreduce", type=int, default=0, help="time this many all_reduce calls instead")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(rank_main, args=(args,), nprocs=args.ranks)


if __name__ == "__main__":
    main()
