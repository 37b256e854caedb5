"""The exact least-squares reference optimum, solved blockwise, and in a background thread during training."""

import os
import threading
from concurrent.futures import Future

import torch


def least_squares(x: torch.Tensor, y: torch.Tensor, block_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact minimum-norm least-squares fit `y ~ x @ w + b`, in float64 on the CPU: returns (w, b).

    Computed a block of rows at a time (TSQR): the R factor of [x 1 y] is updated block by block, so the
    float64 working set is a few blocks of about 16 MB (about 100 MB at d=1000), where a float64 copy of
    the whole design matrix would double a run's peak memory. R[:, :d+1] has the singular values of [x 1],
    so the SVD-based solve on R, with the cut-off that LAPACK would use on the full matrix, gives the same
    minimum-norm answer.
    """
    n, d = x.shape
    block_rows = block_rows or max(2 * (d + 2), 2**21 // (d + 2))  # 16 MB of float64, or twice R's rows
    r = torch.zeros(0, d + 1 + y.shape[1], dtype=torch.float64)
    for xb, yb in zip(x.split(block_rows), y.split(block_rows), strict=True):
        ones = torch.ones(len(xb), 1, dtype=torch.float64)
        block = torch.cat([xb.to("cpu", torch.float64), ones, yb.to("cpu", torch.float64)], dim=1)
        r = torch.linalg.qr(torch.cat([r, block]), mode="r").R
    cutoff = torch.finfo(torch.float64).eps * max(n, d + 1)
    solution = torch.linalg.lstsq(r[:, : d + 1], r[:, d + 1 :], rcond=cutoff, driver="gelsd").solution
    return solution[:-1], solution[-1]



def solve_in_background(x: torch.Tensor, y: torch.Tensor) -> Future:
    """`least_squares(x, y)` in a daemon thread; the Future hands over the result or the error.

    Why a thread rather than accumulating the TSQR factor over the training batches: the QR update of a batch
    costs (B + d) d^2 flops, far more than the step of a linear model (2 B d). The solve is the same blockwise
    one as after training (a float64 working set of a few 16 MB blocks, against the 2 x dataset peak of the
    data's set-up, which is over by now), and LAPACK releases the GIL. The thread runs at the lowest priority
    (nice 19, inherited by its intra-op threads on Linux) so that on a machine with few cores the training
    steps get them first; the cost in step time is measured in docs/benchmarks.md. The tensors are held until
    it ends, even if the data then moves to a GPU (host memory, a few seconds).
    """
    future = Future()

    def solve() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except (AttributeError, OSError):
            pass
        try:
            future.set_result(least_squares(x, y))
        except BaseException as err:  # handed to whoever reads the result
            future.set_exception(err)

    threading.Thread(target=solve, name="least-squares", daemon=True).start()
    return future
