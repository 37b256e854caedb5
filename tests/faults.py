"""What the tests of faults share (tests/test_faults_*.py, test_provenance.py): a run long enough to act on
mid-way, and reading what a run left: its checkpoint, its `error:` lines, its starts, its curve, its final state
compared with another's bit for bit."""

import csv
import json
from pathlib import Path

import torch
from background import Started, start_train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

MANY_EPOCHS = ["trainer.max_epochs=60", "optimizer.momentum=0.9"]  # momentum: optimizer state that must be restored
ENDLESS = ["trainer.max_epochs=100000"]  # runs until the test stops it
# momentum: optimizer state. window_s=0: a window of steps ends at every log step (training.windows), where the tests
# send their signals (at the default pace a window of these steps runs to the epoch's end).
RESUMABLE = ["trainer.max_epochs=3", "optimizer.momentum=0.9", "logger=none", "window_s=0"]
# 200 steps an epoch: a run to signal mid-epoch once the steps that CSVLogger writes to csv/metrics.csv have reached
# 100 (`last_step`); window_s=0: written step by step (at the default pace, at each window's end: the epoch's).
MANY_STEPS = ["data.num_samples=1000", "data.batch_size=4", "trainer.max_epochs=2", "window_s=0"]


def start_long(run_dir: Path, *args: str, **popen) -> Started:
    """A run of RESUMABLE and MANY_STEPS through the CLI, logged to csv/, in the background; its output in
    `<run_dir>.log`."""
    args = [*RESUMABLE, *MANY_STEPS, "logger=csv", *args, f"hydra.run.dir={run_dir}"]
    return start_train(*args, log=run_dir.parent / f"{run_dir.name}.log", **popen)


def last_step(run_dir: Path) -> int:
    """The last step in the run's csv/metrics.csv; -1 while there is none."""
    try:  # CSVLogger rewrites the file in place: a read may catch it half written
        rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
        return max(int(row["step"]) for row in rows)
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def saved(run_dir: Path) -> dict | None:
    """The run's last.ckpt as torch reads it (whole at any moment: it is replaced atomically), or None."""
    path = run_dir / "checkpoints" / "last.ckpt"
    return torch.load(path, weights_only=True) if path.exists() else None


def weights(run_dir: Path) -> dict:
    return saved(run_dir)["state_dict"]


def final_state(run_dir: Path) -> dict:
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    return {
        "weights": checkpoint["state_dict"],
        "optimizer": checkpoint["optimizer_states"][0]["state"],
        "global_step": checkpoint["global_step"],
        "epoch": checkpoint["epoch"],
    }


def assert_bit_identical(a: dict, b: dict) -> None:
    assert (a["global_step"], a["epoch"]) == (b["global_step"], b["epoch"])
    for name, tensor in a["weights"].items():
        assert torch.equal(tensor, b["weights"][name]), name
    for index, state in a["optimizer"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"][index]["momentum_buffer"])


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def starts(run_dir: Path) -> list[dict]:
    path = run_dir / "provenance.json"
    return json.loads(path.read_text())["starts"] if path.exists() else []


def loss_steps(run_dir: Path) -> list[int]:
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    return [e.step for e in events.Scalars("train/loss")]
