"""The record of a Hydra multirun: `<sweep dir>/results.csv`, one row per job.

`SweepRecord` is a Hydra callback (conf/config.yaml, `hydra.callbacks`). Each job leaves `job.json` in its own
directory when it ends (status and error as Hydra's JobReturn saw them); results.csv is rebuilt from the job
directories. It is rebuilt after every job, not only when the multirun ends, because Hydra 1.3's sweeper
re-raises the first failed job's error before `on_multirun_end` runs: a sweep with a failed job would
otherwise leave no record at all.
"""

import csv
import fcntl
import io
import json
import logging
import signal
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from experiments.run.exits import EXIT_FAILED, Abort, OutOfSpace, is_out_of_space
from experiments.run.layout import RunPaths, SweepPaths
from experiments.run.lock import RunDirBusy


def write_atomic(path: Path, text: str) -> None:
    # Hydra builds this callback as a command starts, also for a single run: torch (run.files) loads only when a
    # record is written, so that a bad value is refused before the heavy imports (experiments.commands.entry).
    from experiments.run.files import write_atomic as write

    write(path, text)


log = logging.getLogger(__name__)


@dataclass
class Job:
    """One run or sweep job as its directory records it."""

    dir: Path
    num: int
    overrides: list[str]
    status: str  # completed, failed, interrupted; running while a job has left no record yet
    error: str = ""
    metrics: dict = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)  # the composed config, flattened: "data.batch_size"

    @property
    def params(self) -> dict[str, str]:
        """The job's `key=value` overrides as a dict (`+key`/`~key` prefixes dropped)."""
        pairs = (o.lstrip("+~").split("=", 1) for o in self.overrides if "=" in o)
        return {k: v for k, v in pairs}


def find_jobs(root: Path) -> list[Job]:
    """The jobs under `root`, a sweep dir or one run's dir, in job-number order."""
    dirs = {p.parent.parent for p in root.glob("**/.hydra/overrides.yaml")}
    dirs |= {p.parent for p in root.glob("**/metrics.json")}  # RunPaths.hydra, RunPaths.metrics
    return sorted((read_job(d) for d in dirs), key=lambda job: (job.num, str(job.dir)))


def read_job(job_dir: Path) -> Job:
    paths = RunPaths(job_dir)
    overrides_file = paths.hydra / "overrides.yaml"
    overrides = list(OmegaConf.load(overrides_file)) if overrides_file.exists() else []
    hydra_file = paths.hydra / "hydra.yaml"
    num = OmegaConf.select(OmegaConf.load(hydra_file), "hydra.job.num") if hydra_file.exists() else None
    record = _read_json(paths.job_record)
    metrics = _read_json(paths.metrics)
    config_file = paths.hydra / "config.yaml"
    settings = (
        flatten(OmegaConf.to_container(OmegaConf.load(config_file), resolve=True)) if config_file.exists() else {}
    )
    if record.get("status") == "failed":
        status = "failed"  # the job raised; metrics.json, if any, says how far it got
    else:
        status = metrics.get("status") or record.get("status") or "running"
    return Job(
        dir=job_dir,
        num=int(num) if num is not None else 0,
        overrides=[str(o) for o in overrides],
        status=status,
        error=record.get("error", ""),
        metrics=metrics,
        settings=settings,
    )


def flatten(tree: dict, prefix: str = "", as_text: bool = True) -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= flatten(value, f"{prefix}{key}.", as_text)
        else:
            flat[f"{prefix}{key}"] = str(value) if as_text else value
    return flat


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def results_table(jobs: list[Job]) -> tuple[list[str], list[dict]]:
    """Columns and rows of results.csv: who the job was, how it ended, what it swept, what it measured."""
    swept = sorted({k for job in jobs for k in job.params})
    # A nested record (batch_fit) becomes a column per key: batch_fit.micro_batch, ...
    figures = [flatten(job.metrics, as_text=False) for job in jobs]
    measured = sorted({k for figure in figures for k in figure} - {"status"})
    columns = ["job", "status", "error", "overrides", *swept, *measured, "dir"]
    rows = []
    for job, figure in zip(jobs, figures, strict=True):
        row = {"job": job.num, "status": job.status, "error": job.error, "overrides": " ".join(job.overrides)}
        row |= job.params | {k: v for k, v in figure.items() if k != "status"}
        rows.append(row | {"dir": str(job.dir)})
    return columns, rows


