"""A search: its study (`_storage`), trials asked `n_jobs` at a time and launched as one batch through the configured
launcher, each told how its job ended. A trial's job number is its number in the study (the launcher's job index),
so a continued search never reuses a job dir; its overrides, job and dir are its user attributes, the same as its
row of results.csv.

A stopped or killed search leaves its trials RUNNING in the study (the sweep dir's lock says no search runs). The
same command runs each of them again with its own parameters in its own job dir, where the run resumes from its
checkpoint (a signal's exact position, or a kill's last save) or finds its job completed, and tells the trial its
result: only a trial that failed on its own is FAIL, and `n_trials` counts the trials that ended. Optuna's
RetryFailedTrialCallback is the model, with the trial itself kept instead of a copy: its job dir is its record."""

import logging
import math
import signal
import sys
from pathlib import Path

import optuna
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, Trial, TrialState

from experiments import internals
from experiments.config.errors import ConfigError
from experiments.run.exits import EXIT_BAD_INPUT, EXIT_FAILED, Abort, RunFailed
from experiments.run.signals import SIGNALS, Interrupted
from experiments.sweeps.record import find_jobs, one_line

from . import _storage
from ._baseline import baseline_values, report
from ._space import check_space, grid, search_space

log = logging.getLogger(__name__)

DIRECTIONS = ("minimize", "maximize")
# The error of a trial that an earlier version marked failed when the search went on after a kill: it did not end
# on its own, so it does not count towards n_trials.
ABANDONED = "the search stopped while this trial ran; marked failed when the search went on"
STOPPED = {128 + signum: signal.Signals(signum).name for signum in SIGNALS}  # a job's exit when a signal cut it


