"""The Optuna search (docs/sweeps.md): `hparams_search=optuna` through the real CLI on the project's own sweeper
(src/hydra_plugins/lab_optuna_sweeper), its study in the sweep dir, continued, a killed trial failed, a study of
Optuna 2.10 refused; the search space and the samplers in process; optuna-dashboard through its own CLI, read
through its HTTP API and in a real browser (skipped without Chromium, a failure under GPU_LAB_REQUIRE_BROWSER).
GPU_LAB_SCREENSHOTS=DIR keeps the dashboard's screenshot in DIR (docs/sweeps/ holds the committed one)."""

import csv
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

import optuna
import pytest
from background import wait_for
from conftest import ROOT, TINY, python
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from experiments.commands.entry import CONFIG_DIR
from experiments.config.errors import ConfigError
from hydra_plugins.lab_optuna_sweeper._search import ABANDONED, Search
from hydra_plugins.lab_optuna_sweeper._space import grid, search_space

# A study of Optuna 2.10.1 (two trials), as `sqlite3 .dump` text: made once in a throwaway venv
# (pip install optuna==2.10.1 'sqlalchemy<2'), so that no test needs Optuna 2 installed.
OPTUNA_2_10_STUDY = Path(__file__).parent / "data" / "optuna-2.10.1-study.sql"
STATE = {"completed": TrialState.COMPLETE, "failed": TrialState.FAIL}


def search_command(sweep_dir: Path, *args: str) -> list[str]:
    return [python(), "train.py", "-m", *TINY, "hparams_search=optuna", *args, f"hydra.sweep.dir={sweep_dir}"]


