"""Windows of steps (experiments.training.windows): where they end, that Lightning counts them as it counts batches, and
that they change the speed, never the maths."""

import lightning as L
import pytest
import torch
from conftest import compose_config, final_weights
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from experiments.commands.train import train
from experiments.data import SyntheticRegression
from experiments.training.module import Regressor
from experiments.training.windows import Pace, Position, window_batches


@pytest.mark.parametrize(
    ("position", "batches"),
    [
        (Position(step=0, batch=0, batches=100, log_every=50), 50),  # to the first log step, included
        (Position(step=49, batch=49, batches=100, log_every=50), 1),  # the log step itself
        (Position(step=50, batch=50, batches=80, log_every=50), 30),  # to the epoch's end
        (Position(step=0, batch=0, batches=100, log_every=0), 100),  # logging off: the whole epoch
        (Position(step=3, batch=3, batches=100, log_every=1), 1),  # every step a log step
        (Position(step=0, batch=0, batches=100, log_every=50, max_steps=7), 7),
        (Position(step=10, batch=10, batches=100, log_every=50, every_steps=(16,)), 6),  # a checkpoint at 16
        (Position(step=10, batch=10, batches=100, log_every=50, one_step=True), 1),
        # accumulation: whole optimizer steps, the epoch's last one short (Lightning steps on an epoch's last batch)
        (Position(step=0, batch=0, batches=10, accumulate=3, log_every=50), 10),
        (Position(step=0, batch=0, batches=30, accumulate=3, log_every=4), 12),
        (Position(step=3, batch=9, batches=30, accumulate=3, log_every=4), 3),
        (Position(step=0, batch=0, batches=10, accumulate=3, log_every=50, one_step=True), 3),
        # validation every 7 batches (val_check_interval=7), counted over the epoch: mid-step if it falls there
        (Position(step=0, batch=0, batches=30, log_every=50, val_every=7, val_count=0), 7),
        (Position(step=2, batch=6, batches=30, accumulate=3, log_every=50, val_every=7, val_count=6), 1),
        (Position(step=2, batch=7, batches=30, accumulate=3, log_every=50, val_every=7, val_count=7), 7),
        # several log intervals a window (Pace): to the `intervals`-th log step ahead, from wherever the window starts
        (Position(step=0, batch=0, batches=100, log_every=10, intervals=3), 30),
        (Position(step=5, batch=5, batches=100, log_every=10, intervals=3), 25),  # after an epoch's end mid-interval
        (Position(step=0, batch=0, batches=25, log_every=10, intervals=3), 25),  # the epoch's end first
        (Position(step=0, batch=0, batches=100, log_every=10, intervals=3, every_steps=(16,)), 16),
        (Position(step=0, batch=0, batches=100, log_every=10, intervals=3, one_step=True), 1),
    ],
)
def test_where_a_window_ends(position, batches):
    assert window_batches(position) == batches


@pytest.mark.parametrize(
    ("window_s", "log_every", "step_s", "intervals"),
    [
        (0.1, 10, 0.25e-3, 40),  # the seed's Linear at B=64: 40 log intervals, 400 steps, 0.1 s
        (0.1, 10, 0.9e-3, 11),  # at B=1024
        (0.1, 10, 12e-3, 1),  # an MLP's step: a log interval is longer than window_s, one a window
        (0.1, 1, 0.2, 1),
        (0, 10, 0.25e-3, 1),  # window_s=0: a window a log step
    ],
)
def test_a_window_runs_the_log_intervals_of_window_s(window_s, log_every, step_s, intervals):
    pace = Pace(window_s, log_every, agreed=False)
    pace.window_done(step_s * 7, steps=7)
    assert pace.intervals == intervals


def test_several_ranks_keep_their_pace_until_it_is_agreed():
    pace = Pace(0.1, 10, agreed=True)
    pace.window_done(0.25e-3 * 7, steps=7)  # this rank's own time: not used alone (the ranks' windows would differ)
    assert (pace.intervals, pace.step_s) == (1, 0.25e-3)
    pace.settle(0.5e-3)  # the slowest rank's, from the all-reduce (training.interruption)
    assert pace.intervals == 20
    pace.window_done(0.1, steps=0)  # a window without an optimizer step (validation mid-accumulation) says nothing
    assert pace.step_s == 0.25e-3


RUN = ["trainer.max_epochs=3", "optimizer.momentum=0.9", "logger=none"]