class Search:
    def __init__(self, config: DictConfig, launcher: Launcher, sampler: DictConfig, direction: str, n_trials: int,
                 n_jobs: int, storage: str | None, study_name: str, params: dict[str, str]) -> None:  # fmt: skip
        if direction not in DIRECTIONS:
            raise _refused(f"hydra.sweeper.direction={direction} is not allowed; allowed: {', '.join(DIRECTIONS)}")
        for setting, value in (("n_trials", n_trials), ("n_jobs", n_jobs)):
            if not (isinstance(value, int) and value >= 1):
                raise _refused(f"hydra.sweeper.{setting}={value} is not allowed; allowed: an integer >= 1")
        self.config, self.launcher, self.sampler = config, launcher, sampler
        self.direction, self.n_trials, self.n_jobs, self.study_name, self.params = (
            direction, n_trials, n_jobs, study_name, params
        )  # fmt: skip
        self.sweep_dir = Path(config.hydra.sweep.dir).resolve()
        launcher_target = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
        self.storage = _storage.storage_of(storage, self.sweep_dir, launcher_target)

    def run(self, arguments: list[str]) -> None:
        try:
            check_space(self.params, arguments, self.config)  # the SpaceCheck callback's, for a config without it
            space, fixed = search_space(self.params, arguments)
            storage = _storage.open_storage(self.storage)
        except ConfigError as err:
            raise Abort(err, EXIT_BAD_INPUT) from None
        try:
            trials = storage.get_all_trials(storage.get_study_id_from_name(self.study_name), deepcopy=False)
        except KeyError:  # a new study
            trials = []
        self.check_jobs(trials)  # before the study is made: a refused search writes nothing
        try:
            sampler, n_trials = self.build_sampler(space, len(trials))
        except ConfigError as err:
            raise Abort(err, EXIT_BAD_INPUT) from None
        study = optuna.create_study(
            storage=storage, sampler=sampler, study_name=self.study_name, direction=self.direction,
            load_if_exists=True,
        )  # fmt: skip
        baseline = baseline_values(space, self.config)
        if not trials:
            self.start_from(study, baseline)
        log.info("study %s in %s: %d of %d trials ended", self.study_name, self.storage, _ended(study), n_trials)
        try:
            self.optimize(study, space, fixed, n_trials)
        except Interrupted as stop:  # the signal came to the search itself, between trials or while it waited
            raise _stopped(stop.signum, self.continue_line(study, n_trials)) from None
        except SystemExit as stop:  # a trial's job was cut by a signal: it saved its position and recorded itself
            if stop.code in STOPPED:
                print(f"interrupted by {STOPPED[stop.code]}: {self.continue_line(study, n_trials)}", file=sys.stderr)
            raise
        self.write_best(study, baseline)

    def optimize(self, study: optuna.Study, space: dict[str, BaseDistribution], fixed: list[str], n_trials: int):
        unfinished = self.unfinished(study)
        if unfinished:
            numbers = ", ".join(str(t.number) for t in unfinished)
            log.info("trials %s did not end (the search was stopped or killed): each runs again with its own "
                     "parameters in its own job dir, resuming from its checkpoint", numbers)  # fmt: skip
        for batch in _consecutive(unfinished, self.n_jobs):
            self.run_batch(study, batch)
        while (left := n_trials - _ended(study)) > 0:
            batch = [study.ask(space) for _ in range(min(self.n_jobs, left))]
            for trial in batch:
                self.prepare(trial, fixed)
            self.run_batch(study, batch)

    def run_batch(self, study: optuna.Study, batch: list[Trial]) -> None:
        overrides = [t.user_attrs["overrides"] for t in batch]
        try:
            returns = self.launcher.launch(overrides, initial_job_idx=batch[0].number)
        except Exception as err:  # the launcher lost a job (killed, its node lost): no result to tell
            numbers = ", ".join(str(t.number) for t in batch)
            raise Abort(RunFailed(
                f"the jobs of trials {numbers} ended without a result ({one_line(err)}); run the same command again"
                f"{self.sweep_dir_hint()}: they run again with their own parameters, resuming from their checkpoints"
            ), EXIT_FAILED) from err  # fmt: skip
        for trial, job in zip(batch, returns, strict=True):
            self.tell(study, trial, job)

    def prepare(self, trial: Trial, fixed: list[str]) -> None:
        num = trial.number
        trial.set_user_attr("overrides", [*(f"{k}={_text(v)}" for k, v in trial.params.items()), *fixed])
        trial.set_user_attr("job", num)
        trial.set_user_attr("dir", self.job_dir(num))
        trial.set_user_attr("sweep_dir", str(self.sweep_dir))

    def unfinished(self, study: optuna.Study) -> list[Trial]:
        """The trials of this sweep dir that a stopped or killed search left RUNNING, as Trials to tell."""
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        ours = [t for t in running if t.user_attrs.get("sweep_dir") == str(self.sweep_dir)]
        return [internals.optuna_trial(study, t) for t in ours if "overrides" in t.user_attrs]

    def start_from(self, study: optuna.Study, baseline: dict | None) -> None:
        """A new study's first trial: the config as composed (the searched settings' own values), so that the search
        shows how far it got from where the user started. Not for the grid, which runs every point anyway."""
        if baseline is None:
            log.info("the config's own values of the searched settings are not all in the space: the search does "
                     "not start from them")  # fmt: skip
        elif not isinstance(study.sampler, optuna.samplers.GridSampler):
            study.enqueue_trial(baseline, user_attrs={"baseline": True})

    def continue_line(self, study: optuna.Study, n_trials: int) -> str:
        return (
            f"the search stopped with {_ended(study)} of {n_trials} trials ended; run the same command again"
            f"{self.sweep_dir_hint()} to continue it: a trial that was cut resumes from its checkpoint in its job dir"
        )

    def sweep_dir_hint(self) -> str:
        given = any(o.split("=", 1)[0] == "hydra.sweep.dir" for o in self.config.hydra.overrides.hydra)
        return "" if given else f" with hydra.sweep.dir={self.sweep_dir}"

    def build_sampler(self, space: dict[str, BaseDistribution], done: int) -> tuple[optuna.samplers.BaseSampler, int]:
        """The configured sampler, and the number of trials the search runs to (the grid has as many as points).
        A seeded sampler is seeded with `seed + done`: a continued search draws on from where it stopped, where
        the same seed would draw its first trials again."""
        n_trials, options = self.n_trials, {}
        if self.sampler.get("seed") is not None:
            options["seed"] = self.sampler.seed + done
        if "search_space" in self.sampler:  # the grid sampler: built on the values of the space
            options["search_space"] = grid(space, "hydra.sweeper.params")
            n_trials = min(n_trials, math.prod(len(v) for v in options["search_space"].values()))
        return instantiate(self.sampler, **options), n_trials

    def check_jobs(self, trials: list[FrozenTrial]) -> None:
        """Refuse a sweep dir that holds jobs the study's trials did not run (another search's, a grid sweep's):
        their numbers would be its next trials'."""
        ours = {t.user_attrs.get("dir") for t in trials}
        strays = [job.num for job in find_jobs(self.sweep_dir) if str(job.dir.resolve()) not in ours]
        if strays:
            raise _refused(
                f"hydra.sweep.dir={self.sweep_dir} holds jobs {strays} that study {self.study_name} in "
                f"hydra.sweeper.storage={self.storage} did not run; allowed: the storage and study_name of the "
                "search that ran them, or another hydra.sweep.dir"
            )

    def job_dir(self, num: int) -> str:
        """The dir the launcher gives job `num`: the sweep's subdir resolved for that job number, as Hydra does."""
        hydra = OmegaConf.create({"hydra": OmegaConf.to_container(self.config.hydra, resolve=False)})
        with open_dict(hydra):
            hydra.hydra.job.num = num
        return str(self.sweep_dir / str(hydra.hydra.sweep.subdir))

    def tell(self, study: optuna.Study, trial: Trial, job: JobReturn) -> None:
        value = job.return_value if job.status == JobStatus.COMPLETED else None
        if isinstance(value, int | float) and math.isfinite(value):
            _tell(study, trial, float(value))
            return
        if job.status == JobStatus.COMPLETED:
            error = f"the job returned {value!r}, not a finite number"
            log.warning("trial %d: %s: a failed trial", trial.number, error)
        else:  # the job raised: SweepRecord has logged it, and kept its traceback in job.json
            error = one_line(internals.job_error(job))
        trial.set_user_attr("error", error)  # beside the trial in optuna-dashboard, as in results.csv
        _tell(study, trial, state=TrialState.FAIL)

    def write_best(self, study: optuna.Study, baseline: dict | None) -> None:
        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not done:
            raise Abort(RunFailed(f"no trial of study {self.study_name} completed; results.csv in "
                                  f"{self.sweep_dir} has each job's error"), EXIT_FAILED)  # fmt: skip
        best = study.best_trial
        result = {
            "name": "optuna",
            "best_params": best.params,
            "best_value": best.value,
            "best_dir": best.user_attrs.get("dir"),
            "study_name": self.study_name,
            "storage": self.storage,
        }
        result |= report(best, done, baseline)
        OmegaConf.save(OmegaConf.create(result), self.sweep_dir / "optimization_results.yaml")


