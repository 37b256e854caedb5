"""metrics.json, written once: its schema (`Metrics`: every key, its type, unit and meaning) and the parts of a
run's final record that come from the trainer and the weights.

docs/metrics.md is made from it: `python -m experiments.run.metrics > docs/metrics.md` (tests/test_docs.py fails
when the two differ).
"""

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torchmetrics.functional import mean_absolute_error, mean_squared_error, r2_score

from experiments import internals
from experiments.run.files import write_atomic


def key(unit: str, meaning: str):
    """A field of `Metrics`: null (None) when the run did not measure it."""
    return field(default=None, metadata={"unit": unit, "meaning": meaning})


@dataclass
class Metrics:
    """The keys of metrics.json, in the groups the docs show them in. Building one refuses an unknown key."""

    # how the run ended
    status: str = key("", "completed, failed or interrupted")
    # the fit
    val_mse: float = key("", "validation mean squared error of the final weights")
    val_mae: float = key("", "validation mean absolute error of the final weights")
    val_r2: float = key("", "validation R² of the final weights")
    optimal_val_mse: float = key("", "validation MSE of the exact least-squares fit on the training split")
    optimum_distance: float = key("", "relative distance of the weights to that fit (a Linear model with a bias only)")
    train_loss: float = key("", "the last training step's loss")
    # the speed, in steady state (after 5 warm-up steps; validation and last.ckpt's saves left out)
    samples_per_sec: float = key("samples/s", "training throughput")
    step_time_ms: float = key("ms", "time of one micro-step (one global batch)")
    data_ms: float = key("ms", "part of a step: forming the batch")
    transfer_ms: float = key("ms", "part of a step: copying the batch to the device (0 on the CPU or device-resident)")
    compute_ms: float = key("ms", "part of a step: forward, backward and optimizer update")
    comm_ms: float = key("ms", "part of a step: waiting for the gradients' all-reduce (DDP on the CPU; else 0)")
    framework_ms: float = key("ms", "part of a step: the rest (Lightning's loop, hooks, callbacks, logging)")
    peak_memory_mb: float = key("MiB", "CUDA's peak allocation on a GPU; the process's peak resident memory on the CPU")
    # the model's work against the machine's limit (docs/speed.md)
    model_params: int = key("", "the model's parameters (1001 for the seed's Linear at d=1000)")
    model_tflops: float = key(
        "TFLOP/s",
        "the model's training FLOPs a second: 6 x the parameters of its Linear layers (2 forward, 4 backward) x "
        "samples_per_sec; activations, loss and update left out",
    )
    peak_tflops: float = key(
        "TFLOP/s",
        "this machine's matmul rate at the run's precision, measured (best of square products up to 8192, a few "
        "seconds, cached per machine, device, dtype and threads): one GPU's x the GPUs, or the host's on the CPU",
    )
    mfu: float = key("", "model FLOPs utilization: model_tflops / peak_tflops")
    # where and how it ran
    accelerator: str = key("", "cpu, cuda, mps")
    strategy: str = key("", "Lightning's name of the strategy: single_device, ddp, ddp_spawn, dp, ...")
    devices: int = key("", "devices per node")
    num_nodes: int = key("", "nodes")
    world_size: int = key("", "ranks (devices x nodes; 1 for dp)")
    precision: str = key("", "trainer.precision as Lightning ran it")
    global_batch_size: int = key("samples", "data.batch_size: the global batch of one micro-step")
    effective_batch_size: int = key("samples", "samples per optimizer step: global batch x accumulation")
    accumulate_grad_batches: int = key("", "micro-steps per optimizer step")
    batch_fit: dict = key(
        "",
        "batch.effective's choice (null when off): budget_mb (MiB: one rank's memory budget), bytes_per_sample "
        "(bytes: what one more sample adds to a step, measured), micro_batch (samples: per rank and micro-step)",
    )
    global_step: int = key("", "optimizer steps taken")
    epochs: int = key("", "epochs completed (Lightning's current_epoch)")
    data_device: str = key("", "where the data was held: cpu, cuda:0, ...")
    data_pinned: bool = key("", "whether batches were gathered into pinned memory")
    # what produced it (every detail: provenance.json beside metrics.json)
    git_commit: str = key("", "the commit of the code that finished the run (null outside a git checkout)")
    git_dirty: bool = key("", "whether that code had uncommitted changes (saved beside it as code-<hash>.diff)")
    # checkpoints/last.ckpt (checkpoint.*: every epoch's end by default)
    checkpoints_saved: int = key("", "last.ckpt saves at epoch ends and intervals in this start (not the final one)")
    checkpoint_save_ms: float = key(
        "ms", "mean wall time of one of those saves until training goes on (its fsync and rename finish in a thread)"
    )
    # time to quality
    target_mse: float = key("", "target.mse_ratio x optimal_val_mse")
    time_to_target_s: float = key(
        "s", "training time (no validation or saves) to the first validation at or under target_mse"
    )
    steps_to_target: int = key("", "optimizer steps to it")
    samples_to_target: int = key("samples", "samples to it")
    epochs_to_target: float = key("", "epochs to it")
    stopped_at_target: bool = key("", "true when target.stop=true ended the run there")
    # early stopping (callbacks=early_stopping)
    stopped_epoch: int = key("", "the epoch at which EarlyStopping stopped the run")
    stop_reason: str = key("", "why, as EarlyStopping recorded it (e.g. patience_exhausted)")
    stop_message: str = key("", "EarlyStopping's own sentence")
    # the time
    startup_s: float = key(
        "s", "from the start (of the process for its first run, of the job for later ones) to the first step"
    )
    wall_time_s: float = key("s", "from the same start to the end of the run")


