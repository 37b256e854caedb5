"""How every command (`train.py`, `eval.py`, `predict.py`) ends: one path for user errors and signals.

`command(config_name, task)` replaces `@hydra.main` on a task `def main(cfg) -> result`, named as
"module:function" and imported only once Hydra has composed the config, so that `--help` and a refused override
answer without loading Lightning. Whatever refuses the input — a check (`ConfigError`), a constructor that Hydra
instantiates (Hydra wraps its error in an `InstantiationException`), OmegaConf reading a setting, or Hydra
composing the config (an unknown option `logger=nope`, an unknown key `trainer.nope=1`, a bad override) — the
user sees one line `error: <setting>=<value> ...; allowed: ...` on stderr and the command exits 2
(docs/failures.md). In a multirun a job's error is raised on, so that Hydra records that job as failed and runs
the others; the sweep then exits 1.
"""

import functools
import importlib
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import (
    ConfigCompositionException,
    InstantiationException,
    MissingConfigException,
    OverrideParseException,
)
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from experiments.commands.help import print_help
from experiments.config.errors import ConfigError
from experiments.config.nearest import config_keys, nearest_keys
from experiments.config.rules import check_rules
from experiments.distributed.ranks import this_rank
from experiments.run.exits import EXIT_BAD_INPUT, EXIT_FAILED, Abort, OutOfSpace, RunFailed, is_out_of_space
from experiments.run.log import LOG, close_log, say
from experiments.run.refused import remove_refused_start
from experiments.run.signals import Interrupted, stopping_at_once

# conf/ sits at the repository root, beside train.py (the project is installed editable).
CONFIG_DIR = str(Path(__file__).resolve().parents[3] / "conf")

# Hydra's errors while it composes the config, before any job runs.
COMPOSITION_ERRORS = (ConfigCompositionException, OverrideParseException)


def command(
    config_name: str, task: str, config_dir: str = CONFIG_DIR, checked: tuple[str, ...] | None = None
) -> Callable[[], Any]:
    """The command that composes `config_name` and runs `task` ("module:function") on it. The settings' own rules
    (experiments.config.rules) are checked first, before the task's module is imported: on the keys `checked` of
    the config (None: all of them)."""
    # A partial of a module-level function, not a closure: joblib's and submitit's launchers pickle the job.
    job = functools.partial(run_task, task, checked)
    # Hydra names the job after the task's module (`train`: its log file is train.log).
    job.__module__, job.__name__ = task.split(":")
    job.__qualname__ = job.__name__
    hydra_main = hydra.main(version_base="1.3", config_path=config_dir, config_name=config_name)(job)
    app = functools.partial(print_help, config_name, config_dir, job.__module__.rsplit(".", 1)[-1])  # --help
    return functools.partial(run_command, hydra_main, app, config=(config_name, config_dir))


# Hydra's flags that choose another config than the command's: its own --help then answers.
OTHER_CONFIG = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd")


def run_task(task: str, checked: tuple[str, ...] | None, cfg: DictConfig) -> Any:
    return run_job(functools.partial(checked_task, task, checked), cfg)


def checked_task(task: str, checked: tuple[str, ...] | None, cfg: DictConfig) -> Any:
    """The task, once the settings' own rules hold: a bad value is refused in well under a second, before the task's
    module imports torch and Lightning (5 s), and what Hydra wrote for the run is removed (a sweep's job keeps its
    dir, where its failed row's record goes)."""
    try:
        check_rules(cfg if checked is None else OmegaConf.masked_copy(cfg, list(checked)))
    except ConfigError:
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode != RunMode.MULTIRUN and this_rank().zero:
            remove_refused_start(Path(hydra_cfg.runtime.output_dir), f"{hydra_cfg.job.name}.log")
        raise
    return load_task(task)(cfg)


def load_task(task: str) -> Callable[[DictConfig], Any]:
    """The task's function, its module imported after experiments.internals: that imports torchmetrics without
    matplotlib (0.3 s of start-up), which it can only do before anything imports Lightning. Every command then
    prints Lightning's lines once each, without its chatter (experiments.run.summary.quiet_lightning): Lightning is
    imported here, after Hydra has given the root logger its handler."""
    from experiments import internals  # noqa: F401
    from experiments.run.summary import quiet_lightning

    quiet_lightning()
    module, function = task.split(":")
    return getattr(importlib.import_module(module), function)


