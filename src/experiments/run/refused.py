"""A refused command leaves nothing behind: what Hydra made before the command's checks ran is removed again. Light
(no torch): the commands refuse a bad value before they import it (experiments.commands.entry)."""

from pathlib import Path

from experiments.run.layout import RunPaths


def remove_empty_run_dir(run_dir: Path) -> None:
    """A refused command leaves nothing: Hydra made the run dir, empty, before the checks ran. Remove it, and
    the parents it made for it (empty too), up to the working directory. Never a dir with anything in it."""
    run_dir, cwd = run_dir.resolve(), Path.cwd().resolve()
    for path in [run_dir, *run_dir.parents]:
        if path != run_dir and cwd not in path.parents:
            break
        try:
            path.rmdir()
        except OSError:  # not empty (or not there): stop
            break


def remove_refused_start(run_dir: Path, log_name: str) -> None:
    """A train.py start that failed before it recorded a run leaves nothing: Hydra wrote its `.hydra/` and its
    log file before the task ran (the log holds at most Lightning's start-up lines; the error went to stderr),
    and the lock made its file (experiments.run.lock). They are removed, and the dir with them when nothing
    else is in it; a dir that holds anything else keeps it all."""
    paths = RunPaths(run_dir)
    ours = {paths.lock, paths.root / log_name, *(paths.hydra / f"{n}.yaml" for n in ("config", "hydra", "overrides"))}
    found = {p for p in paths.root.rglob("*") if p.is_file()} if paths.root.is_dir() else set()
    if not found <= ours:
        return
    for path in found:
        path.unlink(missing_ok=True)
    if paths.hydra.is_dir() and not any(paths.hydra.iterdir()):
        paths.hydra.rmdir()
    remove_empty_run_dir(run_dir)
