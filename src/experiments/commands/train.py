"""The train recipe (`python train.py`): TrainRecipe's spine is setup (check, build), fit, finish (record);
`train(cfg, run_dir)` runs it and is what tests call with a composed config."""

import sys
import time
from contextlib import nullcontext
from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig

from experiments.config.checks import check_config, check_shapes
from experiments.config.sizes import check_run_memory
from experiments.distributed import nodes, slurm
from experiments.distributed.cpu_cost import say_what_cpu_processes_cost
from experiments.distributed.launcher import ranks_join_this_job
from experiments.distributed.lost_rank import LostRank
from experiments.distributed.nodes import RankHosts
from experiments.distributed.ranks import end_with_parent, this_rank
from experiments.run import lock, provenance, state
from experiments.run.exits import OutOfSpace, full_file, is_out_of_space, out_of_memory, quiet_full_disk_in_threads
from experiments.run.files import AtomicCheckpointIO, remove_stray_temps
from experiments.run.layout import RunPaths
from experiments.run.log import open_log
from experiments.run.metrics import final_figures, record, run_record, write_metrics
from experiments.run.refused import remove_refused_start
from experiments.run.signals import Interrupted
from experiments.run.summary import EpochLines, EpochLog, print_summary, quiet_lightning
from experiments.sweeps.record import swept_overrides
from experiments.training import batch_fit, mfu
from experiments.training.callbacks import configured_callbacks, early_stop_record
from experiments.training.checkpoint import (
    check_fits,
    check_same_model,
    check_trains_on,
    load_checkpoint,
    resolve_checkpoint,
)
from experiments.training.dashboard import Dashboard, run_name
from experiments.training.interruption import Interruption
from experiments.training.last_checkpoint import LastCheckpoint
from experiments.training.log_steps import LogStepProgressBar
from experiments.training.module import Regressor
from experiments.training.perf import PerfMonitor, run_start_time
from experiments.training.step_memory import check_step_memory
from experiments.training.target import TimeToTarget


def train(cfg: DictConfig, run_dir: Path) -> dict:
    """One run in `run_dir`; returns its metrics.json record (a completed run's own, when there is nothing to do).
    The writing rank holds the dir's lock for the whole run (experiments.run.lock; a single run's was taken
    before Hydra wrote anything), and, holding it, removes what writes cut short by a kill left behind."""
    run_dir = Path(run_dir)
    writer = this_rank().zero
    with lock.holding(run_dir, *_lock_names(run_dir)) if writer else nullcontext(), quiet_full_disk_in_threads():
        try:
            check_config(cfg)
            return _train(cfg, run_dir, writer)
        except BaseException:
            # A refused or failed start that recorded no run leaves nothing, not even Hydra's .hydra/ and log
            # file; a sweep's job keeps its dir, where its failed row's record goes (experiments.sweeps.record).
            if writer and not _in_sweep():
                job = HydraConfig.get().job.name if HydraConfig.initialized() else "train"
                remove_refused_start(run_dir, f"{job}.log")
            raise


def _train(cfg: DictConfig, run_dir: Path, writer: bool) -> dict:
    if writer:
        remove_stray_temps(run_dir)
    recipe = TrainRecipe(cfg, run_dir)
    if recipe.run.state is state.State.COMPLETED:
        print(
            f"nothing to do: {run_dir} holds this config's completed run (its metrics.json); to train on from it, in "
            f"a new run dir: ckpt_path={recipe.paths.last_checkpoint} with a larger trainer.max_epochs"
        )
        return recipe.run.metrics
    try:
        with recipe.interruption.handling():
            recipe.setup()
            metrics = recipe.fit()
        recipe.interruption.raise_if_signalled()
    except Interrupted as stop:
        slurm.requeue_after(stop.signum)  # a SLURM pre-emption warning: the job starts again and resumes
        raise
    except RuntimeError as err:
        slurm.end_step_after(err)  # a lost node: srun would wait for its tasks until the time limit
        raise
    return metrics


