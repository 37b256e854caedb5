"""batch.effective=E: the micro-batch is the largest that fits the budget, accumulation reaches E exactly, and the
run ends with the weights of a plain run with data.batch_size=E (single process and DDP x2), through resume,
sweeps and eval; bad input is refused in one line before training.

TINY's training split is 512 samples: E=192 leaves a remainder (512 = 2 x 192 + 128) that no optimizer step uses.
"""

import csv
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import ROOT, TINY, cli, compose_config, python
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from experiments.commands.entry import CONFIG_DIR
from experiments.commands.evaluate import evaluate
from experiments.commands.train import train
from experiments.config.checks import check_shapes
from experiments.config.errors import ConfigError
from experiments.config.sizes import host_available
from experiments.data.loader import BatchLoader, EpochShuffle
from experiments.run.exits import RunFailed
from experiments.run.layout import RunPaths
from experiments.run.signals import Interrupted
from experiments.run.summary import summary_lines
from experiments.training import batch_fit
from experiments.training.allocations import CpuAllocations
from experiments.training.module import Regressor
from experiments.training.probe import Probe

E = 192
# A budget of 8 KiB: TINY's step (8 features) takes about 47 bytes a sample beside a fixed part of about 4.1 KiB
# (an epoch's order of 512 int64, the model and its gradients), so the fit picks a micro-batch of 64 (192's largest
# divisor that fits), 3 accumulated; 48 x 2 accumulated on each of two ranks.
SMALL_BUDGET = "batch.memory_mb=0.008"
QUIET = ["logger=none"]


