"""Where everything lives inside a run dir and a sweep dir: the one spelling of the layout
(README, "Where outputs go")."""

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    """The files of one run (`hydra.run.dir`) or one job of a sweep (`<sweep dir>/<job num>`)."""

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def last_checkpoint(self) -> Path:  # what a resume, `ckpt_path=last` and a signal's save use
        return self.checkpoints / "last.ckpt"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    @property
    def log(self) -> Path:  # the run's own lines: epochs, summary, error (experiments.run.log)
        return self.root / "train.log"

    @property
    def run_config(self) -> Path:  # the config the run trains with (experiments.run.state)
        return self.root / "run.yaml"

    @property
    def hydra(self) -> Path:  # Hydra's own record of the composed config
        return self.root / ".hydra"

    @property
    def hydra_copy(self) -> Path:  # the run's copy of `.hydra/`, put back when a start changes nothing
        return self.root / ".run-hydra"

    @property
    def lock(self) -> Path:  # held by the run that is using the dir (experiments.run.lock)
        return self.root / ".lock"

    @property
    def provenance(self) -> Path:  # what produced the run, one entry per start (experiments.run.provenance)
        return self.root / "provenance.json"

    def code_diff(self, digest: str) -> Path:  # the uncommitted changes a start ran with, named by their hash
        return self.root / f"code-{digest[:12]}.diff"

    @property
    def job_record(self) -> Path:  # a sweep job's status and error as Hydra saw them (experiments.sweeps.record)
        return self.root / "job.json"


@dataclass(frozen=True)
class SweepPaths:
    """The files a sweep dir holds besides its jobs' dirs."""

    root: Path

    @property
    def results(self) -> Path:
        return Path(self.root) / "results.csv"

    @property
    def results_lock(self) -> Path:
        return Path(self.root) / ".results.lock"

    @property
    def multirun(self) -> Path:  # the sweep's composed config and command line (Hydra's own file name)
        return Path(self.root) / "multirun.yaml"

    @property
    def lock(self) -> Path:  # held by the sweep that is using the dir (experiments.run.lock)
        return Path(self.root) / ".lock"

    @property
    def study(self) -> Path:  # an Optuna search's study, unless hydra.sweeper.storage says otherwise
        return Path(self.root) / "optuna.db"

    @property
    def study_journal(self) -> Path:  # the same in Optuna's journal file: a search's trials on SLURM
        return Path(self.root) / "optuna.journal"


def run_of_checkpoint(checkpoint: Path) -> RunPaths | None:
    """The run dir a checkpoint sits in (`<run>/checkpoints/<name>.ckpt`); None for a file elsewhere."""
    checkpoint = Path(checkpoint)
    return RunPaths(checkpoint.parent.parent) if checkpoint.parent.name == "checkpoints" else None
