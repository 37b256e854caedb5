"""The exact least-squares reference optimum, solved blockwise."""

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
