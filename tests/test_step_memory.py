"""A data.batch_size whose training step cannot fit is refused before training (experiments.training.step_memory):
the step's memory is measured with the run's own model, so an MLP's activations count."""

import lightning as L
import pytest
import torch
from conftest import compose_config
from hydra.utils import instantiate

from experiments.config.errors import ConfigError
from experiments.training import step_memory
from experiments.training.probe import Probe

MiB = 2**20


def built(*overrides: str, model=("model=mlp", "model.hidden=[256,256]")):
    cfg = compose_config(*model, "data.num_samples=4096", *overrides)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    data = instantiate(cfg.data)
    data.setup("fit")
    return cfg, trainer, data


def test_the_estimate_of_a_step_is_what_the_step_allocates():
    # The check measures small steps; a real step of 2048 allocates what it extrapolates to.
    cfg, trainer, data = built("data.batch_size=2048")
    real = Probe(cfg, trainer, data, torch.device("cpu")).step_bytes(2048)
    refused = {}
    for margin in (0.97, 1.03):  # just under, just over what the real step allocated
        available = int(margin * real)
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(step_memory, "host_available", lambda available=available: available)
                step_memory.check_step_memory(cfg, trainer, data)
            refused[margin] = None
        except ConfigError as err:
            refused[margin] = str(err)
    assert refused[1.03] is None  # admitted: the step fits what is there
    message = refused[0.97]  # refused: it would not have
    assert message.startswith("data.batch_size=2048: a training step of 2048 samples a rank needs about "), message
    assert "bytes a sample: the batch, the activations and their gradients, measured" in message
    assert "allowed: data.batch_size=1024 trainer.accumulate_grad_batches=2 (the same effective batch)" in message


def test_activations_are_counted_the_mlp_needs_more_a_sample_than_the_linear():
    per_sample = {}
    for model, args in {"model=linear": ["model=linear"], "model=mlp": ["model=mlp", "model.hidden=[256,256]"]}.items():
        cfg, trainer, data = built(model=args)
        probe = Probe(cfg, trainer, data, torch.device("cpu"))
        per_sample[model] = (probe.step_bytes(64) - probe.step_bytes(32)) / 32
    assert per_sample["model=linear"] < 200  # its batch and output: (8 + 1) x 4 bytes, a few copies
    assert per_sample["model=mlp"] > 4 * 256 * 2  # two hidden layers of 256 kept for the backward pass, and more


def test_a_batch_that_fits_nowhere_near_is_refused_in_one_line_through_train(tmp_path, monkeypatch):
    from experiments.commands.train import train

    monkeypatch.setattr(step_memory, "host_available", lambda: 64 * MiB)
    with pytest.raises(ConfigError, match=r"^data.batch_size=4096: a training step of 4096 samples"):
        train(compose_config("model=mlp", "model.hidden=[4096]", "data.num_samples=8192", "data.batch_size=4096",
                             "logger=none"), tmp_path / "run")  # fmt: skip
    assert not (tmp_path / "run").exists()