def weights(run_dir: Path) -> torch.Tensor:
    state = torch.load(RunPaths(run_dir).last_checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    return torch.cat([state["net.weight"].flatten(), state["net.bias"].flatten()]).double()


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    """The plain run with data.batch_size=E, and batch.effective=E with the default budget and a small one."""
    tmp = tmp_path_factory.mktemp("batch_fit")
    done = {}
    for name, overrides in {
        "plain": [f"data.batch_size={E}"],
        "fit_default": [f"batch.effective={E}"],
        "fit_small": [f"batch.effective={E}", SMALL_BUDGET],
    }.items():
        done[name] = train(compose_config(*overrides, *QUIET), tmp / name), tmp / name
    return done


# --------------------------------------------------------------------------------------------- the choice


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
@pytest.mark.parametrize("effective", [1, 24, 192, 1000, 65536, 97 * 4])
def test_the_micro_batch_is_the_largest_divisor_within_the_limit(effective, ranks):
    if effective % ranks:
        return
    per_rank = effective // ranks
    for limit in (0, 1, 2, 7, 50, 63, 64, 10**6):
        micro = batch_fit.largest_micro_batch(per_rank, limit)
        if limit < 1:
            assert micro is None
            continue
        assert per_rank % micro == 0 and micro <= limit
        assert (per_rank // micro) * micro * ranks == effective  # accumulation x micro-batch x ranks = E
        assert not any(per_rank % d == 0 for d in range(micro + 1, min(limit, per_rank) + 1))  # none larger fits


def probe_setup(*overrides: str):
    cfg = compose_config("batch.effective=512", *overrides)
    data = instantiate(cfg.data)
    data.setup("fit")
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    return cfg, trainer, data


@pytest.mark.parametrize("features", [8, 100])
def test_the_probe_measures_what_one_more_sample_adds_to_a_step(features):
    cfg, trainer, data = probe_setup(f"data.num_features={features}", "data.num_samples=2000")
    probe = Probe(cfg, trainer, data, torch.device("cpu"))
    steps = {m: probe.step_bytes(m) for m in (16, 32, 64, 128)}
    slopes = [(steps[2 * m] - steps[m]) / m for m in (16, 32, 64)]
    assert max(slopes) - min(slopes) <= 0.01 * max(slopes)  # counted, not sampled: linear in the batch
    per_sample = slopes[-1]
    # The batch's own rows (4 bytes each of x and y) are gathered, plus the step's few floats a sample.
    assert 4 * (features + 1) <= per_sample <= 4 * (features + 1) + 32


@pytest.mark.parametrize("budget_mb", [0.006, 0.01, 0.05])
def test_the_chosen_micro_batch_fits_and_the_next_larger_does_not(budget_mb):
    cfg, trainer, data = probe_setup(f"batch.memory_mb={budget_mb}")
    fit = batch_fit.measure(cfg, trainer, data, 512, cfg.batch)
    probe = Probe(cfg, trainer, data, torch.device("cpu"))
    budget = budget_mb * 2**20 - batch_fit.resident_data_bytes(data, torch.device("cpu"))  # less an epoch's order
    assert fit.budget_mb == pytest.approx(budget_mb) and fit.micro_batch * fit.accumulate == 512
    assert probe.step_bytes(fit.micro_batch) <= budget  # what it trains with fits
    larger = [d for d in batch_fit.divisors(512) if d > fit.micro_batch]
    if larger:
        assert probe.step_bytes(min(larger)) > budget  # and is the largest that does


def test_cpu_allocations_count_the_peak_and_what_is_still_live():
    with CpuAllocations() as counter:
        kept = torch.ones(256)  # 1 KiB, kept
        torch.ones(1024).sum()  # 4 KiB and the sum's 4 bytes, freed at once
    assert (counter.peak, counter.live) == (4096 + 1024 + 4, 1024) and kept.numel() == 256


def test_the_default_budget_on_the_cpu_is_the_stated_share_of_available_memory():
    cfg, trainer, data = probe_setup()
    budget, said = batch_fit.budget_bytes(cfg.batch, torch.device("cpu"), 1, 0)
    available = host_available()
    assert abs(budget - 0.5 * available) < 0.05 * available and "50% of the" in said
    two, _ = batch_fit.budget_bytes(cfg.batch, torch.device("cpu"), 2, 10 * 2**20)
    assert two < budget / 2  # two ranks on the host share it, and the second holds its own copy of the data


# --------------------------------------------------------------------------------------- the same result


def test_off_by_default_the_run_is_as_before(runs):
    metrics, run_dir = runs["plain"]
    assert metrics["batch_fit"] is None and OmegaConf.load(RunPaths(run_dir).run_config).batch.effective is None


def test_accumulation_reaches_e_and_the_weights_are_the_plain_runs(runs):
    (plain, plain_dir), (fit, fit_dir) = runs["plain"], runs["fit_small"]
    assert fit["batch_fit"]["micro_batch"] == 64 and fit["accumulate_grad_batches"] == 3
    assert fit["global_batch_size"] * fit["accumulate_grad_batches"] == fit["effective_batch_size"] == E
    assert fit["batch_fit"]["micro_batch"] * fit["batch_fit"]["bytes_per_sample"] <= 0.008 * 2**20
    assert fit["global_step"] == plain["global_step"] == 2 * 2  # 2 whole steps an epoch: the remainder unused
    assert relative_difference(weights(fit_dir), weights(plain_dir)) < 1e-5


def test_when_e_fits_whole_the_probe_leaves_the_maths_bit_identical(runs):
    (_, plain_dir), (fit, fit_dir) = runs["plain"], runs["fit_default"]
    assert (fit["batch_fit"]["micro_batch"], fit["accumulate_grad_batches"]) == (E, 1)
    assert torch.equal(weights(fit_dir), weights(plain_dir))


@pytest.mark.slow
def test_ddp_x2_picks_per_rank_and_ends_with_the_plain_runs_weights(runs, tmp_path):
    args = [*TINY, "trainer.devices=2", f"batch.effective={E}", SMALL_BUDGET, *QUIET, f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(
        [python(), "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=240
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = json.loads(RunPaths(tmp_path).metrics.read_text())
    fitted = metrics["batch_fit"]["micro_batch"]
    assert metrics["world_size"] == 2 and fitted * 2 * metrics["accumulate_grad_batches"] == E
    assert fitted * metrics["batch_fit"]["bytes_per_sample"] <= 0.008 * 2**20
    assert "batch       192 = micro-batch" in done.stdout
    assert relative_difference(weights(tmp_path), weights(runs["plain"][1])) < 1e-5


def test_an_epoch_holds_whole_optimizer_steps():
    loader = BatchLoader(torch.zeros(512, 1), torch.zeros(512, 1), 64, EpochShuffle(512, 0), accumulate=3)
    assert len(loader) == 6 and len(list(loader)) == 6  # not 8: the last two would make a step of 128 samples
    assert len(BatchLoader(torch.zeros(512, 1), torch.zeros(512, 1), 64, EpochShuffle(512, 0), drop_last=False)) == 8
    with pytest.raises(ConfigError, match=r"x trainer\.accumulate_grad_batches=9 = 576 samples an optimizer step"):
        check_shapes(64, 512, None, 8, accumulate=9)


# ------------------------------------------------------------- the stored config: resume, reuse, eval, sweeps


def test_the_stored_config_holds_the_fit_and_the_same_start_finds_it_done(runs, capsys):
    fit, run_dir = runs["fit_small"]
    stored = OmegaConf.load(RunPaths(run_dir).run_config)
    assert (stored.data.batch_size, stored.trainer.accumulate_grad_batches, stored.batch.effective) == (64, 3, E)
    again = train(compose_config(f"batch.effective={E}", SMALL_BUDGET, *QUIET), run_dir)
    assert "nothing to do" in capsys.readouterr().out and again == fit
    # Another E is another run: refused.
    with pytest.raises(ConfigError, match="holds a run of another config"):
        train(compose_config("batch.effective=128", SMALL_BUDGET, *QUIET), run_dir)


def test_interrupted_then_resumed_in_place_keeps_its_fit_and_equals_the_uninterrupted(runs, tmp_path, monkeypatch):
    calls = []
    draw = BatchLoader.next_batch  # a micro-batch (Lightning's per-batch hooks run once a window of steps)

    def stop_at_the_fourth_batch(self):
        calls.append(self)
        if len(calls) == 4:  # in the second optimizer step's accumulation of 3
            os.kill(os.getpid(), signal.SIGTERM)
        return draw(self)

    overrides = [f"batch.effective={E}", SMALL_BUDGET, *QUIET]
    with monkeypatch.context() as patch:
        patch.setattr(BatchLoader, "next_batch", stop_at_the_fourth_batch)
        with pytest.raises(Interrupted):
            train(compose_config(*overrides), tmp_path)
    interrupted = json.loads(RunPaths(tmp_path).metrics.read_text())
    assert (interrupted["status"], interrupted["global_step"]) == ("interrupted", 2)
    # The checkpoint's fit is kept (its data position counts micro-batches): the probe does not run again.
    with monkeypatch.context() as patch:
        patch.setattr(batch_fit, "measure", lambda *args: pytest.fail("a resumed run measured again"))
        resumed = train(compose_config(*overrides), tmp_path)
    assert resumed["status"] == "completed" and resumed["batch_fit"] == interrupted["batch_fit"]
    assert torch.equal(weights(tmp_path), weights(runs["fit_small"][1]))


def test_eval_scores_the_fitted_run_in_batches_of_its_micro_batch(runs):
    fit, run_dir = runs["fit_small"]
    ckpt = RunPaths(run_dir).last_checkpoint
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("eval", overrides=[f"ckpt_path={ckpt}"])
    result = evaluate(cfg, [f"ckpt_path={ckpt}"])
    assert result["data"]["batch_size"] == fit["global_batch_size"] == 64
    assert result["mse"] == pytest.approx(fit["val_mse"], rel=1e-5)


@pytest.mark.slow
def test_a_sweep_over_e_fits_each_job_and_results_csv_says_what_it_chose(tmp_path):
    done = cli("-m", *TINY, "batch.effective=128,256", SMALL_BUDGET, *QUIET, f"hydra.sweep.dir={tmp_path}", tiny=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {int(r["batch.effective"]): r for r in csv.DictReader((tmp_path / "results.csv").open())}
    for effective, row in rows.items():
        micro, accumulate = int(row["batch_fit.micro_batch"]), int(row["accumulate_grad_batches"])
        assert micro * accumulate == int(row["effective_batch_size"]) == effective
        assert micro * float(row["batch_fit.bytes_per_sample"]) <= 0.008 * 2**20
    assert set(rows) == {128, 256} and {int(r["batch_fit.micro_batch"]) for r in rows.values()} == {64}


# ----------------------------------------------------------------------------------------------- bad input


BAD = {
    "zero": (["batch.effective=0"], "batch.effective=0 is not allowed; allowed: null (off), or an integer >= 1"),
    "ranks cannot share it": (
        ["batch.effective=255", "trainer.devices=2"],
        "batch.effective=255 does not split over 2 ranks; allowed: a multiple of 2, e.g. 254 or 256",
    ),
    "larger than the data": (
        ["batch.effective=1024"],
        "batch.effective=1024 is larger than the training split (512 samples): no optimizer step would fit in an "
        "epoch; allowed: 1 to 512",
    ),
    "budget below one sample": (
        ["batch.effective=192", "batch.memory_mb=0.0001"],
        "batch.memory_mb=0.0001: a budget of 0.0001 MiB (batch.memory_mb) does not hold a training step of one "
        "sample, which needs 0.00",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_with_the_numbers_before_training(tmp_path, case):
    args, expected = BAD[case]
    with pytest.raises(ConfigError) as refused:
        train(compose_config(*args, *QUIET), tmp_path)
    assert str(refused.value).startswith(expected) and not RunPaths(tmp_path).metrics.exists()


def test_cli_a_budget_too_small_is_one_error_line_and_exit_2(tmp_path):
    args, expected = BAD["budget below one sample"]
    done = cli(*args, f"hydra.run.dir={tmp_path}")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and errors == [line for line in done.stderr.splitlines() if line.strip()][-1:]
    assert errors[0].startswith(f"error: {expected}") and "Traceback" not in done.stderr
    assert not RunPaths(tmp_path).run_config.exists()  # no run was started


# ------------------------------------------------------------------------------------ what the run says


def test_the_summary_says_what_was_chosen(runs):
    fit, run_dir = runs["fit_small"]
    [line] = [line for line in summary_lines(fit, run_dir) if line.startswith("batch")]
    assert line.startswith("batch       192 = micro-batch 64 x 3 accumulated x 1 rank (batch.effective: the largest")


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=pytest.mark.cuda)])
def test_out_of_memory_names_the_option_and_what_it_would_choose(accelerator, tmp_path, monkeypatch):
    def out_of_memory(self, batch, batch_idx):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Regressor, "training_step", out_of_memory)
    with pytest.raises(RunFailed) as err:  # on a GPU, measured with the data already moved there
        cfg = compose_config(f"trainer.accelerator={accelerator}", "trainer.accumulate_grad_batches=2", *QUIET)
        train(cfg, tmp_path)
    # The measured default budget (the CPU's memory, or the GPU's) holds the whole effective batch of 64 x 2.
    assert "or let the lab choose with batch.effective=128: measured now, it would train data.batch_size=128 " \
        "trainer.accumulate_grad_batches=1 (a micro-batch of 128 per rank" in str(err.value)  # fmt: skip


# --------------------------------------------------------------------------------------------------- a GPU


@pytest.mark.cuda
def test_on_a_gpu_the_fit_stays_within_free_memory_less_the_margin(tmp_path):
    metrics = train(compose_config("trainer.accelerator=gpu", "batch.effective=512", *QUIET), tmp_path)
    fitted = metrics["batch_fit"]
    free, total = torch.cuda.mem_get_info()
    assert fitted["budget_mb"] * 2**20 <= free + 0.05 * total and metrics["effective_batch_size"] == 512
    assert metrics["peak_memory_mb"] <= fitted["budget_mb"]


@pytest.mark.cuda
def test_on_a_gpu_under_a_memory_cap_the_fit_accumulates_and_matches_the_plain_run(tmp_path):
    # CUDA rounds every block up to 512 bytes: 100 features (about 424 bytes a sample) and 50 KiB. The data stays
    # on the host: kept on the GPU (data.on_device=auto), its 0.25 MiB alone would exceed the budget.
    wide = ["trainer.accelerator=gpu", "data.num_features=100", "data.on_device=false", *QUIET]
    plain = train(compose_config(*wide, f"data.batch_size={E}"), tmp_path / "plain")
    fit = train(compose_config(*wide, f"batch.effective={E}", "batch.memory_mb=0.05"), tmp_path / "fit")
    assert fit["accumulate_grad_batches"] > 1 and fit["effective_batch_size"] == plain["effective_batch_size"]
    assert relative_difference(weights(tmp_path / "fit"), weights(tmp_path / "plain")) < 1e-5


@pytest.mark.cuda
def test_on_a_gpu_out_of_memory_names_numbers_that_then_train(tmp_path):
    """Capped at 256 MiB, a global batch of 131,072 rows of 1000 features (500 MiB) runs out of memory; the message's
    data.batch_size and accumulation (measured under the cap) then train."""
    total = torch.cuda.get_device_properties(0).total_memory
    wide = ["trainer.accelerator=gpu", "data.num_samples=170000", "data.num_features=1000", "data.on_device=false"]
    wide += ["trainer.max_steps=2", "trainer.limit_val_batches=0", *QUIET]
    torch.cuda.set_per_process_memory_fraction(256 * 2**20 / total)
    try:
        with pytest.raises(RunFailed) as err:
            train(compose_config(*wide, "data.batch_size=131072"), tmp_path / "large")
        advice = re.search(
            r"it would train data\.batch_size=(\d+) trainer\.accumulate_grad_batches=(\d+)", str(err.value)
        )
        assert advice, str(err.value)
        batch, accumulate = int(advice[1]), int(advice[2])
        assert batch * accumulate == 131072 and accumulate > 1
        metrics = train(
            compose_config(*wide, f"data.batch_size={batch}", f"trainer.accumulate_grad_batches={accumulate}"),
            tmp_path / "advised",
        )
        assert metrics["status"] == "completed"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
