"""Faults of input: a bad setting, a bad data file, a missing value and a size that cannot fit in memory (data, a
data file, a model, data held on a GPU) are refused before any work, in one line naming the setting, the value and
what is allowed; nothing is written (docs/failures.md). In process, and through the CLI (exit 2). Every setting of
every group through the CLI: test_entry.py; bad checkpoints and files of eval and predict: test_eval_predict.py."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli, compose_config
from faults import errors

from experiments.commands.train import train
from experiments.config.errors import ConfigError

# ---------------------------------------------------------------------------------------------- bad input

# (override, the setting the message must name). Each fails in `train` before anything is built or written.
BAD_SETTINGS = [
    ("data.batch_size=0", "data.batch_size=0"),
    ("data.batch_size=abc", "data.batch_size=abc"),
    ("data.batch_size=5000", "data.batch_size=5000"),  # larger than the training split
    ("data.num_samples=-5", "data.num_samples=-5"),
    ("data.num_features=0", "data.num_features=0"),
    ("data.val_fraction=1.0", "data.val_fraction=1.0"),
    ("data.val_fraction=nan", "data.val_fraction=nan"),
    ("data.noise_std=-1", "data.noise_std=-1"),
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0"),
    ("trainer.devices=0", "trainer.devices=0"),
    ("trainer.devices=3", "data.batch_size=64"),  # 64 samples do not split over 3 ranks
    ("trainer.num_nodes=0", "trainer.num_nodes=0"),
    ("trainer.max_epochs=-2", "trainer.max_epochs=-2"),
    ("trainer.precision=8-bit", "trainer.precision=8-bit"),
    ("trainer.accelerator=quantum", "trainer.accelerator=quantum"),
    ("trainer.accelerator=tpu", "trainer.accelerator=tpu"),  # known to Lightning, absent here
    ("trainer.strategy=bogus", "trainer.strategy=bogus"),
    ("optimizer.lr=0", "optimizer.lr=0"),
    ("optimizer.lr=-0.1", "optimizer.lr=-0.1"),
    ("optimizer.lr=nan", "optimizer.lr=nan"),
    ("optimizer.lr=inf", "optimizer.lr=inf"),
    ("optimizer.momentum=1.5", "optimizer.momentum=1.5"),
    ("optimizer.weight_decay=-1", "optimizer.weight_decay=-1"),
    ("seed=-1", "seed=-1"),
    ("window_s=-0.1", "window_s=-0.1"),
    ("window_s=fast", "window_s=fast"),
    ("model.in_features=5", "model.in_features=5"),
    ("ckpt_path=/no/such.ckpt", "ckpt_path=/no/such.ckpt"),
    ("ckpt_path=last", "ckpt_path=last"),  # no run beside this one has saved a checkpoint
]
if not torch.cuda.is_available():
    BAD_SETTINGS.append(("trainer.accelerator=gpu", "trainer.accelerator=gpu"))

# (file content or None for no file, extra override, what the message must name)
BAD_FILES = [
    (None, None, "no such file"),
    ("a,b\n1,x\n", None, "'x' is not a number"),
    ("a,b\n1,\n", None, "missing value"),
    ("a,b\n1,2\n3,4,5\n", None, "line 3 has 3 fields"),
    ("a,b\n", None, "no data rows"),
    ("a,b\n1,2\n", "data.target=price", "data.target=price"),
    # 3 rows: 2 for training (val_fraction 0.2), found once the file is read (experiments.config.checks.check_shapes)
    ("a,b\n1,2\n3,4\n5,6\n", "data.batch_size=64", "data.batch_size=64 is larger than the training split"),
]


def assert_fails_before_any_work(overrides: list[str], run_dir: Path, expected: str) -> str:
    with pytest.raises(ConfigError) as err:
        train(compose_config(*overrides), run_dir)
    message = str(err.value)
    assert expected in message and "\n" not in message
    assert not run_dir.exists()  # no checkpoint, log or metrics: it stopped before building the trainer
    return message


@pytest.mark.parametrize(("override", "expected"), BAD_SETTINGS)
def test_bad_setting_is_refused_before_any_work(tmp_path, override, expected):
    message = assert_fails_before_any_work([override], tmp_path / "run", expected)
    assert "allowed" in message


@pytest.mark.parametrize(("content", "override", "expected"), BAD_FILES)
def test_bad_data_file_is_refused_before_any_work(tmp_path, content, override, expected):
    path = tmp_path / "data.csv"
    if content is not None:
        path.write_text(content)
    overrides = ["data=file", f"data.path={path}", *([override] if override else [])]
    message = assert_fails_before_any_work(overrides, tmp_path / "run", expected)
    assert "data." in message


def test_a_required_setting_without_a_value_is_named(tmp_path):
    assert_fails_before_any_work(["data=file"], tmp_path / "run", "data.path is required")


def test_cli_bad_input_exits_2_with_one_line_and_no_traceback(tmp_path):
    # Every group through the CLI: tests/test_entry.py.
    result = cli("data.batch_size=0", f"hydra.run.dir={tmp_path / 'run'}", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: data.batch_size=0")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "metrics.json").exists()


# ------------------------------------------------------------------------------------ sizes that cannot fit


def test_synthetic_data_larger_than_memory_is_refused_before_it_is_made(tmp_path):
    run_dir = tmp_path / "run"
    done = cli("data.num_samples=200000000", "data.num_features=1000", f"hydra.run.dir={run_dir}")
    assert done.returncode == 2
    [error] = errors(done.stderr)
    assert "data.num_samples=200000000 data.num_features=1000: the synthetic data needs at least 1,604,800," in error
    assert "bytes (1494.6 GiB) of host memory" in error and " are available; allowed: " in error
    suggested = int(error.rsplit("data.num_samples=", 1)[1].split()[0])
    assert 0 < suggested < 200_000_000
    assert not run_dir.exists()


def test_a_data_file_larger_than_memory_is_refused_before_it_is_read(tmp_path):
    # A real .npy of 800 GB, sparse on disk: its header says its size, and the check reads nothing else.
    path, run_dir = tmp_path / "huge.npy", tmp_path / "run"
    with path.open("wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (200_000_000, 1001)})
        f.truncate(f.tell() + 200_000_000 * 1001 * 4)
    done = cli("data=file", f"data.path={path}", f"hydra.run.dir={run_dir}")
    assert done.returncode == 2
    [error] = errors(done.stderr)
    assert f"data.path={path}: reading it needs at least 2,402,400,000,000 bytes" in error
    assert "a 200000000x1001 float32 array" in error and " are available; allowed: a smaller file" in error
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_model_larger_than_memory_is_refused_before_it_is_built(tmp_path):
    path, run_dir = tmp_path / "small.csv", tmp_path / "run"
    path.write_text("a,b,c,y\n" + "".join(f"{i},{i % 3},{i % 5},{i}\n" for i in range(200)))
    done = cli("data=file", f"data.path={path}", "data.batch_size=64", "model.out_features=2000000000",
               f"hydra.run.dir={run_dir}")  # fmt: skip
    assert done.returncode == 2
    [error] = errors(done.stderr)
    assert "model.out_features=2000000000 with 3 input features: the model needs at least 64,000,000,000" in error
    assert not run_dir.exists()


def test_the_csv_estimate_is_a_lower_bound_of_what_reading_takes(tmp_path):
    import tracemalloc

    from experiments.config.sizes import file_needs
    from experiments.data.files import read_table

    path = tmp_path / "table.csv"
    values = np.random.default_rng(0).normal(size=(20_000, 11))
    lines = [",".join(f"c{i}" for i in range(11)), *(",".join(f"{v:.6f}" for v in row) for row in values)]
    path.write_text("\n".join(lines))
    needs, _ = file_needs(path)
    tracemalloc.start()
    table = read_table(path)
    table.numbers(list(range(11)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert 0.5 * peak < needs <= peak


@pytest.mark.cuda
def test_data_held_on_a_gpu_is_checked_against_its_free_memory(tmp_path):
    free = torch.cuda.mem_get_info()[0]
    samples = int(free / (4 * 101) * 1.2) // 1000 * 1000  # 20% more float32 samples of 100 features than free
    if samples * 101 * 4 * 2 > 0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
        pytest.skip("the host has too little memory to make data larger than the GPU's")
    done = cli("trainer.accelerator=gpu", "data.on_device=true", f"data.num_samples={samples}", "data.num_features=100",
               f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    assert done.returncode == 2
    assert "data.on_device=true: the data needs" in errors(done.stderr)[0]
