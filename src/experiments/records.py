"""What a run leaves behind: metrics.json and checkpoints, written whole or not at all."""

import json
import os
import tempfile
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torchmetrics.functional import mean_absolute_error, mean_squared_error, r2_score

from experiments.data import RegressionData

UMASK = os.umask(0o022)  # reading the umask means setting it: put it straight back
os.umask(UMASK)


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write to a temporary file beside `path`, then rename: a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~UMASK)  # mkstemp makes the file private (0600); give it a new file's mode
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, atomic on every filesystem (`trainer.plugins`).

    Lightning writes through an fsspec transaction whose temporary file sits in the system's temp dir; when
    that is another filesystem than the run dir, the final move is a copy, and a crash during it leaves half
    a checkpoint. Here the checkpoint is written beside its target, then renamed over it.
    """

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        os.replace(tmp, path)


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
