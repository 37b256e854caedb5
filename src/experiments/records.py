"""What a run leaves behind: metrics.json and checkpoints, written whole or not at all."""

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torchmetrics.functional import mean_absolute_error, mean_squared_error, r2_score

from experiments.data import RegressionData

UMASK = os.umask(0o022)  # reading the umask means setting it: put it straight back
os.umask(UMASK)


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """The one way this project writes a file whole or not at all: write to the yielded temporary path beside
    `path`; when the block ends, the file is flushed to disk and renamed over `path` (and the rename made
    durable); when it raises, the temporary file is removed and `path` is left as it was.

    Beside the target, not in the system's temp dir: a rename within one filesystem is atomic, a move across
    two is a copy that a crash can cut in half.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        os.fchmod(fd, 0o666 & ~UMASK)  # mkstemp makes the file private (0600); give it a new file's mode
        os.close(fd)
        yield tmp
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)


def write_atomic(path: Path, content: str | bytes) -> None:
    with replacing(path) as tmp:
        if isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            tmp.write_text(content)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, atomic on every filesystem (`trainer.plugins`).

    Lightning writes through an fsspec transaction whose temporary file sits in the system's temp dir; when
    that is another filesystem than the run dir, the final move is a copy, and a crash during it leaves half
    a checkpoint. Here the checkpoint goes through `replacing`, like every file of a run.
    """

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        with replacing(Path(path)) as tmp:
            super().save_checkpoint(checkpoint, tmp, storage_options)


def final_figures(net: torch.nn.Module, data: RegressionData) -> dict[str, float]:
    """Validation fit of the final weights, and their distance to the exact least-squares optimum."""
    device = next(net.parameters()).device
    with torch.no_grad():
        pred = net(data.x_val.to(device)).float().cpu()
    y_val = data.y_val.cpu()  # on the GPU when data.on_device kept it there
    figures = {
        "val_mse": mean_squared_error(pred, y_val).item(),
        "val_mae": mean_absolute_error(pred, y_val).item(),
        "val_r2": r2_score(pred, y_val).item(),
        "optimal_val_mse": data.optimal_val_mse,
    }
    if isinstance(net, torch.nn.Linear):
        w, b = data.optimum
        fitted = torch.cat([net.weight.detach().cpu().double().T, net.bias.detach().cpu().double()[None]])
        optimum = torch.cat([w, b[None]])
        figures["optimum_distance"] = (torch.linalg.norm(fitted - optimum) / torch.linalg.norm(optimum)).item()
    return figures


def strategy_name(strategy: Strategy) -> str:
    """Lightning's registry name of the strategy: single_device, dp, ddp, ddp_spawn, ..."""
    if isinstance(strategy, DDPStrategy):  # one class behind ddp, ddp_spawn and ddp_fork
        method = getattr(strategy, "_start_method", "popen")
        return "ddp" if method == "popen" else f"ddp_{method}"
    return getattr(strategy, "strategy_name", type(strategy).__name__)


def run_record(trainer: L.Trainer, status: str, global_batch_size: int) -> dict:
    """Where and how the run ran."""
    return {
        "status": status,
        "accelerator": type(trainer.accelerator).__name__.removesuffix("Accelerator").lower(),
        "strategy": strategy_name(trainer.strategy),
        "devices": trainer.num_devices,
        "num_nodes": trainer.num_nodes,
        "world_size": trainer.world_size,
        "global_batch_size": global_batch_size,
        "effective_batch_size": global_batch_size * trainer.accumulate_grad_batches,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "precision": str(trainer.precision),
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
    }


def write_metrics(path: Path, metrics: dict) -> None:
    write_atomic(path, json.dumps(metrics, indent=2, sort_keys=True) + "\n")