def search(sweep_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(search_command(sweep_dir, *args), cwd=ROOT, capture_output=True, text=True, timeout=300)


def results(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "results.csv") as f:
        return list(csv.DictReader(f))


def study_of(sweep_dir: Path) -> optuna.Study:
    return optuna.load_study(study_name="gpu-lab", storage=f"sqlite:///{sweep_dir / 'optuna.db'}")


def assert_study_and_results_agree(sweep_dir: Path) -> None:
    """Each trial is the job of its number: the same overrides, dir, state and value as its row of results.csv."""
    rows = {int(row["job"]): row for row in results(sweep_dir)}
    trials = study_of(sweep_dir).trials
    assert sorted(rows) == [t.number for t in trials]
    for trial in trials:
        row = rows[trial.number]
        assert trial.user_attrs["job"] == trial.number
        assert trial.user_attrs["overrides"] == row["overrides"].split()
        assert trial.user_attrs["dir"] == str(Path(row["dir"]).resolve()) == str(sweep_dir / str(trial.number))
        assert trial.state == STATE[row["status"]], row
        if trial.state == TrialState.COMPLETE:
            assert trial.value == pytest.approx(float(row["val_mse"]))
        else:
            assert trial.user_attrs.get("error", ABANDONED) in (row["error"], ABANDONED)


# ------------------------------------------------------------------------------------------- a search on the CLI


@pytest.fixture(scope="module")
def failed_trial_search(tmp_path_factory) -> Path:
    """Four trials, the study in the sweep dir (the default); a test-only space where one lr choice diverges (the
    sampler's seed, 1234, draws both)."""
    sweep_dir = tmp_path_factory.mktemp("search") / "sweep"
    result = search(sweep_dir, "hydra.sweeper.n_trials=4", "optimizer=sgd", "optimizer.lr=choice(0.05,100000)")
    assert result.returncode == 0, result.stderr[-2000:]
    return sweep_dir


def test_optuna_search_records_every_trial_and_goes_on_past_a_failed_one(failed_trial_search):
    rows = results(failed_trial_search)
    assert len(rows) == 4 and {row["status"] for row in rows} == {"completed", "failed"}
    for row in rows:
        diverged = row["optimizer.lr"] == "100000"
        assert row["status"] == ("failed" if diverged else "completed")
        assert ("diverged" in row["error"]) == diverged
    assert_study_and_results_agree(failed_trial_search)
    best = OmegaConf.load(failed_trial_search / "optimization_results.yaml")
    assert best.best_params["optimizer.lr"] == 0.05
    assert best.best_value == pytest.approx(min(float(r["val_mse"]) for r in rows if r["status"] == "completed"))


@pytest.mark.slow
def test_a_sweep_dir_is_refused_to_a_study_that_did_not_run_its_jobs(failed_trial_search):
    before = (failed_trial_search / "results.csv").read_bytes()
    result = search(failed_trial_search, "hydra.sweeper.study_name=other", "optimizer=sgd")
    assert result.returncode == 2, result.stderr[-2000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: hydra.sweep.dir=") and "holds jobs [0, 1, 2, 3]" in error, error
    assert (failed_trial_search / "results.csv").read_bytes() == before


@pytest.mark.slow
def test_optuna_search_with_ddp_trials(tmp_path):
    # Each trial's two ranks join that trial's job: two jobs, no nested search.
    result = search(tmp_path / "sweep", "hydra.sweeper.n_trials=2", "trainer.devices=2", "optimizer=sgd")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = results(tmp_path / "sweep")
    assert [row["status"] for row in rows] == ["completed", "completed"]
    assert [row["world_size"] for row in rows] == ["2", "2"]
    assert [t.state for t in study_of(tmp_path / "sweep").trials] == [TrialState.COMPLETE] * 2


@pytest.mark.slow
def test_a_grid_search_runs_each_point_once(tmp_path):
    space = ("hydra/sweeper/optuna_sampler=grid", "optimizer=sgd", "optimizer.lr=choice(0.01,0.05)")
    result = search(tmp_path / "sweep", "hydra.sweeper.n_trials=20", *space)  # capped at the grid's 2 points
    assert result.returncode == 0, result.stderr[-2000:]
    trials = study_of(tmp_path / "sweep").trials
    assert sorted(t.params["optimizer.lr"] for t in trials) == [0.01, 0.05]
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    assert_study_and_results_agree(tmp_path / "sweep")


@pytest.mark.slow
def test_a_search_run_again_continues_its_study_and_a_killed_trial_becomes_failed(tmp_path):
    sweep_dir = tmp_path / "sweep"
    space = ("optimizer=sgd", "optimizer.lr=interval(0.01,0.1)")
    first = search(sweep_dir, "hydra.sweeper.n_trials=2", *space)
    assert first.returncode == 0, first.stderr[-2000:]
    kept = {path: path.read_bytes() for path in sorted(sweep_dir.glob("[01]/*.json"))}
    assert [p.name for p in kept].count("metrics.json") == [p.name for p in kept].count("job.json") == 2

    # The same command, to 4 trials: killed (SIGKILL, nothing can clean up) while trial 2 runs.
    command = search_command(sweep_dir, "hydra.sweeper.n_trials=4", *space)
    command[0] = sys.executable  # the kill at once: a SIGKILL of the shim reaches the command a moment later
    killed = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)  # fmt: skip
    wait_for((sweep_dir / "2" / ".hydra" / "overrides.yaml").exists, "trial 2 to start", killed, every=0.02)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=60)
    assert [t.state for t in study_of(sweep_dir).trials] == [TrialState.COMPLETE] * 2 + [TrialState.RUNNING]

    again = search(sweep_dir, "hydra.sweeper.n_trials=4", *space)
    assert again.returncode == 0, again.stderr[-2000:]
    states = [t.state for t in study_of(sweep_dir).trials]
    assert states == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert {path: path.read_bytes() for path in kept} == kept  # finished trials are not run again
    rows = results(sweep_dir)
    assert [(row["job"], row["status"]) for row in rows] == [
        ("0", "completed"), ("1", "completed"), ("2", "failed"), ("3", "completed")
    ]  # fmt: skip
    assert rows[2]["error"] == ABANDONED
    assert_study_and_results_agree(sweep_dir)
    # A continued search draws on: its trials are not the first ones again (the sampler's seed follows the trials).
    params = [t.params["optimizer.lr"] for t in study_of(sweep_dir).trials]
    assert len(set(params)) == 4


@pytest.mark.slow
def test_a_study_written_by_optuna_2_10_is_refused_until_upgraded(tmp_path):
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as connection:
        connection.executescript(OPTUNA_2_10_STUDY.read_text())
    storage = f"sqlite:///{db}"
    refused = search(tmp_path / "sweep", "hydra.sweeper.n_trials=3", f"hydra.sweeper.storage={storage}")
    assert refused.returncode == 2, refused.stderr[-2000:]
    error = refused.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"error: hydra.sweeper.storage={storage} "), error
    assert f"optuna storage upgrade --storage {storage}" in error[0]
    assert not list((tmp_path / "sweep").glob("*/")), "no job ran"

    upgrade = [str(Path(sys.executable).with_name("optuna")), "storage", "upgrade", "--storage", storage]
    subprocess.run(upgrade, check=True, capture_output=True, timeout=120)
    continued = search(tmp_path / "sweep", "hydra.sweeper.n_trials=3", f"hydra.sweeper.storage={storage}")
    assert continued.returncode == 0, continued.stderr[-2000:]
    trials = optuna.load_study(study_name="gpu-lab", storage=storage).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3 and trials[2].user_attrs["job"] == 2


# ------------------------------------------------------------------------------------------ the space, in process