def _in_sweep() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _lock_names(run_dir: Path) -> tuple[str, str]:  # a busy dir's name in its `error:` line, and the setting
    if not _in_sweep():
        return f"hydra.run.dir={run_dir}", "hydra.run.dir"
    job, sweep = HydraConfig.get().job.num, HydraConfig.get().sweep.dir
    return f"job {job}'s dir {run_dir} (hydra.sweep.dir={sweep})", "hydra.sweep.dir"


class TrainRecipe:
    """One training run. Checks (in `train` and `__init__`) come before anything is built; `setup` builds the
    trainer (its constructors check their settings before the data is made), the data and the module, and
    checks that they fit in memory; `fit` trains; `finish` records the run (metrics.json, TensorBoard's HPARAMS
    row, the closing summary)."""

    def __init__(self, cfg: DictConfig, run_dir: Path):
        self.started = run_start_time()
        quiet_lightning()  # the commands did (experiments.commands.entry.load_task); this, for callers of train()
        self.cfg, self.paths = cfg, RunPaths(run_dir)
        self.rank = this_rank()
        if self.rank.started_by_launcher:
            end_with_parent()
        self.run = state.settle(run_dir, cfg, writer=self.rank.zero)  # refuses a dir holding another config's run
        # What produced the run (git, versions, machine, data): collected beside the set-up, by the writer.
        self.origin = provenance.start_collecting(cfg) if self.rank.zero else None
        if self.run.state is not state.State.COMPLETED:
            # An unfinished run resumes itself; otherwise `ckpt_path` (a file, or `last`).
            self.ckpt_path = self.run.checkpoint or resolve_checkpoint(cfg.ckpt_path, run_dir)
        # A signal saves the exact position over last.ckpt, so that `ckpt_path=last` resumes from it.
        self.interruption = Interruption(str(self.paths.last_checkpoint))
        # And every epoch's end (checkpoint.*), so that a hard kill loses at most that interval.
        self.last_checkpoint = LastCheckpoint(self.paths.last_checkpoint, cfg, **cfg.get("checkpoint", {}))
        # A rank that dies mid-run: one line naming it, the step and the checkpoint to resume from.
        self.lost_rank = LostRank(self.paths.last_checkpoint)

    def setup(self) -> None:
        cfg = self.cfg
        self.resumed = load_checkpoint(self.ckpt_path) if self.ckpt_path else None  # eval's and predict's checks
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        self.perf = PerfMonitor(cfg.data.batch_size, started_at=self.started, saver=self.last_checkpoint)
        self.target = TimeToTarget(self.perf, **cfg.target)
        self.trainer = self._trainer()
        self.data = instantiate(cfg.data)
        self.data.setup("fit")
        # batch.effective: the micro-batch and accumulation, measured on this device (the config then holds them).
        self.cfg, self.batch_fit = batch_fit.fit_into(
            cfg, self.trainer, self.data, self.perf, self.resumed, self.rank.zero
        )
        cfg = self.cfg
        check_shapes(
            cfg.data.batch_size, len(self.data.x_train), cfg.model.in_features, self.data.num_features,
            cfg.trainer.accumulate_grad_batches,
        )  # fmt: skip
        if self.resumed:
            check_fits(self.resumed, self.data.num_features, cfg.model.out_features)
            check_same_model(self.resumed, cfg.model, self.data.num_features)  # its shape before its budget
            if not self.run.checkpoint:  # ckpt_path: another run's, maybe finished at this budget
                check_trains_on(self.resumed, cfg.trainer.max_epochs, cfg.trainer.max_steps)
        data = self.data  # the model, and on a GPU a batch and device-resident data, where they go
        check_run_memory(self.cfg, self.trainer.strategy.root_device, data.num_features, data.y_train.shape[1],
                         len(data.x_train) + len(data.x_val), self.trainer.world_size)  # fmt: skip
        if self.batch_fit is None:  # a step of data.batch_size, measured (activations too); batch.effective fits one
            check_step_memory(cfg, self.trainer, data)
        # The checkpoint carries the run's config and column names, for eval.py and predict.py.
        self.last_checkpoint.describe_data(cfg, self.data.feature_names, self.data.target_name, self.batch_fit)
        net = instantiate(cfg.model, in_features=self.data.num_features)
        optimizer, scheduler = instantiate(cfg.optimizer), instantiate(cfg.scheduler)
        self.module = Regressor(
            net, optimizer, self.data.feature_mean, self.data.feature_std, scheduler=scheduler, compile=cfg.compile,
            window_s=cfg.window_s,
        )
        self.origin_entry = None
        if self.rank.zero:
            state.claim(self.run, cfg)
            open_log(self.paths.log)  # the run's own lines, from here to its error (experiments.run.log)
            say_what_cpu_processes_cost(self.trainer, cfg.data.batch_size, self.data.num_features)
            self._record_origin()

    def _record_origin(self) -> None:
        try:
            entry, diff = self.origin.result()
        except Exception as err:  # a probe's bug must not fail the run: say so, once
            print(f"warning: the run's provenance could not be collected: {err!r}", file=sys.stderr)
            return
        resumed_from = None
        if self.resumed:
            resumed_from = {"checkpoint": str(self.resumed.path.resolve()), "global_step": self.resumed.global_step}
            if (note := provenance.code_change(self.resumed.provenance, entry)) is not None:
                print(note, file=sys.stderr)
        self.origin_entry = provenance.record_start(self.paths, entry, diff, resumed_from)
        self.last_checkpoint.describe_origin(self.origin_entry)

    def _trainer(self) -> L.Trainer:
        cfg = self.cfg
        # Curves restart where the checkpoint does, when the run resumes in its own dir; from step 0 when an earlier
        # start was killed before its first checkpoint and left its event file.
        resume_step = self.resumed.global_step if self.run.checkpoint else None
        if resume_step is None and any(self.paths.root.glob("tensorboard/**/events.out.tfevents.*")):
            resume_step = 0
        logger_options = state.logger_options(cfg.logger, resume_step)
        # TensorBoard's run name (docs/tensorboard.md): logger.version when the user gives one; in a sweep, what
        # the sweep varies (`batch_size=64`); else none, and TensorBoard names the run after its dir.
        hydra = HydraConfig.get() if HydraConfig.initialized() else None
        swept = swept_overrides(hydra) if hydra and hydra.mode == RunMode.MULTIRUN else {}
        name = run_name(swept)
        if cfg.logger and str(cfg.logger._target_).endswith("TensorBoardLogger"):
            name = logger_options["version"] = cfg.logger.version or name
        logger = instantiate(cfg.logger, save_dir=str(self.paths.root), **logger_options) if cfg.logger else False
        self.dashboard = Dashboard(cfg, swept, trial_id="/".join(filter(None, [self.paths.root.name, name])))
        nodes.choose_interface()  # before the ranks meet: the master address and the interface towards it
        rank_hosts = RankHosts(self.paths, self.last_checkpoint, self.lost_rank)
        callbacks = [self.target, self.perf, self.interruption, rank_hosts]
        callbacks += configured_callbacks(cfg, self.paths.root)
        callbacks.append(self.last_checkpoint)  # a Checkpoint: Lightning runs it after the others
        if cfg.trainer.enable_progress_bar:
            # A terminal gets the bar; a log file (SLURM, nohup, CI) a line per epoch, never a redraw.
            bar = LogStepProgressBar(refresh_rate=cfg.trainer.log_every_n_steps)
            # The epoch lines go to train.log either way (a terminal has them there only).
            callbacks += [bar, EpochLog()] if sys.stdout.isatty() else [EpochLines()]
        return instantiate(
            cfg.trainer,
            callbacks=callbacks,
            logger=logger,
            plugins=[AtomicCheckpointIO(), *slurm.plugins()],
            default_root_dir=self.paths.root,
        )

    def fit(self) -> dict:
        status, out_of_memory_error = "failed", None
        if self.rank.zero:
            self.dashboard.start(self.trainer, self.data)
        try:
            with ranks_join_this_job():
                self.trainer.fit(self.module, datamodule=self.data, ckpt_path=self.ckpt_path)
            status = "completed"
        except Interrupted as stop:
            status = None if stop.checkpoint is None else "interrupted"  # None: before training, nothing to record
            raise
        except torch.OutOfMemoryError as err:
            out_of_memory_error = str(err).splitlines()[0]  # the error's frames hold the step's tensors: let them go
        except RuntimeError as err:
            if (lost := self.lost_rank.error(err, self.trainer.global_step)) is not None:
                raise lost from None  # gloo's traceback names an address, not the rank: the line says which
            raise
        except OSError as err:
            if is_out_of_space(err):  # TensorBoard's event file: the other writes raise OutOfSpace themselves
                raise OutOfSpace(full_file(err, self.trainer.logger, self.paths.root)) from None
            raise
        finally:
            if status is not None:
                self.metrics = self.finish(status)
        if out_of_memory_error is not None:
            cfg = self.cfg
            advice = batch_fit.suggestion(cfg, self.trainer, self.data)  # measured now that the step's memory is free
            raise out_of_memory(out_of_memory_error, cfg.data.batch_size, cfg.trainer.accumulate_grad_batches, advice)
        return self.metrics

    def finish(self, status: str) -> dict:
        trainer, module, data = self.trainer, self.module, self.data
        train_loss = getattr(module, "last_loss", None)  # the last step's, logged or not
        # A failed run's weights may be unusable (diverged), and after running out of memory, measuring them could
        # run out again: its fit is left blank.
        fit = final_figures(module.net, data) if status != "failed" else {"optimal_val_mse": data.optimal_val_mse}
        metrics = record(
            **run_record(trainer, status, self.cfg.data.batch_size),
            **fit,
            train_loss=None if train_loss is None else train_loss.item(),
            **self.perf.summary,
            **mfu.run_utilization(trainer, module.net, self.perf.summary, status),
            **self.target.summary,
            **early_stop_record(trainer),
            data_device=str(data.x_train.device),
            data_pinned=data.pins_batches,
            batch_fit=self.batch_fit.record if self.batch_fit else None,
            **self.last_checkpoint.summary,
            **provenance.code_fields(self.origin_entry),
            wall_time_s=time.time() - self.started,
        )
        if trainer.is_global_zero:
            try:
                write_metrics(self.paths.metrics, metrics)
                self.dashboard.finish(trainer, metrics)  # TensorBoard's HPARAMS row: its final figures
                for logger in trainer.loggers:
                    logger.finalize(metrics["status"])
            except (OSError, OutOfSpace) as err:
                # A run that failed for a full disk records `status: failed` where it still can; the run's own
                # error names the file that did not fit.
                if not is_out_of_space(err):
                    raise
                if status != "failed":
                    if not isinstance(err, OutOfSpace):
                        err = OutOfSpace(full_file(err, trainer.logger, self.paths.root))
                    raise err from None
            print_summary(metrics, self.paths.root)
        return metrics


def main(cfg: DictConfig) -> float:
    """Exit codes: docs/failures.md (commands.entry makes them). A sweep's job raises, never exits: Hydra records it
    failed and runs the others (a SystemExit would end the sweep), then re-raises the first failure: exit 1."""
    metrics = train(cfg, Path(HydraConfig.get().runtime.output_dir))
    if _in_sweep() and metrics["status"] != "completed":
        raise RuntimeError(f"the run ended {metrics['status']} (see its metrics.json)")
    return metrics["val_mse"]  # the objective that a search minimizes (hparams_search=optuna)