NAMES = [f.name for f in dataclasses.fields(Metrics)]


def record(**values) -> dict:
    """The metrics.json record of `values`, every key of the schema present (null where not measured)."""
    return dataclasses.asdict(Metrics(**values))


def write_metrics(path: Path, metrics: dict) -> None:
    write_atomic(path, json.dumps(metrics, indent=2, sort_keys=True) + "\n")


PAGE_HEAD = """# metrics.json

Every run writes `<run dir>/metrics.json` when it ends, whether it completed, failed or was interrupted: rank 0
only, atomically. Every key below is always there, null where the run did not measure it (the `*_to_target`
keys when the target was never reached; `stopped_epoch`, `stop_reason` and `stop_message` without
`callbacks=early_stopping`). The speed figures are steady-state values: after 5 warm-up steps, validation left
out ([speed.md](speed.md)). A sweep's results.csv has one column per key ([sweeps.md](sweeps.md#resultscsv)).

This page is made from the schema, `experiments.run.metrics.Metrics`: `python -m experiments.run.metrics >
docs/metrics.md`.

"""


def markdown_page() -> str:
    """docs/metrics.md."""
    return PAGE_HEAD + markdown_table()


def markdown_table() -> str:
    rows = ["| key | type | unit | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(Metrics):
        type_name = getattr(f.type, "__name__", str(f.type))
        rows.append(f"| `{f.name}` | {type_name} | {f.metadata['unit']} | {f.metadata['meaning']} |")
    return "\n".join(rows) + "\n"


def final_figures(net: torch.nn.Module, data) -> dict[str, float]:
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
    # The optimum is a Linear's with an intercept: not defined for data=teacher, nor for model.bias=false.
    if isinstance(net, torch.nn.Linear) and net.bias is not None and data.optimum is not None:
        w, b = data.optimum
        fitted = torch.cat([net.weight.detach().cpu().double().T, net.bias.detach().cpu().double()[None]])
        optimum = torch.cat([w, b[None]])
        figures["optimum_distance"] = (torch.linalg.norm(fitted - optimum) / torch.linalg.norm(optimum)).item()
    return figures


def strategy_name(strategy: Strategy) -> str:
    """Lightning's registry name of the strategy: single_device, dp, ddp, ddp_spawn, ..."""
    if isinstance(strategy, DDPStrategy):  # one class behind ddp, ddp_spawn and ddp_fork
        method = internals.ddp_start_method(strategy)
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


if __name__ == "__main__":
    sys.stdout.write(markdown_page())
