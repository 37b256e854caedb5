"""Under a cgroup's memory limit (a container, a SLURM job's memory) far below the host's MemAvailable, the sizes
are checked against the limit (experiments.config.sizes.host_available, the one reader): batch.effective's
micro-batch fits in it, and a run whose data cannot is refused in one line before it allocates.

The commands run in a real cgroup made for the test (v1's memory controller, or v2), which needs root: CI runs as
root and sets GPU_LAB_REQUIRE_CGROUP=1, so a skip fails there."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import ROOT

from experiments.config.sizes import host_available

LIMIT = 2**30  # 1 GiB: a run of the seed's model peaks near 0.7 GiB here, the host has many more


@pytest.fixture
def cgroup():
    """A fresh memory cgroup limited to LIMIT; yields the file to write a pid into to move it there."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    parent = Path("/sys/fs/cgroup") if v2 else Path("/sys/fs/cgroup/memory")
    group = parent / f"gpu-lab-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(LIMIT))
    except OSError as err:
        if group.exists():
            group.rmdir()
        reason = f"cannot make a memory cgroup under {parent} here: {err}"
        if os.environ.get("GPU_LAB_REQUIRE_CGROUP"):
            pytest.fail(f"GPU_LAB_REQUIRE_CGROUP=1 but {reason}")
        pytest.skip(reason)
    yield group
    group.rmdir()  # its processes have ended


def peak_bytes(group: Path) -> int:
    name = "memory.peak" if (group / "memory.peak").exists() else "memory.max_usage_in_bytes"
    return int((group / name).read_text())


def train_in(group: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`python train.py OVERRIDES` on the real interpreter, moved into `group` before it execs (the pre-imported
    interpreter's server is in the test's own cgroup: tests/prefork.py)."""
    procs = group / "cgroup.procs"
    command = [sys.executable, "train.py", "trainer.enable_progress_bar=false", *overrides]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: procs.write_text(str(os.getpid())))  # fmt: skip


def test_the_fitted_micro_batch_fits_the_cgroups_limit(cgroup, tmp_path):
    # 10% of what is available: under the limit about 60 MiB, 15,000 samples of 1,000 features; on the host (GiBs)
    # the whole batch of 32,000 would be chosen.
    run = ["data.num_features=1000", "data.num_samples=40000", "batch.effective=32000", "batch.cpu_share=0.1",
           "trainer.max_epochs=1", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    assert 0.1 * host_available() > 32000 * 4016 * 2  # the host alone would not make it accumulate
    done = train_in(cgroup, *run)
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "run" / "metrics.json").read_text())
    fit = record["batch_fit"]
    assert record["status"] == "completed" and record["accumulate_grad_batches"] >= 2
    budget = fit["budget_mb"] * 2**20
    assert budget < 0.1 * LIMIT and fit["micro_batch"] * fit["bytes_per_sample"] <= budget
    assert peak_bytes(cgroup) < LIMIT


def test_data_larger_than_the_limit_is_refused_in_one_line_before_allocating(cgroup, tmp_path):
    # 300,000 x 1,001 float32 values, held twice while split: 2.2 GiB, over the limit, far under the host's memory.
    done = train_in(cgroup, "data.num_features=1000", "data.num_samples=300000", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data.num_samples=300000") and "available" in lines[0]
    assert peak_bytes(cgroup) < LIMIT / 2  # refused before the data was made
    assert not (tmp_path / "run" / "metrics.json").exists()


# An MLP [2048, 2048]: its step's activations grow about 40 KB a sample, its parameters, gradients and optimizer
# state are about 50 MiB. Under the limit a step of 2048 samples fits and one of 32768 does not.
MLP = ["model=mlp", "model.hidden=[2048,2048]", "data.num_features=100", "trainer.max_steps=3",
       "trainer.limit_val_batches=0"]  # fmt: skip
UNCHECKED = """
import runpy, sys
import experiments.commands.train as recipe
recipe.check_step_memory = lambda *args: None  # the check that this test shows was right to refuse
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_an_mlp_step_the_check_admits_runs_under_the_limit(cgroup, tmp_path):
    done = train_in(cgroup, *MLP, "data.num_samples=4096", "data.batch_size=2048", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["status"] == "completed"
    assert peak_bytes(cgroup) < LIMIT


def test_an_mlp_step_the_check_refuses_would_have_run_out_of_memory(cgroup, tmp_path):
    overrides = [*MLP, "data.num_samples=40960", "data.batch_size=32768"]
    done = train_in(cgroup, *overrides, f"hydra.run.dir={tmp_path / 'refused'}")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]  # after Lightning's lines
    assert done.returncode == 2 and len(errors) == 1 and done.stderr.strip().endswith(errors[0]), done.stderr[-2000:]
    assert errors[0].startswith("error: data.batch_size=32768: a training step of 32768 samples")
    assert "activations" in errors[0] and not (tmp_path / "refused" / "metrics.json").exists()
    # The same run with the check taken out: the kernel's OOM killer ends it in its first step.
    procs = cgroup / "cgroup.procs"
    command = [sys.executable, "-c", UNCHECKED, "trainer.enable_progress_bar=false", *overrides,
               f"hydra.run.dir={tmp_path / 'unchecked'}"]  # fmt: skip
    unchecked = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                               preexec_fn=lambda: procs.write_text(str(os.getpid())))  # fmt: skip
    assert unchecked.returncode == -9, unchecked.stderr[-2000:]
