"""Run dirs written before a move of the code (tests/data/before_house/, by main 7e7bc8e) keep working after it: an
interrupted run resumes to the end, a completed one is kept as it is, both checkpoints evaluate and predict, and
the sweep re-runs to nothing new and reports."""

import shutil
import subprocess

import numpy as np
import pytest
from conftest import ROOT, cli, metrics, python

FIXTURES = ROOT / "tests" / "data" / "before_house"
# The commands that wrote them (tests/data/before_house/README.md), less their dirs.
RUN = ["data.num_samples=2048", "trainer.max_epochs=2"]
CUT = ["data.num_samples=2048", "trainer.max_epochs=400"]
SWEEP = ["-m", "data.num_samples=2048", "trainer.max_epochs=2", "data.batch_size=128,256"]


@pytest.fixture
def old(tmp_path):
    """A copy of the fixtures (a test may change its copy)."""
    shutil.copytree(FIXTURES, tmp_path / "old", ignore=shutil.ignore_patterns("README.md"))
    return tmp_path / "old"


def entry(script: str, *args: str) -> subprocess.CompletedProcess:
    command = [python(), script, "trainer.enable_progress_bar=false", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_an_interrupted_run_resumes_to_its_end(old):
    before = metrics(old / "cut")
    assert before["status"] == "interrupted"
    done = cli(*CUT, f"hydra.run.dir={old / 'cut'}", tiny=False)
    assert done.returncode == 0, done.stderr
    after = metrics(old / "cut")
    assert after["status"] == "completed" and after["epochs"] == 400
    assert after["global_step"] > before["global_step"]
    assert after["val_mse"] < 1.01 * after["optimal_val_mse"]


def test_a_completed_run_is_kept_as_it_is(old):
    files = {p: p.read_bytes() for p in (old / "run").rglob("*") if p.is_file()}
    done = cli(*RUN, f"hydra.run.dir={old / 'run'}", tiny=False)
    assert done.returncode == 0, done.stderr
    assert "completed" in done.stdout + done.stderr
    assert {p: p.read_bytes() for p in (old / "run").rglob("*") if p.is_file()} == files


@pytest.mark.parametrize("run", ["run", "cut"])
def test_old_checkpoints_evaluate_and_predict(old, tmp_path, run):
    checkpoint = old / run / "checkpoints" / "last.ckpt"
    scored = entry("eval.py", f"ckpt_path={checkpoint}", f"hydra.run.dir={tmp_path / 'eval'}")
    assert scored.returncode == 0, scored.stderr
    assert f"mse {metrics(old / run)['val_mse']:.6g}" in scored.stdout
    np.save(tmp_path / "new.npy", np.random.default_rng(0).normal(size=(5, 100)).astype(np.float32))
    predicted = entry("predict.py", f"ckpt_path={checkpoint}", f"data.path={tmp_path / 'new.npy'}",
                      f"hydra.run.dir={tmp_path / 'predict'}")  # fmt: skip
    assert predicted.returncode == 0, predicted.stderr
    assert np.load(next((tmp_path / "predict").glob("predictions.*"))).shape == (5, 101)


def test_an_old_sweep_reruns_to_nothing_new_and_reports(old):
    sweep = old / "sweep"
    steps = [metrics(sweep / job)["global_step"] for job in ("0", "1")]
    done = cli(*SWEEP, f"hydra.sweep.dir={sweep}", tiny=False)
    assert done.returncode == 0, done.stderr
    assert [metrics(sweep / job)["global_step"] for job in ("0", "1")] == steps
    reported = subprocess.run([python(), "scripts/report.py", str(sweep)], cwd=ROOT, capture_output=True, text=True)
    assert reported.returncode == 0, reported.stderr
    report = (sweep / "report" / "report.md").read_text()
    assert "data.batch_size" in report and "128" in report and "256" in report
