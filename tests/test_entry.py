"""docs/failures.md's promises at the command line: one `error:` line and exit 2 for bad input of every group,
signals at every moment of a run, and timings measured against the test's own clock."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from background import wait_for
from conftest import ROOT, TINY, cli, compose_config, python

from experiments.commands.train import train
from experiments.config.nearest import config_keys, nearest_keys
from experiments.data import SyntheticRegression
from experiments.run.signals import Interrupted
from experiments.training.module import Regressor

# (override, what the line must name): one or two per group, and Hydra's own composition errors. Each is
# a CLI start (a few seconds); the in-process checks (test_faults_input.py) cover the other settings.
BAD_INPUT = [
    ("trainer.limit_train_batches=-1", "trainer.limit_train_batches=-1"),  # Lightning's constructor refused it
    ("trainer.max_steps=0", "trainer.max_steps=0"),
    ("strategy=ddp_spawn", "data.batch_size=64"),  # with trainer.devices=3 below: 64 does not split
    ("data.on_device=yes", "data.on_device=yes"),
    ("model.in_features=5", "model.in_features=5"),
    ("optimizer.lr=-1", "optimizer.lr=-1"),
    ("logger=nope", "logger=nope"),  # an unknown option: Hydra's composition
    ("trainer.nope=1", "trainer.nope=1"),  # an unknown key: Hydra's composition
    ("trainer.max_epochs=[1", "trainer.max_epochs=[1"),  # not an override
]


@pytest.mark.parametrize(("override", "named"), BAD_INPUT)
@pytest.mark.slow
def test_cli_bad_input_is_one_error_line_and_exit_2(tmp_path, override, named):
    extra = ["trainer.devices=3"] if override.startswith("strategy=") else []
    result = cli(override, *extra, f"hydra.run.dir={tmp_path / 'run'}", timeout=60)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(errors) == 1 and errors[0].startswith(f"error: {named}") and "allowed:" in errors[0], errors
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "metrics.json").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()


# -------------------------------------------------------------------------------- signals at every moment


def signalled(monkeypatch, cls, hook: str, signum: int, at_call: int = 1) -> None:
    """`os.kill(self, signum)` at the `at_call`-th call of `cls.hook`, which then runs as usual."""
    original, calls = getattr(cls, hook), []

    def send(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == at_call:
            os.kill(os.getpid(), signum)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, hook, send)


@pytest.mark.parametrize(
    ("cls", "hook"),
    [
        pytest.param(SyntheticRegression, "load", id="while the data is made"),
        pytest.param(Regressor, "setup", id="while the ranks start"),  # inside trainer.fit, before the loops
    ],
)
def test_ctrl_c_before_training_exits_130_with_nothing_saved(tmp_path, monkeypatch, cls, hook):
    before = signal.getsignal(signal.SIGINT)
    signalled(monkeypatch, cls, hook, signal.SIGINT)
    with pytest.raises(Interrupted) as stop:
        train(compose_config("logger=none"), tmp_path / "run")
    assert stop.value.exit_code == 130 and stop.value.checkpoint is None
    assert not (tmp_path / "run" / "metrics.json").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert signal.getsignal(signal.SIGINT) is before  # the run's handlers are gone with it


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_during_the_final_validation_exits_128_plus_n_interrupted(tmp_path, monkeypatch, signum):
    # TINY: 2 epochs of 8 steps, 2 validation batches each: the 3rd validation batch is the final validation.
    signalled(monkeypatch, Regressor, "on_validation_batch_start", signum, at_call=3)
    with pytest.raises(Interrupted) as stop:
        train(compose_config("logger=none"), tmp_path / "run")
    assert stop.value.exit_code == 128 + signum
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (metrics["status"], metrics["global_step"], metrics["epochs"]) == (
        "interrupted",
        16,
        2,
    )  # the whole run: 2 epochs done


@pytest.mark.slow
def test_each_sweep_job_times_only_itself(tmp_path):
    started = time.time()
    sweep = ["-m", *TINY, "logger=none", "seed=0,1,2", f"hydra.sweep.dir={tmp_path}"]
    result = cli(*sweep, tiny=False, timeout=180, interpreter=sys.executable)  # the first job's start is the imports
    waited = time.time() - started
    assert result.returncode == 0, result.stderr[-2000:]
    jobs = [json.loads((tmp_path / str(n) / "metrics.json").read_text()) for n in range(3)]
    for job in jobs:
        assert 0 < job["startup_s"] < job["wall_time_s"]
    # One process runs the three jobs one after another: their own times add up to at most the whole.
    assert sum(job["wall_time_s"] for job in jobs) <= waited
    assert jobs[0]["startup_s"] > max(job["startup_s"] for job in jobs[1:])  # only the first waited for imports


@pytest.mark.slow
def test_an_interrupted_sweep_job_is_a_row_and_the_sweep_stops(tmp_path):
    long_job = ["data.num_samples=1000", "data.batch_size=4", "trainer.max_epochs=2", "logger=csv"]
    command = [python(), "train.py", "-m", *TINY, *long_job, "seed=0,1", f"hydra.sweep.dir={tmp_path}"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for((tmp_path / "0" / "csv" / "metrics.csv").exists, "job 0 to train", process, timeout=120)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 143, stderr[-2000:]
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [(row["job"], row["status"]) for row in rows] == [("0", "interrupted")]
    assert not (tmp_path / "1").exists()  # the sweep stopped


# ------------------------------------------------------------------------------------------------- --help

HELP_PROBE = """
import runpy, sys
sys.argv = [sys.argv[1], "--help", *sys.argv[2:]]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print("heavy:", sorted(m for m in ("torch", "lightning", "numpy") if m in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize("script", ["train.py", "eval.py", "predict.py", "advise.py"])
def test_help_is_a_page_with_examples_the_menu_and_the_settings_without_loading_torch(script):
    done = subprocess.run(
        [sys.executable, "-c", HELP_PROBE, script, "data.batch_size=7"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "heavy: []" in done.stderr  # what made --help take seconds: it answers before any of them loads
    page = done.stdout
    assert page.startswith(f"python {script}: ") and "\nExamples:\n" in page
    assert f"python {script} --cfg job" in page and "docs/" in page  # the whole config, and where the docs are
    assert re.search(r" batch_size=7\b", page)  # the settings, as the overrides compose them
    if script == "train.py":
        examples = page.split("Examples:")[1].split("\n\n")[0]
        assert examples.count("\n  python train.py") >= 5 and " -m " in examples and "hparams_search=optuna" in examples
        conf = ROOT / "conf"
        for group in ("data", "optimizer", "scheduler", "callbacks", "logger", "strategy", "debug"):
            options = ", ".join(sorted(p.stem for p in (conf / group).glob("*.yaml")))
            assert f"\n  {group}: {options}" in page.replace("*", ""), group
        # The study's experiments apart from the user's.
        [experiments] = [line for line in page.splitlines() if line.startswith("  experiment: ")]
        assert "seed_large" in experiments and "study_" not in experiments and "the study's own" in page
        # What the checkpoint settings show is what is saved: last.ckpt, and no best copies by default.
        assert "save_last" not in page and "checkpoints/last.ckpt" in page and "best_checkpoints.save_top_k=0" in page


def test_help_with_a_bad_override_is_one_error_line():
    command = [python(), "train.py", "--help", "data.nope=1"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip().startswith("error: data.nope=1: data has no key nope")


# ------------------------------------------------------------------------------- a typo, a bad value, at once

REFUSAL_PROBE = """
import atexit, runpy, sys
atexit.register(lambda: print("heavy:", sorted(m for m in ("torch", "lightning") if m in sys.modules), file=sys.stderr))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize(
    ("script", "override", "named"),
    [
        ("train.py", "data.batch_size=-1", "data.batch_size=-1 is not allowed; allowed: an integer >= 1"),
        ("train.py", "optimizer.lr=0", "optimizer.lr=0 is not allowed"),
        ("eval.py", "trainer.devices=0", "trainer.devices=0 is not allowed"),
        ("predict.py", "data.batch_size=0", "data.batch_size=0 is not allowed"),
        ("advise.py", "advise.repeats=2", "advise.repeats=2 is not allowed; allowed: an integer >= 3"),
        ("advise.py", "data.batch_size=0", "data.batch_size=0 is not allowed"),
    ],
)
def test_a_bad_value_is_refused_before_torch_is_imported_and_leaves_nothing(tmp_path, script, override, named):
    # What took 4.8 s was importing torch and Lightning before the check: the refusal now comes before them.
    run_dir = tmp_path / "out" / "run"
    args = {"eval.py": ["ckpt_path=x.ckpt"], "predict.py": ["ckpt_path=x.ckpt", "data.path=x.csv"]}.get(script, [])
    command = [sys.executable, "-c", REFUSAL_PROBE, script, *args, override, f"hydra.run.dir={run_dir}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(f"error: {named}") and "heavy: []" in done.stderr, done.stderr
    assert not run_dir.exists()  # nothing written: not Hydra's .hydra/, not train.log, not the dir


@pytest.mark.parametrize(
    ("override", "meant"),
    [("trainer.devics=2", "trainer.devices"), ("lr=0.1", "optimizer.lr"), ("data.bach_size=8", "data.batch_size")],
)
def test_a_mistyped_key_is_answered_with_the_key_it_was_meant_to_be(tmp_path, override, meant):
    done = subprocess.run(
        [python(), "train.py", override, f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True
    )
    [line] = done.stderr.strip().splitlines()
    assert done.returncode == 2 and line.startswith(f"error: {override}: ") and "allowed: a key of" in line, line
    assert f"did you mean {meant}?" in line and f"+{override}" not in line  # not the advice to add the typo


def test_the_nearest_keys_are_typos_of_the_name_not_neighbours_in_the_tree():
    keys = config_keys(compose_config())
    assert nearest_keys("trainer.devics", keys) == ["trainer.devices"]
    assert nearest_keys("max_epoch", keys)[0] == "trainer.max_epochs"  # another parent: found by its name
    assert nearest_keys("trainer.nope", keys) == []  # `trainer.` in common makes no typo of trainer.num_nodes
    assert "data" in keys and "data.batch_size" in keys and not any(k.startswith("hydra") for k in keys)