def run_command(
    hydra_main: Callable[[], Any], app_help: Callable[[], None] | None = None, config: tuple[str, str] | None = None
) -> Any:
    """Run a `@hydra.main` function as a command: Hydra's own composition errors become one line and exit 2.

    Hydra composes the config inside its `run_and_report`, which prints the error over several lines (a
    traceback for some) and exits 1 before the task runs. Its documented switch HYDRA_FULL_ERROR=1 makes
    it raise instead, so the error reaches this function; a user who set it keeps Hydra's full report. `config`
    (the config's name and dir) names the nearest keys to a key the config does not have.
    Signals before the run installs its own handling (while Hydra composes) end the command at once with
    128 + the signal's number: there is nothing to save yet.
    """
    args = sys.argv[1:]
    if app_help and any(a in ("--help", "-h") for a in args) and not any(a.split("=")[0] in OTHER_CONFIG for a in args):
        hydra_main = app_help
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return hydra_main()
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        with stopping_at_once():
            return hydra_main()
    except Interrupted as stop:
        print(stop, file=sys.stderr)
        sys.exit(stop.exit_code)
    except Abort as abort:  # raised in a Hydra callback: a busy run dir, a full disk under results.csv
        print(f"error: {abort.error}", file=sys.stderr)
        sys.exit(abort.exit_code)
    except Exception as err:
        error = user_error(err, config=config)
        if is_out_of_space(err) and not _multirun():  # Hydra's own files (.hydra/, the log), before the task
            print(f"error: {_out_of_space(err)}", file=sys.stderr)
            sys.exit(EXIT_FAILED)
        if isinstance(err, COMPOSITION_ERRORS) and error is not None:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)
        if not _multirun():
            raise  # a crash: Python prints the traceback and exits 1
        # Hydra's sweeper re-raises the first failed job's error once every job has run.
        print(f"error: a job of the sweep failed: {error or err} (results.csv has every job's status)", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)


