"""Where a search keeps its study. The search alone writes it (it asks for trials and tells their results; the
trials' jobs never open it), so one writer at a time: the sweep dir's lock holds a second search off.

- By default `<sweep dir>/optuna.db`, SQLite, as every search before this one; an existing one is kept.
- With `hydra/launcher=submitit_slurm`, `<sweep dir>/optuna.journal`: Optuna's JournalStorage on a file
  (JournalFileBackend). The sweep dir is on the cluster's shared file system, where SQLite's locks are not to be
  trusted (NFS): the journal takes its lock by creating a symlink, atomic on NFS, so the search can be continued
  from any node (a login node, or a search that runs as a SLURM job and is requeued elsewhere) and the dashboard can
  read it from any node, with no database server to keep running beside the cluster.
- `hydra.sweeper.storage=<URL>` (a database: sqlite:///..., postgresql://...) or `=<path>` (a journal file).
"""

from pathlib import Path

import optuna
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend

from experiments.config.errors import ConfigError
from experiments.run.layout import SweepPaths

JOURNAL_LAUNCHERS = ("hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",)


def storage_of(setting: str | None, sweep_dir: Path, launcher: str) -> str:
    """The storage a search uses: `setting` when given; else the study already in the sweep dir; else a new one, a
    journal file when the trials run on SLURM (`launcher`, the launcher's _target_), SQLite otherwise."""
    if setting:
        return setting
    paths = SweepPaths(sweep_dir)
    if paths.study.exists():
        return f"sqlite:///{paths.study}"
    if paths.study_journal.exists() or launcher in JOURNAL_LAUNCHERS:
        return str(paths.study_journal)
    return f"sqlite:///{paths.study}"


def is_journal(storage: str) -> bool:
    return "://" not in storage


def open_storage(storage: str) -> BaseStorage:
    """The storage, opened; ConfigError for one that cannot be, or that holds another Optuna's studies."""
    allowed = "allowed: a database URL (e.g. sqlite:///path/optuna.db), a journal file's path, or null"
    if is_journal(storage):
        if not Path(storage).parent.is_dir():
            raise ConfigError(f"hydra.sweeper.storage={storage}: no such dir {Path(storage).parent}; {allowed}")
        return JournalStorage(JournalFileBackend(storage))
    try:  # Optuna's own opening, which refuses another schema with a message for its Python API
        opened = RDBStorage(storage, skip_compatibility_check=True)
    except Exception as err:  # SQLAlchemy's: a malformed URL, a driver that is not installed, no such dir
        raise ConfigError(f"hydra.sweeper.storage={storage}: {' '.join(str(err).split())}; {allowed}") from None
    written, current = opened.get_current_version(), opened.get_head_version()
    if written != current:
        fix = (
            f"upgrade it with `optuna storage upgrade --storage {storage}`"
            if written in opened.get_all_versions()
            else "a newer Optuna (pip install -U optuna)"
        )
        raise ConfigError(
            f"hydra.sweeper.storage={storage} holds studies of another Optuna (schema {written}; Optuna "
            f"{optuna.__version__} reads {current}); allowed: {fix}, or another storage"
        )
    return opened