def _ended(study: optuna.Study) -> int:
    """The trials that ended on their own: complete or failed (not one an earlier version failed for a kill)."""
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED))
    return sum(t.user_attrs.get("error") != ABANDONED for t in trials)


def _consecutive(trials: list[Trial], size: int) -> list[list[Trial]]:
    """Batches of at most `size` trials with consecutive numbers: a launcher numbers a batch's jobs from its first."""
    batches: list[list[Trial]] = []
    for trial in sorted(trials, key=lambda t: t.number):
        if batches and len(batches[-1]) < size and batches[-1][-1].number == trial.number - 1:
            batches[-1].append(trial)
        else:
            batches.append([trial])
    return batches


def _stopped(signum: int, line: str) -> Interrupted:
    stop = Interrupted(signum, None)
    stop.args = (f"interrupted by {signal.Signals(signum).name}: {line}",)
    return stop


def _tell(study: optuna.Study, trial: Trial | int, *args, **kwargs) -> None:
    try:
        study.tell(trial, *args, **kwargs)
    except RuntimeError:
        # Optuna's GridSampler stops the study at its last point (`study.stop()`), which raises outside
        # `study.optimize`. The trial is stored all the same (Optuna's tell stores it in a `finally`), and the
        # search ends there anyway: its n_trials is capped at the number of points.
        if not isinstance(study.sampler, optuna.samplers.GridSampler):
            raise


def _text(value) -> str:
    """A sampled value as an override's value: Hydra writes None as null."""
    return "null" if value is None else str(value)


def _refused(message: str) -> Abort:
    return Abort(ConfigError(message), EXIT_BAD_INPUT)
