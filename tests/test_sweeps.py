"""Hydra multiruns through the real CLI: launchers, results.csv, failures, TensorBoard naming."""

import csv
import json

import pytest
from conftest import cli, tensorboard_get, tensorboard_post, tensorboard_server

LEARNING_RATES = ["0.01", "0.02", "0.05", "0.1"]


def read_results(sweep_dir) -> list[dict]:
    with open(sweep_dir / "results.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def joblib_sweep(tmp_path_factory):
    """Four jobs, two at a time, in joblib's worker processes."""
    sweep_dir = tmp_path_factory.mktemp("joblib") / "sweep"
    done = cli(
        f"optimizer.lr={','.join(LEARNING_RATES)}",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        f"hydra.sweep.dir={sweep_dir}",
        "--multirun",  # after the overrides: cli() puts its TINY overrides first
    )
    return done, sweep_dir


@pytest.mark.slow
def test_joblib_sweep_runs_four_jobs_two_at_a_time(joblib_sweep):
    done, sweep_dir = joblib_sweep
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2" in done.stdout + done.stderr
    rows = read_results(sweep_dir)
    assert [row["job"] for row in rows] == ["0", "1", "2", "3"]
    assert [row["status"] for row in rows] == ["completed"] * 4
    assert [row["optimizer.lr"] for row in rows] == LEARNING_RATES
    assert all(row["error"] == "" and float(row["samples_per_sec"]) > 0 for row in rows)


@pytest.mark.slow
def test_parallel_jobs_keep_to_their_own_directories(joblib_sweep):
    _, sweep_dir = joblib_sweep
    assert sorted(p.name for p in sweep_dir.iterdir()) == [".lock", ".results.lock", "0", "1", "2", "3",
                                                           "multirun.yaml", "results.csv"]  # fmt: skip
    for num, lr in enumerate(LEARNING_RATES):
        job_dir = sweep_dir / str(num)
        assert json.loads((job_dir / "metrics.json").read_text())["status"] == "completed"
        assert json.loads((job_dir / "job.json").read_text())["overrides"][-1] == f"optimizer.lr={lr}"
        # the job's own config, and exactly one TensorBoard run, named for the job's overrides
        assert f"lr: {lr}" in (job_dir / ".hydra" / "config.yaml").read_text()
        runs = {p.parent for p in job_dir.glob("tensorboard/**/events.out.tfevents.*")}
        assert len(runs) == 1 and runs.pop().name == f"lr={lr}"


def test_a_failing_job_does_not_stop_the_others(tmp_path):
    # Job 0 asks for a model that does not fit the data: it raises before it writes metrics.json.
    sweep_dir = tmp_path / "sweep"
    done = cli("model.in_features=3,null", f"hydra.sweep.dir={sweep_dir}", "--multirun")
    assert done.returncode == 1
    failed, completed = read_results(sweep_dir)
    assert (failed["job"], failed["model.in_features"], failed["status"]) == ("0", "3", "failed")
    assert failed["error"].startswith("ConfigError: model.in_features=3") and failed["samples_per_sec"] == ""
    assert not (sweep_dir / "0" / "metrics.json").exists()
    assert (completed["job"], completed["model.in_features"], completed["status"]) == ("1", "null", "completed")
    assert completed["error"] == "" and float(completed["val_mse"]) > 0


@pytest.mark.slow
def test_a_diverging_job_fails_alone(tmp_path):
    # A huge learning rate makes the loss non-finite within a few steps: that job fails, the next one runs.
    sweep_dir = tmp_path / "sweep"
    done = cli("optimizer.lr=1e6,0.05", f"hydra.sweep.dir={sweep_dir}", "--multirun")
    assert done.returncode == 1
    diverged, completed = read_results(sweep_dir)
    assert (diverged["optimizer.lr"], diverged["status"]) == ("1000000.0", "failed")
    assert "diverged" in diverged["error"] and "lr" in diverged["error"]
    assert json.loads((sweep_dir / "0" / "metrics.json").read_text())["status"] == "failed"
    assert (completed["optimizer.lr"], completed["status"]) == ("0.05", "completed")


@pytest.mark.slow
def test_submitit_local_sweep_completes(tmp_path):
    sweep_dir = tmp_path / "sweep"
    done = cli("optimizer.lr=0.01,0.1", "hydra/launcher=submitit_local", f"hydra.sweep.dir={sweep_dir}", "--multirun")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [row["status"] for row in read_results(sweep_dir)] == ["completed", "completed"]
    assert (sweep_dir / ".submitit").is_dir()


@pytest.mark.slow
def test_tensorboard_server_lists_every_job_by_what_the_sweep_varies(joblib_sweep):
    _, sweep_dir = joblib_sweep
    with tensorboard_server(sweep_dir, runs=len(LEARNING_RATES)) as url:
        tags = tensorboard_get(url, "data/plugin/scalars/tags")
        # the swept setting alone, short: every job shares the TINY overrides and the launcher's
        assert sorted(tags) == [f"{num}/tensorboard/lr={lr}" for num, lr in enumerate(LEARNING_RATES)]
        for run_tags in tags.values():
            assert "train/loss" in run_tags and "whole_run/val_mse" in run_tags
        # the HPARAMS tab: one session per job, with its learning rate and its final figures
        query = {"experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS"], "colParams": [],
                 "startIndex": 0, "sliceSize": 100}  # fmt: skip
        groups = tensorboard_post(url, "data/plugin/hparams/session_groups", query)["sessionGroups"]
        assert sorted(g["hparams"]["lr"] for g in groups) == [float(lr) for lr in LEARNING_RATES]
        for group in groups:
            assert "whole_run/val_mse" in {m["name"]["tag"] for m in group["metricValues"]}


def test_a_job_reports_its_own_peak_memory_not_its_process(run_in_process):
    # Jobs that share a process (basic launcher, joblib worker) must not inherit an earlier job's peak.
    import resource

    earlier_job = b"x" * (800 * 2**20)  # 800 MiB, resident: every page is written
    del earlier_job
    process_peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    metrics, _ = run_in_process()
    assert metrics["peak_memory_mb"] < process_peak_mb - 400