def write_results(sweep_dir: Path) -> Path:
    """Rebuild `<sweep_dir>/results.csv` from the job dirs; safe when parallel jobs end at once."""
    paths = SweepPaths(sweep_dir)
    # A lock file, because joblib and submitit run `on_job_end` in separate processes: without it, a job
    # that scanned the dirs first could overwrite the table of a job that ended just after it.
    with open(paths.results_lock, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        columns, rows = results_table(find_jobs(sweep_dir))
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        write_atomic(paths.results, text.getvalue())
    return paths.results


def record_interrupted_job(hydra_cfg: DictConfig) -> None:
    """An interrupted job's row: its exit (`sys.exit`, which stops the sweep) passes Hydra's `on_job_end` by."""
    job_dir = Path(hydra_cfg.runtime.output_dir)
    record = {"num": hydra_cfg.job.num, "overrides": list(hydra_cfg.overrides.task), "status": "interrupted"}
    write_atomic(RunPaths(job_dir).job_record, json.dumps(record, indent=2) + "\n")
    write_results(Path(hydra_cfg.sweep.dir))


def interrupted_line(stop: BaseException, hydra_cfg: DictConfig) -> str:
    """What a sweep's job cut by a signal (`run.signals.Interrupted`) says: not a single run's `ckpt_path=` advice,
    since the same command resumes the sweep, this job from its checkpoint."""
    job = f"job {hydra_cfg.job.num}"
    saved = f"{job} saved its position in {stop.checkpoint}" if stop.checkpoint else f"{job} had not started training"
    given = any(str(o).split("=", 1)[0] == "hydra.sweep.dir" for o in hydra_cfg.overrides.hydra)
    again = "run the same command again" + ("" if given else f" with hydra.sweep.dir={hydra_cfg.sweep.dir}")
    name = signal.Signals(stop.signum).name
    return f"interrupted by {name}: {saved}; {again} to continue the sweep (its ended jobs are kept)"


def swept_overrides(hydra_cfg: DictConfig) -> dict[str, str]:
    """This sweep job's overrides of the settings its sweep varies, in the job's order: `{"data.batch_size": "64"}`.

    What a sweep varies: its command line's sweep overrides (`a=1,2`, `range(...)`, `choice(...)`), read from
    `<sweep dir>/multirun.yaml`, and its sweeper's `params` (Optuna's search space); every job shares the rest.
    """
    parser = OverridesParser.create()
    swept = set(hydra_cfg.sweeper.get("params") or {})
    multirun = SweepPaths(hydra_cfg.sweep.dir).multirun
    if multirun.exists():
        command_line = OmegaConf.load(multirun).hydra.overrides.task
        swept |= {o.key_or_group for o in parser.parse_overrides(list(command_line)) if o.is_sweep_override()}
    job = parser.parse_overrides(list(hydra_cfg.overrides.task))
    return {o.key_or_group: o.get_value_element_as_str() for o in job if o.key_or_group in swept}


def one_line(err: BaseException) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())


class SweepRecord(Callback):
    """Writes `job.json` into each job's dir when it ends, and `results.csv` into the sweep dir."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        # Hydra's basic sweeper saves the sweep's config as multirun.yaml (and does so again right after this);
        # Optuna's does not. Every job reads from it what its sweep varies (`swept_overrides`).
        path = SweepPaths(config.hydra.sweep.dir).multirun
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, OmegaConf.to_yaml(config))

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        # Runs where the job ran (a joblib worker, a SLURM node): write only into this job's own dir.
        job_record = RunPaths(config.hydra.runtime.output_dir).job_record
        record = {"num": config.hydra.job.num, "overrides": list(job_return.overrides or [])}
        if job_return.status == JobStatus.FAILED:
            from experiments import internals  # Lightning: loaded by then, the job ran

            err = internals.job_error(job_return)
            if isinstance(err, RunDirBusy) or isinstance(err.__cause__, RunDirBusy):
                # The dir is another run's (experiments.run.lock): its record is that run's to write.
                log.error("job %s refused: %s", config.hydra.job.num, one_line(err))
                self._write_results(config)
                return
            record |= {
                "status": "failed",
                "error": one_line(err),
                "traceback": "".join(traceback.format_exception(err)),
            }
            # Hydra prints only the first failure, at the end of the sweep: say which job failed now.
            log.error("job %s failed: %s", config.hydra.job.num, record["error"])
        else:
            record["status"] = "completed"
        text = json.dumps(record, indent=2) + "\n"
        try:
            if not job_record.exists() or job_record.read_text() != text:
                # Unchanged when a re-run sweep finds the job completed (experiments.run.state): its files stay.
                write_atomic(job_record, text)
        except OutOfSpace as err:
            raise Abort(err, EXIT_FAILED) from None  # Hydra would only warn about an error of its callback
        self._write_results(config)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        path = self._write_results(config)
        log.info("sweep record: %s", path)

    @staticmethod
    def _write_results(config: DictConfig) -> Path:
        try:
            return write_results(Path(config.hydra.sweep.dir))
        except (OutOfSpace, OSError) as err:  # the sweep stops: every later job would find the disk as full
            if not is_out_of_space(err):
                raise
            full = err if isinstance(err, OutOfSpace) else OutOfSpace(SweepPaths(config.hydra.sweep.dir).results)
            raise Abort(full, EXIT_FAILED) from None
