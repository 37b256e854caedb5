"""TensorBoard as a person sees it (docs/tensorboard.md): a small sweep through the real CLI and its report,
served by TensorBoard's own server (a free port picked at run time), read through its data endpoints and in a
real browser: Debian's `chromium` driven by Playwright (`executable_path`, no browser download).

The browser test skips where Playwright or Chromium is missing; CI sets GPU_LAB_REQUIRE_BROWSER=1, so a skip
fails there. GPU_LAB_SCREENSHOTS=DIR keeps its screenshots in DIR (docs/tensorboard/ holds the committed ones).
"""

import json
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, cli, python, tensorboard_get, tensorboard_post, tensorboard_server

BATCH_SIZES = [32, 64]
RUNS = [f"{num}/tensorboard/batch_size={b}" for num, b in enumerate(BATCH_SIZES)]
# 512 training samples, 4 epochs logged every step (64 and 32 steps); a target both jobs reach
SWEEP = [f"data.batch_size={','.join(map(str, BATCH_SIZES))}", "trainer.max_epochs=4", "target.mse_ratio=1.5"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    sweep_dir = tmp_path_factory.mktemp("tensorboard") / "sweep"
    done = cli(*SWEEP, f"hydra.sweep.dir={sweep_dir}", "--multirun")
    assert done.returncode == 0, done.stderr[-3000:]
    report = subprocess.run([python(), "scripts/report.py", str(sweep_dir)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert report.returncode == 0, report.stderr[-3000:]
    return sweep_dir


@pytest.fixture(scope="module")
def server(sweep):
    with tensorboard_server(sweep, runs=len(RUNS) + 1) as url:
        yield url


get, post = tensorboard_get, tensorboard_post


def metrics(sweep: Path, num: int) -> dict:
    return json.loads((sweep / str(num) / "metrics.json").read_text())


def test_runs_are_named_for_what_the_sweep_varies(server):
    assert get(server, "data/runs") == [*RUNS, "report"]  # the report's plots: a run of their own


def test_scalars_are_curves_and_the_final_figures_one_point_each(server, sweep):
    tags = get(server, "data/plugin/scalars/tags")
    for num, run in enumerate(RUNS):
        assert "epoch" not in tags[run]  # Lightning's staircase, dropped
        assert {"train/loss", "val/mse", "val/mse_over_optimum", "perf/step_time_ms"} <= tags[run].keys()
        losses = get(server, "data/plugin/scalars/scalars", run=run, tag="train/loss")
        assert len(losses) == metrics(sweep, num)["global_step"]  # logged every step
        ratios = [v for _, _, v in get(server, "data/plugin/scalars/scalars", run=run, tag="val/mse_over_optimum")]
        on_disk = metrics(sweep, num)
        # one point per validation (every epoch); the last one's weights are the final ones
        assert len(ratios) == 4
        assert ratios[-1] == pytest.approx(on_disk["val_mse"] / on_disk["optimal_val_mse"], rel=1e-3)
        figures = {tag for tag in tags[run] if tag.startswith("whole_run/")}
        assert figures == {"whole_run/val_mse", "whole_run/optimum_distance", "whole_run/samples_per_sec",
                           "whole_run/step_time_ms", "whole_run/time_to_target_s", "whole_run/val_r2"}  # fmt: skip
        for tag in figures:
            assert len(get(server, "data/plugin/scalars/scalars", run=run, tag=tag)) == 1


def test_hparams_columns_are_the_key_settings_the_swept_ones_first(server):
    experiment = post(server, "data/plugin/hparams/experiment", {"experimentName": ""})
    columns = [(info["name"], info.get("differs", False)) for info in experiment["hparamInfos"]]
    # TensorBoard lists the columns that differ first, then by name, and shows the first five.
    assert columns[:2] == [("batch_size", True), ("effective_batch_size", True)]
    names = {name for name, _ in columns}
    assert {"optimizer", "lr", "accumulate_grad_batches", "devices", "strategy", "precision", "num_samples"} <= names
    assert not any(name.endswith("_target_") or "/" in name or "." in name for name in names)
    assert [info["displayName"] for info in experiment["metricInfos"]] == [
        "val_mse", "optimum_distance", "samples_per_sec", "step_time_ms", "time_to_target_s", "val_r2"
    ]  # fmt: skip


def test_hparams_rows_hold_each_jobs_settings_and_metrics_json_figures(server, sweep):
    query = {"experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE"],
             "colParams": [], "startIndex": 0, "sliceSize": 100}  # fmt: skip
    groups = post(server, "data/plugin/hparams/session_groups", query)["sessionGroups"]
    assert sorted(group["name"] for group in groups) == [f"{num}/batch_size={b}" for num, b in enumerate(BATCH_SIZES)]
    for group in groups:
        num = int(group["name"].split("/")[0])
        on_disk = metrics(sweep, num)
        assert group["hparams"]["batch_size"] == BATCH_SIZES[num]
        assert group["hparams"]["optimizer"] == "sgd" and group["hparams"]["strategy"] == on_disk["strategy"]
        assert None not in group["hparams"].values()
        (session,) = group["sessions"]
        assert session["status"] == "STATUS_SUCCESS"
        values = {m["name"]["tag"].removeprefix("whole_run/"): m["value"] for m in group["metricValues"]}
        assert values["val_mse"] == pytest.approx(on_disk["val_mse"])
        assert values["samples_per_sec"] == pytest.approx(on_disk["samples_per_sec"])


def test_custom_scalars_layout_compares_the_runs(server):
    layout = get(server, "data/plugin/custom_scalars/layout")
    (category,) = layout["category"]
    charts = {chart["title"]: chart["multiline"]["tag"] for chart in category["chart"]}
    assert charts["val MSE / exact optimum (1 = the optimum)"] == ["^val/mse_over_optimum$"]
    assert charts["throughput (samples/s)"] == ["^perf/samples_per_sec$"]
    assert charts["step-time parts (ms): data, transfer, compute, framework"] == [
        "^perf/(data|transfer|compute|framework)_ms$"
    ]


def test_the_reports_plots_are_tensorboard_images(server, sweep):
    images = get(server, "data/plugin/images/tags")["report"]
    plots = {p.stem for p in (sweep / "report").glob("*.png")}
    assert plots and set(images) == {f"whole_sweep/{stem}" for stem in plots}


# In the browser ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_person_sees_curves_named_runs_and_the_swept_knob(server, browser, screenshots):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(server + "#timeseries")
    groups = page.locator("metrics-card-groups .card-group")
    page.wait_for_function("document.querySelectorAll('metrics-card-groups .card-group').length >= 5", timeout=60e3)
    page.locator("metrics-card-groups scalar-card").first.wait_for(timeout=60e3)
    titles = groups.locator(".group-title").all_inner_texts()
    assert titles == ["perf", "train", "val", "whole_run", "whole_sweep"]
    # TensorBoard opens the first two groups: curves; the final figures and the report's plots stay closed.
    shown = [groups.nth(i).locator("card-view").count() for i in range(len(titles))]
    assert shown[0] > 0 and shown[1] > 0 and shown[3] == shown[4] == 0, dict(zip(titles, shown, strict=True))
    # The cards drawn on opening (Time Series draws those in view): curves of every run, many points each.
    first = page.locator("metrics-card-groups scalar-card tb-truncated-path.tag").evaluate_all(
        "cards => cards.map(card => card.title)"
    )
    assert len(first) >= 4 and all(tag.startswith("perf/") for tag in first), first
    # a perf point a window: at least one an epoch (a window ends at an epoch's end at the latest; docs/speed.md)
    for tag in first:
        for run in RUNS:
            assert len(get(server, "data/plugin/scalars/scalars", run=run, tag=tag)) >= 4, (run, tag)
    runs = page.locator("tb-data-table-content-row[data-id^='defaultExperimentId/']").evaluate_all(
        "rows => [...new Set(rows.map(row => row.dataset.id.split('/').slice(1).join('/')))]"
    )
    assert sorted(runs) == sorted([*RUNS, "report"])
    page.wait_for_timeout(2000)  # the charts draw in a worker
    page.screenshot(path=screenshots / "time_series.png")

    page.set_viewport_size({"width": 2400, "height": 420})  # the table's 12 columns side by side
    page.goto(server + "#hparams")
    headers = page.locator("tf-hparams-table-view .table-header")
    headers.filter(has_text="val_mse").first.wait_for(timeout=60e3)
    visible = headers.all_inner_texts()
    assert {"batch_size", "effective_batch_size", "val_mse", "samples_per_sec"} <= set(visible), visible
    assert not any(h.endswith("_target_") or "/" in h for h in visible), visible  # no class paths
    cells = page.locator("tf-hparams-table-view vaadin-grid-cell-content")
    for num, batch_size in enumerate(BATCH_SIZES):  # a row per job, its Trial ID first (the rows load after)
        cells.filter(has_text=f"{num}/batch_size={batch_size}").first.wait_for(timeout=60e3)
    page.screenshot(path=screenshots / "hparams.png")

    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(server + "#custom_scalars")
    page.locator("tf-custom-scalar-multi-line-chart-card").first.wait_for(timeout=60e3)
    page.wait_for_timeout(2000)
    page.screenshot(path=screenshots / "custom_scalars.png")
    page.close()
