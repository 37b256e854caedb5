"""The Optuna search (docs/sweeps.md): `hparams_search=optuna` through the real CLI on the project's own sweeper
(src/hydra_plugins/lab_optuna_sweeper), its study in the sweep dir, started from the config as given, its trials two
at a time (joblib), continued after SIGTERM, SIGINT, SIGUSR1 and SIGKILL with the cut trial resumed, a space the
config refuses refused before anything is written, a study of Optuna 2.10 refused; the search space and the
samplers in process; optuna-dashboard through its own CLI, read
through its HTTP API and in a real browser (skipped without Chromium, a failure under GPU_LAB_REQUIRE_BROWSER).
GPU_LAB_SCREENSHOTS=DIR keeps the dashboard's screenshot in DIR (docs/sweeps/ holds the committed one)."""

import csv
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

import optuna
import pytest
import torch
from background import wait_for
from conftest import ROOT, TINY, metrics, python
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from experiments.commands.entry import CONFIG_DIR
from experiments.config.errors import ConfigError
from hydra_plugins.lab_optuna_sweeper._search import Search
from hydra_plugins.lab_optuna_sweeper._space import check_space, grid, search_space

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
            assert trial.user_attrs["error"] == row["error"]


# ------------------------------------------------------------------------------------------- a search on the CLI


@pytest.fixture(scope="module")
def failed_trial_search(tmp_path_factory) -> Path:
    """Four trials, two at a time in joblib's worker processes, the study in the sweep dir (the default); a
    test-only space where one lr choice diverges: the first trial is the config's own lr (0.05), the sampler's seed,
    1234, draws the other. The search's output is in search.log beside the sweep dir."""
    sweep_dir = tmp_path_factory.mktemp("search") / "sweep"
    parallel = ("hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "hydra.sweeper.n_jobs=2")
    space = ("optimizer=sgd", "optimizer.lr=choice(0.05,100000)")
    result = search(sweep_dir, "hydra.sweeper.n_trials=4", *space, *parallel)
    (sweep_dir.parent / "search.log").write_text(result.stdout + result.stderr)
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


def test_two_trials_at_a_time_write_one_study_and_lose_none(failed_trial_search):
    """joblib's two worker processes run the trials of a batch at once; the search alone writes the study."""
    log = (failed_trial_search.parent / "search.log").read_text()
    assert log.count("is launching 2 jobs") == 2 and "database is locked" not in log
    trials = study_of(failed_trial_search).trials
    assert [t.number for t in trials] == [0, 1, 2, 3] and all(t.state.is_finished() for t in trials)


def test_a_new_search_starts_from_the_config_as_given_and_ends_against_it(failed_trial_search):
    first = study_of(failed_trial_search).trials[0]
    assert first.params == {"optimizer.lr": 0.05} and first.user_attrs["baseline"] is True  # conf/optimizer/sgd.yaml
    assert first.state == TrialState.COMPLETE
    rows = {int(row["job"]): row for row in results(failed_trial_search)}
    over = float(rows[0]["val_mse"]) / float(rows[0]["optimal_val_mse"])
    best = OmegaConf.load(failed_trial_search / "optimization_results.yaml")
    assert (best.baseline_trial, best.baseline_over_optimum) == (0, pytest.approx(over))
    # Its last lines: the best trial, and the config as given, each over the optimum.
    log = (failed_trial_search.parent / "search.log").read_text()
    assert f"val MSE {float(rows[0]['val_mse']):.6g} = {over:.4f}x the optimum" in log
    assert "the best trial is the config as given (trial 0)" in log or "best against the config as given" in log


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
    space = ("hydra/sweeper/optuna_sampler=grid", "optimizer=sgd", "optimizer.lr=choice(0.05,0.2)")
    result = search(tmp_path / "sweep", "hydra.sweeper.n_trials=20", *space)  # capped at the grid's 2 points
    assert result.returncode == 0, result.stderr[-2000:]
    trials = study_of(tmp_path / "sweep").trials
    assert sorted(t.params["optimizer.lr"] for t in trials) == [0.05, 0.2]
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    assert_study_and_results_agree(tmp_path / "sweep")
    # The config as given (lr 0.05) is one of the points; the other did better, and the last line says by how much.
    given, best = sorted(trials, key=lambda t: t.params["optimizer.lr"])
    assert best.value < given.value
    line = f"best against the config as given: {best.value / given.value:.4f}x its val MSE (the config's is "
    assert line + f"{given.value / best.value:.4f}x the best's)" in result.stdout + result.stderr


# Trials long enough to cut mid-epoch: 200 steps an epoch, 3 epochs, the steps in csv/metrics.csv as they are logged.
LONG = ["data.num_samples=1000", "data.batch_size=4", "trainer.max_epochs=3", "logger=csv", "optimizer=sgd"]
LONG += ["optimizer.lr=interval(0.01,0.1)", "hydra.sweeper.n_trials=2"]


@pytest.fixture(scope="module")
def uninterrupted_search(tmp_path_factory) -> optuna.Study:
    sweep_dir = tmp_path_factory.mktemp("uninterrupted") / "sweep"
    result = search(sweep_dir, *LONG)
    assert result.returncode == 0, result.stderr[-2000:]
    return study_of(sweep_dir)


def logged_step(job_dir: Path) -> int:
    try:  # CSVLogger rewrites the file in place: a read may catch it half written
        return max(int(row["step"]) for row in csv.DictReader((job_dir / "csv" / "metrics.csv").open()))
    except (OSError, ValueError, KeyError, TypeError):
        return -1


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGKILL],
                         ids=lambda s: signal.Signals(s).name)  # fmt: skip
