"""`python advise.py`: its advice.json, its verdicts when timings cannot be told apart, its refusals, an interrupted
advice, one core, and (the `alone` test) that the speed-up it predicts is what full train.py runs measure."""

import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, python

from experiments.advice.plan import Option, command
from experiments.advice.trials import Measurement
from experiments.advice.verdicts import recommend, speed_words

# The seed's Linear at d=100 (conf/data/synthetic.yaml), trained as a user might: micro-batches of 64 accumulated to
# 256, which one batch of 256 trains with the same maths, faster.
USER = ["data.batch_size=64", "trainer.accumulate_grad_batches=4", "trainer.max_epochs=20"]
QUICK = ["advise.budget_s=25", "advise.max_batch=1024", "advise.compile=false"]


def advise(*args: str, run_dir: Path, interpreter: str | None = None, **kwargs) -> subprocess.CompletedProcess:
    command = [interpreter or python(), "advise.py", *args, f"hydra.run.dir={run_dir}"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, **kwargs)


@pytest.fixture(scope="module")
def advice(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("advice") / "run"
    done = advise(*USER, *QUICK, "advise.ddp=false", run_dir=run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((run_dir / "advice.json").read_text()), done.stdout, run_dir


@pytest.mark.alone  # its advice, and so its command, comes from timings
def test_advice_json_holds_the_command_its_speedup_the_machine_and_the_measurements(advice):
    record, out, run_dir = advice
    assert {"command", "speedup", "yours", "machine", "versions", "measurements", "verdicts"} <= record.keys()
    assert record["machine"]["cpus_usable"] >= 1 and record["versions"]["torch"]
    words = shlex.split(record["command"])
    assert words[:2] == ["python", "train.py"] and "data.batch_size=256" in words
    assert "trainer.accumulate_grad_batches=1" in words and "data.batch_size=64" not in words
    assert record["speedup"] > 1 and record["command"] in out  # printed as it is written
    for m in record["measurements"]:  # every figure a median within its range of at least `repeats` timings
        if m["error"] is None:
            assert len(m["rates"]) >= 3 and min(m["rates"]) <= m["low"] <= m["samples_per_sec"] <= m["high"]
    assert (run_dir / "throughput.png").stat().st_size > 10_000
    assert "samples/s: median [quartiles]" in out and "What pays here:" in out


def measured(name: str, rates: list[float], micro: int = 256, knob: str = "batch") -> Measurement:
    return Measurement(Option(name, knob, {"data.batch_size": micro}, micro), rates=rates)


def test_options_whose_timings_overlap_cannot_be_told_apart_and_the_advice_keeps_the_users_command():
    yours = measured("your command", [100, 110, 120, 130, 140], knob="yours")
    close = measured("B=256 x1", [115, 125, 135, 145, 150])  # faster in the median; its quartiles overlap yours
    assert "cannot be told apart from your command" in speed_words(close, yours)
    assert recommend([close], yours, {}, 0.01) is yours
    apart = measured("B=256 x1", [140, 150, 160, 170, 180])
    assert speed_words(apart, yours) == "1.33x as fast as your command" and recommend([apart], yours, {}, 0.01) is apart


def test_the_recommended_command_replaces_the_users_own_settings():
    option = Option("B=256 x1", "batch", {"data.batch_size": 256, "trainer.accumulate_grad_batches": 1}, 256)
    line = command(["model=mlp", "model.hidden=[8,8]", "batch.effective=256", "data.batch_size=64"], option)
    assert line == (
        "python train.py model=mlp 'model.hidden=[8,8]' data.batch_size=256 trainer.accumulate_grad_batches=1 "
        "batch.effective=null"
    )


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["advise.repeats=1"], "advise.repeats=1 is not allowed; allowed: an integer >= 3"),
        (["advise.budget_s=-5"], "advise.budget_s=-5 is not allowed"),
        (["data=file", "data.path=no-such.csv"], "data.path=no-such.csv: no such file"),
        (["model=mlp", "model.hidden=[200000,200000]"], "model.hidden=[200000, 200000] with 100 input features"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, args, named):
    run_dir = tmp_path / "advice"
    done = advise(*args, run_dir=run_dir)
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {named}"), line  # the lab's own line (train.py gives the same)
    assert not run_dir.exists()


def test_one_core_skips_ddp_and_says_why(tmp_path):
    run_dir = tmp_path / "advice"
    one_core = {"preexec_fn": lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})}
    done = advise(*USER, *QUICK, "advise.budget_s=8", run_dir=run_dir, interpreter=sys.executable, **one_core)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((run_dir / "advice.json").read_text())
    assert record["machine"]["cpus_usable"] == 1
    assert any("1 core" in note and "DDP" in note for note in record["not_measured"]), record["not_measured"]
    assert not any(m["devices"] > 1 for m in record["measurements"])


def processes_naming(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_ctrl_c_during_a_ddp_trial_leaves_no_process(tmp_path):
    run_dir = tmp_path / "advice"
    # Straight to DDP: no batch sweep above the user's batch, the layouts' trials short.
    args = [*USER, "advise.budget_s=60", "advise.max_batch=256", "advise.compile=false", "advise.repeats=3"]
    command = [sys.executable, "advise.py", *args, f"hydra.run.dir={run_dir}"]
    advice = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    trials = f"hydra.run.dir={run_dir}/trials/"
    deadline = time.monotonic() + 120
    while not processes_naming(trials) and advice.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_naming(trials), "no DDP trial started"
    time.sleep(2)  # its ranks are up
    advice.send_signal(signal.SIGINT)
    advice.wait(timeout=60)
    assert advice.returncode == 130, advice.stderr.read()[-2000:]
    time.sleep(1)
    assert processes_naming(trials) == [] and processes_naming(str(run_dir)) == []


def cli_speed(overrides: list[str], run_dir: Path) -> dict:
    command = [sys.executable, "train.py", *overrides, "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.slow
@pytest.mark.alone
def test_the_predicted_speedup_is_what_full_runs_measure_within_15_percent(advice, tmp_path):
    record, _, _ = advice
    recommended = shlex.split(record["command"])[2:]
    ratios, runs = [], {}
    for rep in range(3):  # interleaved, paired within a repetition
        yours = cli_speed(USER, tmp_path / f"yours{rep}")
        ours = cli_speed(recommended, tmp_path / f"recommended{rep}")
        ratios.append(ours["samples_per_sec"] / yours["samples_per_sec"])
        runs = {"yours": yours, "recommended": ours}
    measured = statistics.median(ratios)
    assert abs(record["speedup"] / measured - 1) <= 0.15, (record["speedup"], ratios)
    gap = abs(runs["recommended"]["val_mse"] / runs["yours"]["val_mse"] - 1)
    assert gap <= record["val_mse_tolerance"], (gap, record["val_mse_tolerance"])