def run_job(task: Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
    """One run or one job of a sweep: its user errors end it with one line (exit 2); signals with 128 + n."""
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        return task(cfg)
    except Interrupted as stop:  # a sweep stops too: the user or the scheduler asked for it
        if multirun:
            # The exit passes Hydra's callbacks by (SweepRecord): the job records itself.
            from experiments.sweeps.record import interrupted_line, record_interrupted_job  # imported when needed

            say(interrupted_line(stop, HydraConfig.get()), file=sys.stderr)  # into the run's train.log too
            record_interrupted_job(HydraConfig.get())
        else:
            say(str(stop), file=sys.stderr)  # into the run's train.log too, when the run opened it
        sys.exit(stop.exit_code)
    except Exception as err:
        error = user_error(err, cfg) or (err if isinstance(err, RunFailed) else None)
        if error is None and is_out_of_space(err):
            error = _out_of_space(err)
        if error is None:
            LOG.exception("the run crashed")  # its traceback, in the run's train.log too
            raise
        if multirun:
            LOG.error(f"error: {error}")  # the job's train.log (Hydra prints the sweep's failures)
            raise error from err  # Hydra records the job as failed and runs the others
        say(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT if isinstance(error, ConfigError) else EXIT_FAILED)
    finally:
        close_log()


def user_error(
    err: BaseException, cfg: DictConfig | None = None, config: tuple[str, str] | None = None
) -> ConfigError | None:
    """The user error behind `err`, as a one-line ConfigError; None when `err` is not one (a bug, a crash).

    `cfg`, the composed config, gives the value of a setting that a constructor refused; `config`, the config's name
    and dir, the keys nearest to one that the config does not have."""
    if isinstance(err, ConfigError):
        return ConfigError(" ".join(str(err).split()))
    if isinstance(err, InstantiationException):
        return _constructor_error(err, cfg)
    if isinstance(err, MissingConfigException):
        return _missing_option(err)
    if isinstance(err, OverrideParseException):
        return ConfigError(
            f"{err.override} is not an override: {err.message.splitlines()[0]}; allowed: key=value, group=option, "
            "+key=value to add a key, ~key to delete one (https://hydra.cc/docs/advanced/override_grammar/basic/)"
        )
    if isinstance(err, ConfigCompositionException) and isinstance(err.__cause__, OmegaConfBaseException):
        return _unknown_key(err.__cause__, config)
    if isinstance(err, OmegaConfBaseException):  # e.g. an interpolation to a key that does not exist
        return ConfigError(
            f"{err.full_key}: {str(err).splitlines()[0]}; allowed: a value, or ${{key}} of a key that exists"
        )
    return None


def _missing_option(err: MissingConfigException) -> ConfigError:
    if not err.options:  # the primary config itself (--config-name)
        return ConfigError(f"--config-name={err.missing_cfg_file}: no such config; allowed: a file of conf/")
    group, _, option = (err.missing_cfg_file or "").rpartition("/")
    return ConfigError(f"{group}={option} is not an option of {group}; allowed: {', '.join(err.options)}")


def _unknown_key(cause: OmegaConfBaseException, config: tuple[str, str] | None) -> ConfigError:
    setting = cause.full_key
    value = next((o.split("=", 1)[1] for o in _overrides() if o.split("=", 1)[0].lstrip("+~") == setting), "...")
    parent = cause.parent_node
    keys = [k for k in parent if not str(k).startswith("_")] if parent is not None else []
    where = setting.rpartition(".")[0] or "the config"
    allowed = f"a key of {where} ({', '.join(map(str, keys))})" if keys else "a key the config has"
    near = nearest_keys(setting, config_keys(_composed(*config))) if config else []
    if near:  # a typo: the key it was meant to be, not the advice to add the typo
        return ConfigError(
            f"{setting}={value}: {where} has no key {cause.key}; did you mean {' or '.join(near)}?; allowed: {allowed}"
        )
    return ConfigError(
        f"{setting}={value}: {where} has no key {cause.key}; allowed: {allowed}, or +{setting}={value} to add it"
    )


def _composed(config_name: str, config_dir: str) -> DictConfig | None:
    """The config with the groups that the command line chose, and none of its other overrides (one of them is the
    key that is not there); None when even that does not compose."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    groups = [o for o in _overrides() if "." not in o.split("=")[0] and "," not in o and not o.startswith(("+", "~"))]
    for overrides in (groups, []):
        GlobalHydra.instance().clear()  # the failed composition's
        try:
            with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
                return compose(config_name, overrides=overrides)
        except Exception:  # the groups are refused too: Hydra names that error when the key is fixed
            continue
    return None


def _constructor_error(err: InstantiationException, cfg: DictConfig | None) -> ConfigError | None:
    cause = err.__cause__
    if isinstance(cause, ConfigError):
        return user_error(cause)
    from lightning.fabric.utilities.exceptions import MisconfigurationException  # loaded by then: a constructor ran

    from experiments import internals

    if not isinstance(cause, MisconfigurationException | ValueError | TypeError):
        return None  # a crash inside the constructor, not a setting it refused
    node, target = internals.instantiation_failure(err)
    reason = " ".join(str(cause).split())
    setting = _named_setting(cfg, node, reason)
    if setting is None:
        return ConfigError(f"{node or target}: {reason}; allowed: what {target} accepts (see its documentation)")
    key, value = setting
    if "unexpected keyword argument" in reason:
        return ConfigError(
            f"{key}={value}: {target} takes no argument {key.rsplit('.', 1)[-1]}; allowed: its arguments"
        )
    return ConfigError(f"{key}={value} is refused by {target}: {reason}; allowed: what {target} accepts for it")


def _named_setting(cfg: DictConfig | None, node: str, reason: str) -> tuple[str, Any] | None:
    """The key of `node` that the constructor's message names (`limit_train_batches`), with its value."""
    settings = OmegaConf.select(cfg, node) if cfg is not None and node else None
    if isinstance(settings, DictConfig):
        # The longest name first: `max_steps` before `steps`.
        for key in sorted((k for k in settings if not str(k).startswith("_")), key=len, reverse=True):
            if re.search(rf"\b{re.escape(str(key))}\b", reason):
                return f"{node}.{key}", settings.get(key)
    for override in _overrides():  # a key added with +key=value is in the config too, but check the line
        key, _, value = override.lstrip("+~").partition("=")
        if key.startswith(f"{node}.") and key.rsplit(".", 1)[-1] in reason:
            return key, value
    return None


def _out_of_space(err: BaseException) -> OutOfSpace:
    """`err` (a full disk's) as the one-line error that names the file, or the run dir when the error does not."""
    while err is not None and not isinstance(err, OutOfSpace | OSError):
        err = err.__cause__ or err.__context__
    if isinstance(err, OutOfSpace):
        return err
    path = getattr(err, "filename", None)
    if path is None and HydraConfig.initialized():
        path = HydraConfig.get().runtime.output_dir
    return OutOfSpace(Path(path or "."))


def _overrides() -> list[str]:
    return [a for a in sys.argv[1:] if not a.startswith("-")]


def _multirun() -> bool:
    return any(a in ("-m", "--multirun") for a in sys.argv[1:]) or "hydra.mode=MULTIRUN" in sys.argv[1:]