@pytest.mark.slow
def test_a_search_cut_by_a_signal_or_killed_goes_on_with_the_same_command(tmp_path, uninterrupted_search, signum):
    """Trial 1 cut in its second epoch: the search stops, says to run the same command again, and that finishes
    the study: trial 1 resumes in its own job dir (from the signal's exact position, or from the last epoch's
    checkpoint after a kill) and ends with the value of the uninterrupted search's trial 1; trial 0 is kept."""
    sweep_dir = tmp_path / "sweep"
    command = search_command(sweep_dir, *LONG)
    if signum == signal.SIGKILL:
        command[0] = sys.executable  # a SIGKILL of the shim reaches the command a moment later
    log = open(tmp_path / "cut.log", "w")  # noqa: SIM115 (closed below)
    cut = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    # past the first epoch's checkpoint (step 200)
    wait_for(lambda: logged_step(sweep_dir / "1") >= 250, "trial 1's step 250", cut, every=0.02)
    if signum == signal.SIGKILL:
        os.killpg(cut.pid, signal.SIGKILL)  # the whole search, as a lost node or the OOM killer takes it
    else:
        cut.send_signal(signum)
    code = cut.wait(timeout=120)
    log.close()
    said = (tmp_path / "cut.log").read_text()
    assert code == (-9 if signum == signal.SIGKILL else 128 + signum), said[-2000:]
    kept = {path: path.read_bytes() for path in sorted((sweep_dir / "0").glob("*.json"))}
    assert [t.state for t in study_of(sweep_dir).trials] == [TrialState.COMPLETE, TrialState.RUNNING]
    stopped = metrics(sweep_dir / "1")
    saved = torch.load(sweep_dir / "1" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    if signum != signal.SIGKILL:
        name = signal.Signals(signum).name
        line = f"interrupted by {name}: the search stopped with 1 of 2 trials ended; run the same command again"
        assert line in said and "ckpt_path=" not in said, said[-2000:]
        assert stopped["status"] == "interrupted" and stopped["global_step"] >= 250

    again = search(sweep_dir, *LONG)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "trials 1 did not end (the search was stopped or killed)" in again.stdout + again.stderr
    trials = study_of(sweep_dir).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    assert {path: path.read_bytes() for path in kept} == kept  # finished trials are not run again
    reference = uninterrupted_search.trials
    assert [t.params for t in trials] == [t.params for t in reference]
    assert trials[1].value == reference[1].value  # bit for bit: the resume is exact
    resumed = json.loads((sweep_dir / "1" / "provenance.json").read_text())["starts"][-1]["resumed_from"]
    assert resumed["global_step"] == saved == (saved if signum == signal.SIGKILL else stopped["global_step"])
    assert_study_and_results_agree(sweep_dir)


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


# Spaces that would give a trial a value the config refuses, and the line each gets: before any job, study or dir.
REFUSED_SPACES = {
    "optimizer.lr=interval(0.5,0.1)": "low 0.5 is above high 0.1; allowed: interval(low, high), low <= high",
    "optimizer.lr=tag(log,interval(0,1))": "a log scale needs low > 0; allowed: tag(log, interval(low, high)), low > 0",
    "optimizer.lr=choice(0.1,-1)": "-1 is not allowed; allowed: a finite number > 0",
    "data.batch_size=choice(64,abc)": "abc is not allowed; allowed: an integer >= 1",
    "data.batch_size=interval(16,256)": "16.0 is not allowed; allowed: an integer >= 1, which an interval (floats) "
    "never gives: range(start, stop) or choice(...)",
    "data.batch_size=range(64,1)": "the range is empty; allowed: range(start, stop[, step]), start < stop for a "
    "positive step",
    "optimizer=choice(sgd,nope)": "nope is not an option of optimizer; allowed: adam, sgd",
    "trainer.max_epochs=choice(1,2.5)": "2.5 is not allowed; allowed: an integer >= 0, or -1 for no limit",
}


@pytest.mark.parametrize("space", ["optimizer.lr=interval(0.5,0.1)", "data.batch_size=choice(64,abc)"])
def test_a_space_the_config_refuses_is_refused_before_anything_is_written(tmp_path, space):
    result = search(tmp_path / "sweep", space, "hydra.sweeper.n_trials=2")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [f"error: {space}: {REFUSED_SPACES[space]}"]
    assert not (tmp_path / "sweep").exists()  # no sweep dir, no study, no job


@pytest.mark.parametrize("space", REFUSED_SPACES)
def test_each_value_of_the_space_is_held_to_the_configs_rules(space):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", ["hparams_search=optuna"], return_hydra_config=True)
    with pytest.raises(ConfigError) as refused:
        check_space({}, [space], cfg)
    assert str(refused.value) == f"{space}: {REFUSED_SPACES[space]}"
    # An entry of hydra.sweeper.params is named as such; the default space passes.
    key, value = space.split("=", 1)
    with pytest.raises(ConfigError, match=rf"^hydra\.sweeper\.params\.{re.escape(key)}="):
        check_space({key: value}, [], cfg)
    check_space({k: str(v) for k, v in cfg.hydra.sweeper.params.items()}, [], cfg)


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