def test_the_space_maps_hydras_sweeps_to_optuna_distributions():
    space, fixed = search_space(
        {"a": "interval(0.5, 2)", "b": "tag(log, interval(0.001, 1.0))", "c": "choice(sgd, adam)", "d": "1,2"},
        ["e=range(1,10,3)", "f=range(0.1,0.5,0.1)", "c=adam", "g=5"],
    )
    assert space == {
        "a": FloatDistribution(0.5, 2.0),
        "b": FloatDistribution(0.001, 1.0, log=True),
        "d": CategoricalDistribution([1, 2]),
        "e": IntDistribution(1, 7, step=3),  # 10, the stop, is out
        "f": FloatDistribution(0.1, 0.4, step=0.1),
    }
    assert fixed == ["c=adam", "g=5"]  # the command line fixes what params searched


def test_a_range_never_samples_its_stop():
    space, _ = search_space({"x": "range(1,4)", "y": "range(0.1,0.5,0.1)"}, [])
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    drawn = [study.ask(space).params for _ in range(60)]
    assert {d["x"] for d in drawn} == {1, 2, 3}
    assert max(d["y"] for d in drawn) == pytest.approx(0.4)


def test_the_grid_refuses_an_interval():
    space, _ = search_space({"x": "range(1,4)", "y": "interval(0, 1)"}, [])
    with pytest.raises(ConfigError, match=r"hydra.sweeper.params.y: an interval has no grid; allowed"):
        grid(space, "hydra.sweeper.params")


@pytest.mark.parametrize("sampler", ["tpe", "random", "grid", "cmaes"])
def test_each_sampler_is_seeded(sampler):
    """The sampler the config builds draws the same trials again; a continued search (trials done) others."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        overrides = ["hparams_search=optuna", f"hydra/sweeper/optuna_sampler={sampler}"]
        cfg = compose("config", overrides, return_hydra_config=True)
    settings = {k: v for k, v in cfg.hydra.sweeper.items() if not k.startswith("_")}
    settings["params"] = {"optimizer.lr": "range(0.01,0.1,0.01)", "data.batch_size": "choice(64,256,1024)"}
    sweeper = Search(cfg, None, **settings)
    space, _ = search_space(settings["params"], [])

    def draws(done: int) -> list[dict]:
        study = optuna.create_study(sampler=sweeper.build_sampler(space, done)[0])
        trials = [study.ask(space) for _ in range(4)]
        for trial in trials:
            study.tell(trial, trial.params["optimizer.lr"])
        return [t.params for t in trials]

    assert cfg.hydra.sweeper.sampler.seed == 1234
    assert draws(0) == draws(0)
    assert draws(0) != draws(4)


# ---------------------------------------------------------------------------------------------- optuna-dashboard


@pytest.fixture(scope="module")
def dashboard(failed_trial_search):
    """`optuna-dashboard sqlite:///<sweep dir>/optuna.db` (docs/sweeps.md) on a free port; its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    executable = Path(sys.executable).with_name("optuna-dashboard")
    command = [str(executable), "--host", "127.0.0.1", "--port", str(port),
               f"sqlite:///{failed_trial_search / 'optuna.db'}"]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: answers(url + "/api/meta"), "optuna-dashboard to answer", server, timeout=60, every=0.2)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5).close()
        return True
    except OSError:
        return False


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def test_the_dashboard_serves_the_study_with_its_complete_and_failed_trials(dashboard, failed_trial_search):
    studies = get_json(dashboard + "/api/studies")["study_summaries"]
    assert [s["study_name"] for s in studies] == ["gpu-lab"]
    shown = get_json(f"{dashboard}/api/studies/{studies[0]['study_id']}")["trials"]
    expected = study_of(failed_trial_search).trials
    assert [(t["number"], t["state"]) for t in shown] == [(t.number, t.state.name.title()) for t in expected]
    assert {t["state"] for t in shown} == {"Complete", "Fail"}
    for trial in shown:
        attrs = {a["key"]: a["value"] for a in trial["user_attrs"]}
        assert attrs["dir"] == str(failed_trial_search / str(trial["number"]))
        assert ("diverged" in attrs.get("error", "")) == (trial["state"] == "Fail")


@pytest.mark.slow
def test_a_person_sees_the_trial_list(dashboard, failed_trial_search, browser, screenshots):
    page = browser.new_page(viewport={"width": 1400, "height": 760})
    page.goto(dashboard + "/dashboard/studies/1/trials")
    trial_list = page.get_by_role("list").filter(has_text="4 Trials")  # the trial list, beside the chosen trial
    trial_list.wait_for(timeout=60e3)
    # Each trial once, with its state: "Trial 0", "Complete", ("Best Trial"), "Trial 1", "Fail", ...
    listed = [line for line in trial_list.inner_text().splitlines() if line and line != "Best Trial"]
    trials = study_of(failed_trial_search).trials
    assert listed == ["4 Trials", *(x for t in trials for x in (f"Trial {t.number}", t.state.name.title()))]
    page.screenshot(path=screenshots / "optuna_dashboard.png")
    page.close()
