"""eval.py and predict.py: a checkpoint scored and applied, every checkpoint and data file checked first."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, cli, compose_config, python
from hydra import compose, initialize_config_dir

from experiments.commands.entry import CONFIG_DIR
from experiments.commands.evaluate import evaluate
from experiments.commands.predict import predict, write_predictions
from experiments.commands.train import train
from experiments.config.errors import ConfigError
from experiments.training.checkpoint import RECORD_KEY, load_checkpoint

COLUMNS = ["rooms", "price", "age", "area"]  # the target in the middle: features are matched by name


def write_csv(path: Path, header: list[str], rows) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One run through the CLI on 200 rows of a CSV; 40 more rows of the same source are kept apart."""
    root = tmp_path_factory.mktemp("trained")
    rng = np.random.default_rng(0)
    x = rng.normal(loc=[10, -5, 100], scale=[1, 2, 30], size=(240, 3))
    price = x @ np.array([1.0, -2.0, 0.05]) + 3 + 0.1 * rng.normal(size=240)
    table = np.column_stack([x[:, 0], price, x[:, 1], x[:, 2]])
    train_csv = write_csv(root / "train.csv", COLUMNS, table[:200])
    other_csv = write_csv(root / "other.csv", COLUMNS, table[200:])
    run_dir = root / "run"
    result = cli(
        "data=file", f"data.path={train_csv}", "data.target=price", "data.batch_size=32",
        "trainer.max_epochs=5", "logger=none", f"hydra.run.dir={run_dir}", timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return {
        "root": root, "run_dir": run_dir, "ckpt": run_dir / "checkpoints" / "last.ckpt", "x": x, "price": price,
        "train_csv": train_csv, "other_csv": other_csv,
    }  # fmt: skip


def run_entry(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    command = [python(), script, "trainer.enable_progress_bar=false", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def compose_entry(name: str, *overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(name, overrides=list(overrides))


def evaluate_in_process(*overrides: str) -> dict:
    return evaluate(compose_entry("eval", *overrides), list(overrides))


# ------------------------------------------------------------------------------------------------ eval.py


def test_eval_reproduces_the_runs_validation_figures(trained, tmp_path):
    out = tmp_path / "eval"
    result = run_entry("eval.py", f"ckpt_path={trained['ckpt']}", f"hydra.run.dir={out}")
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads((out / "eval.json").read_text())
    metrics = json.loads((trained["run_dir"] / "metrics.json").read_text())
    assert figures["scored"] == "validation split" and figures["data"]["rows"] == 40
    assert figures["checkpoint"] == str(trained["ckpt"].resolve())
    for mine, run in [("mse", "val_mse"), ("mae", "val_mae"), ("r2", "val_r2"), ("optimal_mse", "optimal_val_mse")]:
        assert figures[mine] == pytest.approx(metrics[run], rel=1e-5), mine
    assert metrics["val_mse"] > 1.5 * metrics["optimal_val_mse"]  # 5 epochs: not at the optimum, so it is the model
    assert {p.name for p in (out / ".hydra").iterdir()} == {"config.yaml", "hydra.yaml", "overrides.yaml"}
    assert "mse" in result.stdout and str(out / "eval.json") in result.stdout


@pytest.mark.parametrize("script", ["eval.py", "predict.py"])
def test_eval_and_predict_print_lightnings_lines_once_without_chatter(trained, tmp_path, script):
    # The real interpreter, not the tests' pre-imported one: there Lightning is imported before Hydra sets up
    # logging, the order in which each line shows once anyway.
    args = [f"ckpt_path={trained['ckpt']}", f"hydra.run.dir={tmp_path / 'out'}"]
    if script == "predict.py":
        args.append(f"data.path={trained['other_csv']}")
    command = [sys.executable, script, "trainer.enable_progress_bar=false", *args]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = result.stdout + result.stderr
    assert printed.count("GPU available: False, used: False") == 1, printed  # which accelerator, once
    for chatter in ("INFO: ", "💡 Tip", "litlogger", "TPU available", "LeafSpec"):
        assert chatter not in printed, printed
    if script == "eval.py":  # the two-line summary of docs/using-a-model.md, then the file
        lines = result.stdout.strip().splitlines()[-3:]
        assert "validation split" in lines[0] and lines[1].startswith("mse ") and lines[2].endswith("eval.json")


def test_eval_scores_every_row_of_another_file(trained):
    # data.target is not repeated: the checkpoint knows the target's name.
    figures = evaluate_in_process(f"ckpt_path={trained['ckpt']}", "data=file", f"data.path={trained['other_csv']}")
    assert figures["scored"] == "every row" and figures["data"]["rows"] == 40
    module = load_checkpoint(trained["ckpt"]).module
    pred = module.predict_raw(torch.tensor(trained["x"][200:], dtype=torch.float32))
    expected = torch.mean((pred[:, 0] - torch.tensor(trained["price"][200:], dtype=torch.float32)) ** 2).item()
    assert figures["mse"] == pytest.approx(expected, rel=1e-5)
    assert 0 < figures["optimal_mse"] < figures["mse"]  # the file's own least-squares fit does better


def test_eval_of_a_checkpoint_without_its_record_reads_the_run_dir(trained, tmp_path):
    """A checkpoint written before checkpoints carried the run's config: `.hydra/config.yaml` beside it."""
    raw = torch.load(trained["ckpt"], weights_only=True)
    del raw[RECORD_KEY]
    old = tmp_path / "old" / "checkpoints" / "last.ckpt"
    old.parent.mkdir(parents=True)
    torch.save(raw, old)
    with pytest.raises(ConfigError, match="no .hydra/config.yaml beside"):
        load_checkpoint(old)
    (tmp_path / "old" / ".hydra").mkdir()
    (tmp_path / "old" / ".hydra" / "config.yaml").write_text((trained["run_dir"] / ".hydra/config.yaml").read_text())
    figures = evaluate_in_process(f"ckpt_path={old}")
    metrics = json.loads((trained["run_dir"] / "metrics.json").read_text())
    assert figures["mse"] == pytest.approx(metrics["val_mse"], rel=1e-5)


# --------------------------------------------------------------------------------------------- predict.py


def test_predict_matches_columns_by_name_and_carries_the_others(trained, tmp_path):
    x = trained["x"][:25]
    # Other column order than at training, an id string and the target carried through untouched.
    rows = [[f"house-{i}", c, a, p, b] for i, ((a, b, c), p) in enumerate(zip(x, trained["price"], strict=False))]
    header = ["id", "area", "rooms", "price", "age"]
    inputs = write_csv(tmp_path / "new.csv", header, rows)
    out = tmp_path / "predict"
    result = run_entry("predict.py", f"ckpt_path={trained['ckpt']}", f"data.path={inputs}", f"hydra.run.dir={out}")
    assert result.returncode == 0, result.stderr[-2000:]
    with (out / "predictions.csv").open() as f:
        written = list(csv.reader(f))
    assert written[0] == [*header, "prediction"]
    with inputs.open() as f:
        assert [row[:-1] for row in written[1:]] == list(csv.reader(f))[1:]  # input order, fields unchanged
    module = load_checkpoint(trained["ckpt"]).module
    expected = module.predict_raw(torch.tensor(x, dtype=torch.float32))[:, 0]
    got = torch.tensor([float(row[-1]) for row in written[1:]])
    torch.testing.assert_close(got, expected)
    assert (out / ".hydra" / "config.yaml").is_file()


def test_predict_npy_in_batches(trained, tmp_path):
    x = trained["x"][:50]
    np.save(tmp_path / "new.npy", x)
    cfg = compose_entry("predict", f"ckpt_path={trained['ckpt']}", f"data.path={tmp_path / 'new.npy'}")
    cfg.data.batch_size = 16  # 4 batches, the last one partial
    table, predictions, *_ = predict(cfg)
    module = load_checkpoint(trained["ckpt"]).module
    expected = module.predict_raw(torch.tensor(x, dtype=torch.float32)).numpy()
    np.testing.assert_allclose(predictions, expected, rtol=1e-6)
    written = np.load(write_predictions(tmp_path, table, predictions))
    assert written.shape == (50, 4) and written.dtype == np.float64
    np.testing.assert_array_equal(written[:, :3], x)


# ------------------------------------------------------------------------------------------ bad checkpoints


def other_model(path: Path) -> None:
    torch.save({"pytorch-lightning_version": "2.6.0", "state_dict": {"layer.weight": torch.zeros(2, 32)}}, path)


def another_shape(path: Path, source: Path) -> None:
    raw = torch.load(source, weights_only=True)
    raw["state_dict"]["net.weight"] = torch.zeros(2, 3)  # two outputs, where the run's config says one
    torch.save(raw, path)


class Pickled:
    pass


# (name, how to make the file from the run's checkpoint, what the message says)
BAD_CHECKPOINTS = [
    ("missing", lambda p, c: None, "no such file"),
    ("directory", lambda p, c: p.mkdir(), "is a directory"),
    ("empty", lambda p, c: p.write_bytes(b""), "empty file"),
    ("truncated", lambda p, c: p.write_bytes(c.read_bytes()[: c.stat().st_size // 2]), "truncated or damaged"),
    ("text", lambda p, c: p.write_text("rooms,price\n1,2\n"), "not a checkpoint"),
    ("tensor", lambda p, c: torch.save(torch.zeros(3), p), "not a Lightning checkpoint"),
    ("pickle", lambda p, c: p.write_bytes(__import__("pickle").dumps(Pickled())), "a pickle of objects other than"),
    ("other model", lambda p, c: other_model(p), "checkpoint of another model"),
    ("other shape", another_shape, "its weights do not fit the model of its config"),
]


@pytest.mark.parametrize(("make", "problem"), [b[1:] for b in BAD_CHECKPOINTS], ids=[b[0] for b in BAD_CHECKPOINTS])
def test_bad_checkpoint_is_refused_in_one_line(trained, tmp_path, make, problem):
    path = tmp_path / "bad.ckpt"
    make(path, trained["ckpt"])
    with pytest.raises(ConfigError, match=problem) as err:
        load_checkpoint(path)
    message = str(err.value)
    assert message.startswith(f"ckpt_path={path}: ") and "allowed:" in message and "\n" not in message


# ------------------------------------------------------------------------------------------------- bad data


# (file name, content, the entry, what the message says). Feature order of the run: rooms, age, area.
BAD_FILES = [
    ("big.csv", "rooms,age,area\n1,2,3\n4,1e39,6\n", "predict", "line 3, column 'age': 1e39 does not fit in float32"),
    ("nan.csv", "rooms,age,area\n1,2,nan\n", "predict", "line 2, column 'area': nan is not a finite number"),
    ("big.npy", np.array([[1.0, 2, 3], [4, 5, -1e39]]), "predict", r"row 1, column 2: -1e\+39 does not fit"),
    ("header.csv", "rooms,age,area\n", "predict", "no data rows"),
    ("rows.npy", np.zeros((0, 3)), "predict", "no data rows"),
    ("missing.csv", "rooms,area,price\n1,2,3\n", "predict", "no column 'age'"),
    ("width.npy", np.zeros((4, 5)), "predict", "has 5 columns and the model takes 3"),
    ("taken.csv", "rooms,age,area,prediction\n1,2,3,4\n", "predict", "already has a column 'prediction'"),
    ("big.csv", "rooms,price,age,area\n1,2,3,4\n1,2,3,4\n1,2,3,4e40\n", "eval", "line 4, column 'area': 4e40"),
    ("missing.csv", "rooms,price,area\n1,2,3\n4,5,6\n", "eval", "no column 'age'"),
]


@pytest.mark.parametrize(("name", "content", "entry", "problem"), BAD_FILES, ids=[f"{b[2]}-{b[0]}" for b in BAD_FILES])
def test_bad_data_file_is_refused_in_one_line(trained, tmp_path, name, content, entry, problem):
    path = tmp_path / name
    np.save(path, content) if isinstance(content, np.ndarray) else path.write_text(content)
    with pytest.raises(ConfigError, match=problem) as err:
        if entry == "predict":
            predict(compose_entry("predict", f"ckpt_path={trained['ckpt']}", f"data.path={path}"))
        else:
            evaluate_in_process(f"ckpt_path={trained['ckpt']}", f"data.path={path}")
    assert str(err.value).startswith(f"data.path={path}: ") and "\n" not in str(err.value)


def test_training_on_a_value_beyond_float32_names_it(tmp_path):
    path = tmp_path / "big.csv"
    path.write_text("a,b,y\n1,2,3\n1,2,3\n2,1e39,3\n")
    with pytest.raises(ConfigError, match="line 4, column 'b': 1e39 does not fit in float32"):
        train(compose_config("data=file", f"data.path={path}", "data.batch_size=1"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_resume_with_a_checkpoint_of_another_shape_is_refused(trained, tmp_path):
    # The run's checkpoint takes 3 features; TINY's synthetic data has 8.
    with pytest.raises(ConfigError, match=r"takes 3 features and the data has 8"):
        train(compose_config(f"ckpt_path={trained['ckpt']}"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------- the commands


@pytest.mark.parametrize(
    ("script", "args", "named"),
    [
        ("eval.py", ["ckpt_path={truncated}"], "ckpt_path="),
        ("predict.py", ["ckpt_path={ckpt}", "data.path={big}"], "data.path="),
        ("predict.py", ["data.path={big}"], "ckpt_path is required"),
        ("train.py", ["ckpt_path={truncated}", "trainer.max_epochs=1"], "ckpt_path="),
    ],
    ids=["eval-truncated-checkpoint", "predict-beyond-float32", "predict-no-checkpoint", "train-resume-truncated"],
)
@pytest.mark.slow
def test_cli_bad_input_exits_2_with_one_line_and_writes_nothing(trained, tmp_path, script, args, named):
    truncated = tmp_path / "half.ckpt"
    truncated.write_bytes(trained["ckpt"].read_bytes()[:1000])
    big = tmp_path / "big.csv"
    big.write_text("rooms,age,area\n1,2,1e39\n")
    paths = {"truncated": truncated, "ckpt": trained["ckpt"], "big": big}
    out = tmp_path / "out" / "run"
    result = run_entry(script, *(a.format(**paths) for a in args), f"hydra.run.dir={out}")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: {named}") and "Traceback" not in result.stderr
    if script != "train.py":  # train.py's run dir is issue 13's (Hydra writes .hydra/ before train runs)
        assert not out.exists()


@pytest.mark.cuda
def test_eval_and_predict_on_a_gpu(trained, tmp_path):
    figures = evaluate_in_process(f"ckpt_path={trained['ckpt']}", "trainer.accelerator=gpu")
    metrics = json.loads((trained["run_dir"] / "metrics.json").read_text())
    assert figures["device"].startswith("cuda") and figures["mse"] == pytest.approx(metrics["val_mse"], rel=1e-4)
    np.save(tmp_path / "new.npy", trained["x"][:10])
    cfg = compose_entry(
        "predict", f"ckpt_path={trained['ckpt']}", f"data.path={tmp_path / 'new.npy'}", "trainer.accelerator=gpu"
    )
    _, predictions, device, _ = predict(cfg)
    expected = load_checkpoint(trained["ckpt"]).module.predict_raw(torch.tensor(trained["x"][:10], dtype=torch.float32))
    assert device.startswith("cuda")
    np.testing.assert_allclose(predictions, expected.numpy(), rtol=1e-5, atol=1e-5)
