"""scripts/report.py on a real (small) sweep: report.md, its tables and valid PNG plots."""

import json
import subprocess

import matplotlib.image
import pytest
from conftest import ROOT, cli, compose_config, python
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from experiments.sweeps import figures
from experiments.sweeps import report as reports
from experiments.sweeps.figures import fmt, median_of_repeats
from experiments.sweeps.record import Job

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def report(path) -> subprocess.CompletedProcess:
    command = [python(), "scripts/report.py", str(path)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Two batch sizes x two accumulation settings: four jobs on one CPU device."""
    sweep_dir = tmp_path_factory.mktemp("report") / "sweep"
    # A target every job reaches at its first validation, for the time-to-target plot.
    overrides = ["data.batch_size=32,64", "trainer.accumulate_grad_batches=1,2", "target.mse_ratio=1000"]
    done = cli(*overrides, f"hydra.sweep.dir={sweep_dir}", "-m")
    assert done.returncode == 0, done.stderr[-3000:]
    done = report(sweep_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return sweep_dir


def test_report_has_a_table_row_per_job(sweep):
    text = (sweep / "report" / "report.md").read_text()
    for num in range(4):
        metrics = json.loads((sweep / str(num) / "metrics.json").read_text())
        assert f"| {num} | completed | " in text
        assert fmt(metrics["samples_per_sec"]) in text and fmt(metrics["peak_memory_mb"]) in text
        assert metrics["time_to_target_s"] > 0 and fmt(metrics["time_to_target_s"]) in text
        assert fmt(100 * metrics["compute_ms"] / metrics["step_time_ms"]) in text  # the speed table's compute share


def test_report_plots_are_valid_pngs(sweep):
    out = sweep / "report"
    text = (out / "report.md").read_text()
    expected = ["loss_curves.png", "throughput_vs_batch.png", "memory_vs_batch.png", "accumulation.png"]
    expected.append("time_to_target_vs_batch.png")
    assert sorted(p.name for p in out.glob("*.png")) == sorted(expected)
    for name in expected:
        assert f"]({name})" in text
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE
        height, width, _ = matplotlib.image.imread(out / name).shape
        assert height > 200 and width > 200


def test_report_says_which_plots_the_sweep_has_no_data_for(sweep):
    text = (sweep / "report" / "report.md").read_text()
    # one CPU device throughout: nothing to compare against the CPU baseline, no multi-device scaling
    assert "No plot: no job ran on another accelerator or device count" in text
    assert "No plot: no multi-device job" in text
    assert text.count("No plot") == 2


def test_report_of_one_run(sweep):
    run_dir = sweep / "1"
    done = report(run_dir)
    assert done.returncode == 0, done.stderr
    text = (run_dir / "report" / "report.md").read_text()
    assert text.count("| 1 | completed | ") == 1 and (run_dir / "report" / "loss_curves.png").is_file()


@pytest.mark.slow
def test_report_of_a_dir_without_runs_is_a_one_line_error(tmp_path):
    done = report(tmp_path)
    assert done.returncode != 0
    assert done.stderr.startswith("error: no run under") and "Traceback" not in done.stderr


def test_repeats_differing_only_in_seed_become_their_median(tmp_path):
    def job(num, seed, batch, speed):
        settings = {"seed": str(seed), "data.seed": str(seed), "data.batch_size": str(batch)}
        metrics = {"status": "completed", "samples_per_sec": speed, "step_time_ms": 1e3 * batch / speed}
        return Job(tmp_path / str(num), num, [], "completed", metrics=metrics, settings=settings)

    jobs = [job(0, 2, 64, 100.0), job(1, 0, 64, 900.0), job(2, 1, 64, 400.0), job(3, 0, 128, 700.0)]
    merged = median_of_repeats(jobs)
    assert [(j.num, j.metrics["samples_per_sec"], j.metrics["repeats"]) for j in merged] == [
        (1, 400.0, 3),
        (3, 700.0, 1),
    ]
    assert merged[0].metrics["step_time_ms"] == pytest.approx(1e3 * 64 / 400.0)


def test_plots_show_the_runs_numbers(sweep, tmp_path, monkeypatch):
    # The data behind each plot, read from the figure as it is saved: each loss curve is its job's
    # train/loss as TensorBoard's reader gives it; each throughput point a job's metrics.json.
    plotted = {}
    real_save = reports.save

    def save(fig, path):
        plotted[path.name] = [line.get_xydata().tolist() for ax in fig.axes for line in ax.lines]
        plotted[f"{path.stem}_by_gid"] = [(line.get_gid(), line.get_xydata().tolist()) for line in fig.axes[0].lines]
        panels = [[p for line in ax.lines for p in line.get_xydata().tolist()] for ax in fig.axes]
        plotted[f"{path.stem}_panels"] = panels
        return real_save(fig, path)

    monkeypatch.setattr(reports, "save", save)  # the sections' own plots
    monkeypatch.setattr(figures, "save", save)  # those of with_plot and xy_section
    reports.build_sections(sweep, tmp_path)
    jobs = range(4)
    metrics = [json.loads((sweep / str(num) / "metrics.json").read_text()) for num in jobs]
    # The loss curves against samples seen ((step + 1) x the effective batch: the batches differ), the val/mse
    # dots on the same axis, and the optimum as a line.
    logged, validated = [], []
    for num in jobs:
        (run,) = {f.parent for f in (sweep / str(num) / "tensorboard").glob("**/events.out.tfevents.*")}
        events = EventAccumulator(str(run)).Reload()
        batch = metrics[num]["effective_batch_size"]
        logged.append([[(p.step + 1) * batch, p.value] for p in events.Scalars("train/loss")])
        validated.append([[(p.step + 1) * batch, p.value] for p in events.Scalars("val/mse")])
    lines = plotted["loss_curves_by_gid"]
    curves = [xy for gid, xy in lines if gid is None and xy]  # the legend's own entries have no points
    assert sorted(curves) == sorted(logged)  # the same floats, read back
    assert sorted(xy for gid, xy in lines if gid == "val/mse") == sorted(validated)
    [optimum] = [xy for gid, xy in lines if gid == "optimum"]
    assert {y for _, y in optimum} == {metrics[0]["optimal_val_mse"]}  # one data: one optimum
    points = sorted(p for line in plotted["throughput_vs_batch.png"] for p in line)
    assert points == sorted([m["global_batch_size"], m["samples_per_sec"]] for m in metrics)
    # The time-to-target plot: a panel of times and one of optimizer steps, each point a job's metrics.json.
    time_panel, steps_panel = plotted["time_to_target_vs_batch_panels"]
    assert sorted(time_panel) == sorted([m["effective_batch_size"], m["time_to_target_s"]] for m in metrics)
    assert sorted(steps_panel) == sorted([m["effective_batch_size"], m["steps_to_target"]] for m in metrics)


@pytest.fixture(scope="module")
def missed_sweep(tmp_path_factory):
    """B=32 reaches 2x the optimum in TINY's two epochs; B=256 (4 steps an epoch) ends near 100x: it misses."""
    sweep_dir = tmp_path_factory.mktemp("missed") / "sweep"
    done = cli("data.batch_size=32,256", "target.mse_ratio=2", f"hydra.sweep.dir={sweep_dir}", "-m")
    assert done.returncode == 0, done.stderr[-3000:]
    return sweep_dir


@pytest.mark.slow
def test_a_job_that_missed_the_target_is_in_the_table_and_marked_on_the_plot(missed_sweep, tmp_path, monkeypatch):
    plotted = {}
    real_save = reports.save

    def save(fig, path):
        plotted[path.name] = [[(line.get_label(), line.get_xydata().tolist()) for line in ax.lines] for ax in fig.axes]
        return real_save(fig, path)

    monkeypatch.setattr(reports, "save", save)  # the sections' own plots
    monkeypatch.setattr(figures, "save", save)  # those of with_plot and xy_section
    (section,) = [s for s in reports.build_sections(missed_sweep, tmp_path) if s.title.startswith("Time to target")]
    reached, missed = (json.loads((missed_sweep / n / "metrics.json").read_text()) for n in ("0", "1"))
    assert reached["time_to_target_s"] is not None and missed["time_to_target_s"] is None
    rows = {row["global_batch_size"]: row for row in section.rows}
    assert rows[32]["time_to_target_s"] == reached["time_to_target_s"]
    assert rows[256]["time_to_target_s"] == "not reached"
    (events,) = {f.parent for f in (missed_sweep / "1" / "tensorboard").glob("**/events.out.tfevents.*")}
    best = min(p.value for p in EventAccumulator(str(events)).Reload().Scalars("val/mse"))
    assert rows[256]["best_val_mse"] == pytest.approx(best)
    assert rows[256]["best_over_optimum"] == pytest.approx(best / missed["optimal_val_mse"])
    assert rows[256]["best_over_optimum"] > 2  # the target: target.mse_ratio x the optimum
    for panel in plotted["time_to_target_vs_batch.png"]:  # each panel: the reached point, a cross at B=256
        lines = dict(panel)
        assert [x for x, _ in lines["cpu x1 single_device"]] == [32]
        assert [x for x, _ in lines["cpu x1 single_device: not reached"]] == [256]


@pytest.mark.parametrize("batch", [64, 256, 1024])
def test_the_default_log_interval_suits_the_readmes_sweep(batch):
    # README: python train.py -m data.batch_size=64,256,1024 ...: an epoch of each has at least the interval's steps
    # (else Lightning warns, and the curve has fewer points than epochs); and the first point comes while the loss
    # still falls: within the first tenth of the default problem's first epoch.
    cfg = compose_config(f"data.batch_size={batch}", tiny=False)
    train_samples = cfg.data.num_samples - round(cfg.data.num_samples * cfg.data.val_fraction)
    steps_per_epoch = train_samples // batch
    assert cfg.trainer.log_every_n_steps <= steps_per_epoch
    if batch == 256:
        assert cfg.trainer.log_every_n_steps <= steps_per_epoch / 10
