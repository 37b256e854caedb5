import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from experiments.commands.entry import CONFIG_DIR
from experiments.commands.train import train

ROOT = Path(__file__).resolve().parents[1]

# A problem small enough for a test to train in a second or two on one CPU core.
TINY = [
    "data.num_samples=640",
    "data.num_features=8",
    "data.batch_size=64",
    "trainer.max_epochs=2",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
]


def shrink(overrides) -> list[str]:
    """TINY before the overrides; its synthetic-data keys only where the data is synthetic."""
    synthetic = all(not o.startswith("data=") or o == "data=synthetic" for o in overrides)
    return [o for o in TINY if synthetic or not o.startswith("data.")] + list(overrides)


def compose_config(*overrides: str, tiny: bool = True):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("config", overrides=shrink(overrides) if tiny else list(overrides))


@pytest.fixture
def run_in_process(tmp_path):
    """Train in this process through `experiments.commands.train.train`; returns (metrics, run_dir)."""

    def run(*overrides: str, tiny: bool = True, run_dir: Path | None = None):
        run_dir = run_dir or tmp_path / "run"
        return train(compose_config(*overrides, tiny=tiny), run_dir), run_dir

    return run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One TINY run (2 epochs of 8 steps, logged every step) shared by a module's tests: (metrics, run_dir)."""
    run_dir = tmp_path_factory.mktemp("run")
    return train(compose_config(), run_dir), run_dir


def cli(*args: str, tiny: bool = True, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """`python train.py ARGS` as a user types it, from the repository root."""
    command = [sys.executable, "train.py", *(shrink(args) if tiny else args)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kwargs)


def logged_tags(run_dir: Path) -> list[str]:
    """The scalar tags on disk in a run's TensorBoard files (`glob` below `tensorboard/`): `train/loss` there
    means training is under way; the event file alone is made when the logger is, before the first step."""
    events = sorted(run_dir.glob("tensorboard/**/events.*"))
    if not events:
        return []
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    return accumulator.Tags()["scalars"]