@pytest.mark.parametrize("accumulate", [1, 3])
def test_windows_change_the_speed_not_the_maths(tmp_path, accumulate):
    # A window a step (every step logged), windows of 3 and of 8 steps (an epoch): the same weights, bit for bit.
    runs = {}
    for every in (1, 3, 50):
        overrides = [*RUN, f"trainer.log_every_n_steps={every}", f"trainer.accumulate_grad_batches={accumulate}"]
        runs[every] = train(compose_config(*overrides), tmp_path / str(every))
    assert len({m["global_step"] for m in runs.values()}) == 1
    reference = final_weights(tmp_path / "1")
    for every in (3, 50):
        assert all(torch.equal(t, reference[k]) for k, t in final_weights(tmp_path / str(every)).items())


class Windows(L.Callback):
    """The batch index of each window's on_train_batch_end, and where Lightning's counters stood."""

    made = []  # every one made, the latest last (a run's config builds its own: +callbacks.windows._target_)

    def __init__(self):
        self.ends = []
        Windows.made.append(self)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loop = trainer.fit_loop.epoch_loop
        self.ends.append((trainer.global_step, loop.batch_progress.total.processed, loop._batches_that_stepped))


@pytest.mark.parametrize(
    ("window_s", "ends"),
    [
        # The first 5 batches (warm-up) a step a window (the 3rd step ends at batch 6), then to each log step;
        # epochs end at steps 4, 8 and 12; log steps are 3, 6, 9, 12.
        (0, [1, 2, 3, 4, 6, 8, 9, 12]),
        # A pace of more log intervals than an epoch holds (60 s of these steps): then to each epoch's end.
        (60, [1, 2, 3, 4, 8, 12]),
    ],
)
def test_lightning_counts_a_windows_batches_and_steps(window_s, ends):
    # 8 batches an epoch, 2 a step, a log every 3 steps: Lightning's loop runs a window an iteration, and counts
    # each window's batches and steps as if it had run them one an iteration.
    data = SyntheticRegression(num_samples=640, num_features=8, batch_size=64, seed=0)
    data.setup()
    sgd = lambda params: torch.optim.SGD(params, lr=0.05)  # noqa: E731
    module = Regressor(torch.nn.Linear(8, 1), sgd, data.feature_mean, data.feature_std, window_s=window_s)
    windows = Windows()
    trainer = L.Trainer(
        max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[windows], limit_val_batches=0, log_every_n_steps=3,
        accumulate_grad_batches=2,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 12 and trainer.fit_loop.epoch_loop.batch_progress.total.completed == 24
    assert [step for step, _, _ in windows.ends] == ends
    # `_batches_that_stepped` counts optimizer steps (it is the step Lightning writes logs at), after the window:
    # Lightning adds the window's last one itself once on_train_batch_end has run.
    assert all(stepped == step - 1 and processed == 2 * step for step, processed, stepped in windows.ends)


def scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    return [(p.step, p.value) for p in events.Scalars(tag)]


def test_a_window_of_many_log_steps_logs_each_at_its_own_step(tmp_path):
    # 2 epochs of 8 steps, each a log step, an lr that changes every step. At a pace of 60 s a window each runs to
    # its epoch's end after the 5 warm-up steps; at window_s=0 a window is a step. The same points either way: each
    # log step's own loss and lr, at its own step.
    runs = {w: tmp_path / f"window_s={w}" for w in (60, 0)}
    for window_s, run_dir in runs.items():
        train(compose_config(f"window_s={window_s}", "scheduler=cosine"), run_dir)
    for tag in ("train/loss", "train/lr"):
        points = scalars(runs[60], tag)
        assert [step for step, _ in points] == list(range(16))
        assert points == scalars(runs[0], tag)
    assert len({value for _, value in scalars(runs[60], "train/loss")}) == 16
    # perf/* at the windows' ends: after the warm-up, each epoch's end.
    assert [step for step, _ in scalars(runs[60], "perf/step_time_ms")] == [8, 16]
    assert [step for step, _ in scalars(runs[0], "perf/step_time_ms")] == list(range(6, 17))


def test_the_default_pace_runs_many_log_steps_a_window_for_a_small_model(tmp_path):
    # The default window_s (0.1 s): a step of this model takes well under a millisecond, so after the warm-up
    # windows (a step each) a window runs to the epoch's end: 7 windows in all, not 16.
    cfg = compose_config("+callbacks.windows._target_=test_windows.Windows")
    assert cfg.window_s == 0.1
    train(cfg, tmp_path)
    windows = Windows.made[-1]
    assert [step for step, _, _ in windows.ends] == [1, 2, 3, 4, 5, 8, 16]
    assert [step for step, _ in scalars(tmp_path, "train/loss")] == list(range(16))
