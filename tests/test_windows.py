"""Windows of steps (experiments.training.windows): where they end, that Lightning counts them as it counts batches, and
that they change the speed, never the maths."""

import lightning as L
import pytest
import torch
from conftest import compose_config, final_weights

from experiments.commands.train import train
from experiments.data import SyntheticRegression
from experiments.training.module import Regressor
from experiments.training.windows import Position, window_batches


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
    ],
)
def test_where_a_window_ends(position, batches):
    assert window_batches(position) == batches


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

    def __init__(self):
        self.ends = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loop = trainer.fit_loop.epoch_loop
        self.ends.append((trainer.global_step, loop.batch_progress.total.processed, loop._batches_that_stepped))


def test_lightning_counts_a_windows_batches_and_steps():
    # 8 batches an epoch, 2 a step, a log every 3 steps: Lightning's loop runs a window an iteration, and counts
    # each window's batches and steps as if it had run them one an iteration.
    data = SyntheticRegression(num_samples=640, num_features=8, batch_size=64, seed=0)
    data.setup()
    sgd = lambda params: torch.optim.SGD(params, lr=0.05)  # noqa: E731
    module = Regressor(torch.nn.Linear(8, 1), sgd, data.feature_mean, data.feature_std)
    windows = Windows()
    trainer = L.Trainer(
        max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[windows], limit_val_batches=0, log_every_n_steps=3,
        accumulate_grad_batches=2,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 12 and trainer.fit_loop.epoch_loop.batch_progress.total.completed == 24
    # The first 5 batches (warm-up) a step a window (the 3rd step ends at batch 6), then to each log step.
    steps = [step for step, _, _ in windows.ends]
    assert steps == [1, 2, 3, 4, 6, 8, 9, 12]  # epochs end at steps 4, 8 and 12; log steps are 3, 6, 9, 12
    # `_batches_that_stepped` counts optimizer steps (it is the step Lightning writes logs at), after the window:
    # Lightning adds the window's last one itself once on_train_batch_end has run.
    assert all(stepped == step - 1 and processed == 2 * step for step, processed, stepped in windows.ends)
