"""A search: its study (by default `<sweep dir>/optuna.db`), trials asked `n_jobs` at a time and launched as one
batch through the configured launcher, each told how its job ended. A trial's job number is its number in the
study (the launcher's job index), so a continued search never reuses a job dir; its overrides, job and dir are
its user attributes, the same as its row of results.csv."""

import logging
import math
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
from experiments.run.layout import SweepPaths
from experiments.sweeps.record import find_jobs, one_line, record_failed_job, write_results

from ._space import grid, search_space

log = logging.getLogger(__name__)

DIRECTIONS = ("minimize", "maximize")
# A trial the previous search left RUNNING: that search was killed (the sweep dir's lock says none is running).
ABANDONED = "the search stopped while this trial ran; marked failed when the search went on"


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
        self.storage = storage or f"sqlite:///{SweepPaths(self.sweep_dir).study}"

    def run(self, arguments: list[str]) -> None:
        storage = self.open_storage()
        try:
            trials = storage.get_all_trials(storage.get_study_id_from_name(self.study_name), deepcopy=False)
        except KeyError:  # a new study
            trials = []
        self.check_jobs(trials)  # before the study is made: a refused search writes nothing
        done = len(trials)
        try:
            space, fixed = search_space(self.params, arguments)
            sampler, n_trials = self.build_sampler(space, done)
        except ConfigError as err:
            raise Abort(err, EXIT_BAD_INPUT) from None
        study = optuna.create_study(
            storage=storage, sampler=sampler, study_name=self.study_name, direction=self.direction,
            load_if_exists=True,
        )  # fmt: skip
        self.fail_abandoned_trials(study)
        log.info("study %s in %s: %d of %d trials done", self.study_name, self.storage, len(study.trials), n_trials)
        while (left := n_trials - len(study.trials)) > 0:
            batch = [study.ask(space) for _ in range(min(self.n_jobs, left))]
            first = batch[0].number
            for num, trial in enumerate(batch, start=first):
                overrides = [*(f"{k}={_text(v)}" for k, v in trial.params.items()), *fixed]
                trial.set_user_attr("overrides", overrides)
                trial.set_user_attr("job", num)
                trial.set_user_attr("dir", self.job_dir(num))
                trial.set_user_attr("sweep_dir", str(self.sweep_dir))
            returns = self.launcher.launch([t.user_attrs["overrides"] for t in batch], initial_job_idx=first)
            for trial, job in zip(batch, returns, strict=True):
                self.tell(study, trial, job)
        self.write_best(study)

    def open_storage(self) -> optuna.storages.RDBStorage:
        try:  # Optuna's own opening, which refuses another schema with a message for its Python API
            storage = optuna.storages.RDBStorage(self.storage, skip_compatibility_check=True)
        except Exception as err:  # SQLAlchemy's: a malformed URL, a driver that is not installed, no such dir
            raise _refused(
                f"hydra.sweeper.storage={self.storage}: {' '.join(str(err).split())}; allowed: a database URL "
                "(e.g. sqlite:///path/optuna.db), or null for <sweep dir>/optuna.db"
            ) from None
        written, current = storage.get_current_version(), storage.get_head_version()
        if written != current:
            fix = (
                f"upgrade it with `optuna storage upgrade --storage {self.storage}`"
                if written in storage.get_all_versions()
                else "a newer Optuna (pip install -U optuna)"
            )
            raise _refused(
                f"hydra.sweeper.storage={self.storage} holds studies of another Optuna (schema {written}; Optuna "
                f"{optuna.__version__} reads {current}); allowed: {fix}, or another storage"
            )
        return storage

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

    def fail_abandoned_trials(self, study: optuna.Study) -> None:
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        for trial in (t for t in running if t.user_attrs.get("sweep_dir") == str(self.sweep_dir)):
            _tell(study, trial.number, state=TrialState.FAIL)
            log.warning("trial %d (job %s): %s", trial.number, trial.user_attrs["job"], ABANDONED)
            job_dir = Path(trial.user_attrs["dir"])
            if job_dir.is_dir():
                record_failed_job(job_dir, trial.user_attrs["job"], trial.user_attrs["overrides"], ABANDONED)
        if running:
            write_results(self.sweep_dir)

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

    def write_best(self, study: optuna.Study) -> None:
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
        OmegaConf.save(OmegaConf.create(result), self.sweep_dir / "optimization_results.yaml")
        log.info("best trial %d: %s = %s (%s)", best.number, best.params, best.value, result["best_dir"])


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
