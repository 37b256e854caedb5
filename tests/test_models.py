"""The MLP family (model=mlp) through every path of the lab, the teacher problem (data=teacher) and the machine's
limit (model_tflops, peak_tflops, mfu).

The DDP runs go through the real CLI in a subprocess, started together; the one-device runs meanwhile in this
process. One module-scoped set of runs serves several tests.
"""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, cli, compose_config, final_weights, python
from hydra.utils import instantiate
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.plugins.hparams import plugin_data_pb2
from test_strategies import start, wait

from experiments.commands.train import train
from experiments.config.checks import check_config
from experiments.config.errors import ConfigError
from experiments.data.loader import BatchLoader
from experiments.models.mlp import MLP, shape, train_flops_per_sample
from experiments.run.signals import Interrupted
from experiments.training import mfu
from experiments.training.checkpoint import load_checkpoint

MLP_ARGS = ["model=mlp", "model.hidden=[16,12]", "model.activation=gelu"]
WINDOWED = ["data.num_samples=2560", "data.batch_size=64"]  # 32 steps an epoch, 2 epochs
QUIET = ["logger=none"]


def net_weights(run_dir: Path) -> torch.Tensor:
    state = final_weights(run_dir)
    return torch.cat([v.flatten().double() for k, v in sorted(state.items()) if k.startswith("net.")])


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("models")
    procs, dirs = [], {}
    for name, overrides in {
        "ddp_64_w1": ["trainer.devices=2", *WINDOWED, "trainer.log_every_n_steps=1"],
        "ddp_64_w7": ["trainer.devices=2", *WINDOWED, "trainer.log_every_n_steps=7"],
        "ddp_16x4_w3": [
            "trainer.devices=2", *WINDOWED, "data.batch_size=16", "trainer.accumulate_grad_batches=4",
            "trainer.log_every_n_steps=3",
        ],
    }.items():  # fmt: skip
        dirs[name] = tmp / name
        command = [python(), str(ROOT / "train.py"), *TINY, *MLP_ARGS, *overrides, f"hydra.run.dir={dirs[name]}"]
        procs.append(start(command, ROOT))
    for name, overrides in {
        "single_64": [*WINDOWED, "trainer.log_every_n_steps=1"],
        "single_64_w50": [*WINDOWED, "trainer.log_every_n_steps=50"],
        "single_16x4": [*WINDOWED, "data.batch_size=16", "trainer.accumulate_grad_batches=4"],
        "single_32": [*WINDOWED, "data.batch_size=32"],  # other maths: shows that the tolerance can tell
    }.items():
        dirs[name] = tmp / name
        train(compose_config(*MLP_ARGS, *overrides, *QUIET), dirs[name])
    wait(*procs)
    return dirs


@pytest.mark.parametrize("name", ["ddp_64_w1", "ddp_64_w7", "single_64_w50"])
@pytest.mark.slow
def test_ddp_and_windows_of_steps_equal_one_device(runs, name):
    assert relative_difference(net_weights(runs[name]), net_weights(runs["single_64"])) < 1e-5


@pytest.mark.parametrize("name", ["single_16x4", "ddp_16x4_w3"])
@pytest.mark.slow
def test_accumulation_equals_the_large_batch(runs, name):
    assert relative_difference(net_weights(runs[name]), net_weights(runs["single_64"])) < 1e-5


@pytest.mark.slow
def test_a_different_batch_gives_different_weights(runs):
    assert relative_difference(net_weights(runs["single_32"]), net_weights(runs["single_64"])) > 1e-3


@pytest.mark.slow
def test_the_checkpoint_carries_the_mlps_shape_and_eval_needs_nothing_else(runs, tmp_path):
    checkpoint = load_checkpoint(runs["single_64"] / "checkpoints" / "last.ckpt")
    assert list(checkpoint.config.model.hidden) == [16, 12] and checkpoint.config.model.activation == "gelu"
    assert isinstance(checkpoint.module.net, MLP)
    out = tmp_path / "eval"
    done = subprocess.run(
        [python(), "eval.py", f"ckpt_path={runs['single_64'] / 'checkpoints' / 'last.ckpt'}", f"hydra.run.dir={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    scored = json.loads((out / "eval.json").read_text())
    ran = json.loads((runs["single_64"] / "metrics.json").read_text())
    assert scored["mse"] == pytest.approx(ran["val_mse"], rel=1e-5)


@pytest.mark.slow
def test_predict_from_the_checkpoint_alone_and_a_file_of_other_columns_is_one_line(runs, tmp_path):
    ckpt = runs["single_64"] / "checkpoints" / "last.ckpt"
    x = torch.randn(5, 8)
    np_path = tmp_path / "x.npy"
    import numpy as np

    np.save(np_path, x.numpy())
    out = tmp_path / "predict"
    done = subprocess.run([python(), "predict.py", f"ckpt_path={ckpt}", f"data.path={np_path}", f"hydra.run.dir={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    module = load_checkpoint(ckpt).module
    written = sorted(out.glob("*.csv")) + sorted(out.glob("*.npy"))
    assert written, list(out.iterdir())
    wrong = tmp_path / "wrong.npy"
    np.save(wrong, torch.randn(5, 3).numpy())
    refused = subprocess.run([python(), "predict.py", f"ckpt_path={ckpt}", f"data.path={wrong}",
                              f"hydra.run.dir={tmp_path / 'refused'}"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
    assert refused.returncode == 2
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("error: ") and "takes 8 features" in line, line
    assert not (tmp_path / "refused").exists()
    assert module.predict_raw(x).shape == (5, 1)


def test_interrupted_then_resumed_equals_the_uninterrupted_bit_for_bit(tmp_path, monkeypatch):
    overrides = [*MLP_ARGS, *QUIET]
    whole = tmp_path / "whole"
    train(compose_config(*overrides), whole)
    calls = []
    draw = BatchLoader.next_batch

    def stop_at_the_fifth_batch(self):
        calls.append(self)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return draw(self)

    cut = tmp_path / "cut"
    with monkeypatch.context() as patch:
        patch.setattr(BatchLoader, "next_batch", stop_at_the_fifth_batch)
        with pytest.raises(Interrupted):
            train(compose_config(*overrides), cut)
    assert json.loads((cut / "metrics.json").read_text())["status"] == "interrupted"
    resumed = train(compose_config(*overrides), cut)
    assert resumed["status"] == "completed"
    a, b = final_weights(cut), final_weights(whole)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bf16_mixed_on_the_cpu_trains_the_mlp(run_in_process):
    metrics, _ = run_in_process(*MLP_ARGS, *QUIET, "trainer.precision=bf16-mixed")
    assert metrics["status"] == "completed" and metrics["precision"] == "bf16-mixed"
    assert metrics["val_mse"] < 1.0  # the targets' variance is about 1: it learned


@pytest.mark.slow
def test_compile_trains_the_same_maths_as_eager(tmp_path):
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    train(compose_config(*MLP_ARGS, *QUIET), eager)
    metrics = train(compose_config(*MLP_ARGS, *QUIET, "compile=true"), compiled)
    assert metrics["status"] == "completed"
    assert relative_difference(net_weights(compiled), net_weights(eager)) < 1e-4
    assert final_weights(compiled).keys() == final_weights(eager).keys()  # the checkpoint is the net's own


@pytest.mark.slow
def test_a_sweep_over_shapes_records_them_in_results_csv_and_the_report(tmp_path):
    sweep = tmp_path / "sweep"
    done = cli("model=mlp", "model.hidden=[8],[16,16]", "logger=tensorboard", f"hydra.sweep.dir={sweep}", "--multirun")
    assert done.returncode == 0, done.stderr[-3000:]
    import csv

    rows = list(csv.DictReader((sweep / "results.csv").open()))
    assert [r["model.hidden"] for r in rows] == ["[8]", "[16,16]"]
    assert [int(r["model_params"]) for r in rows] == [8 * 8 + 8 + 8 + 1, 8 * 16 + 16 + 16 * 16 + 16 + 16 + 1]
    assert all(float(r["mfu"]) > 0 for r in rows)
    report = subprocess.run([python(), "scripts/report.py", str(sweep)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert report.returncode == 0, report.stderr[-2000:]
    # TensorBoard's HPARAMS row of each job: the model's width and depth as columns
    for num, (width, depth) in enumerate([(8, 1), (16, 2)]):
        columns = hparams_row(sweep / str(num))
        assert (columns["model"], columns["width"], columns["depth"]) == ("mlp", width, depth)


def hparams_row(run_dir: Path) -> dict:
    for event_file in run_dir.rglob("events.out.tfevents.*"):
        for event in EventFileLoader(str(event_file)).Load():
            for value in event.summary.value:
                if value.tag == "_hparams_/session_start_info":
                    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    hparams = data.session_start_info.hparams
                    return {k: v.number_value if v.HasField("number_value") else v.string_value
                            for k, v in hparams.items()}  # fmt: skip
    raise AssertionError(f"no HPARAMS row under {run_dir}")


def test_the_linear_stays_the_default_and_its_row_says_so(tmp_path):
    cfg = compose_config("logger=tensorboard")
    assert cfg.model._target_ == "torch.nn.Linear" and cfg.compile is False
    train(cfg, tmp_path)
    columns = hparams_row(tmp_path)
    assert (columns["model"], columns["width"], columns["depth"]) == ("linear", 0, 0)


# ------------------------------------------------------------------------------------------- shapes and FLOPs


def test_the_mlp_is_the_layers_its_config_names():
    net = MLP(10, 2, hidden=[32, 16], activation="relu")
    assert [type(m).__name__ for m in net] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert [(m.in_features, m.out_features) for m in net if isinstance(m, torch.nn.Linear)] == [(10, 32), (32, 16),
                                                                                               (16, 2)]  # fmt: skip
    assert shape(net) == {"depth": 2, "width": 32, "params": 10 * 32 + 32 + 32 * 16 + 16 + 16 * 2 + 2}
    assert shape(torch.nn.Linear(10, 1)) == {"depth": 0, "width": 0, "params": 11}


def test_flops_are_counted_from_the_linear_layers_whatever_the_class():
    class Wrapped(torch.nn.Module):  # not an MLP, not a Sequential: Linear layers inside a module of its own
        def __init__(self):
            super().__init__()
            self.body = torch.nn.ModuleList([torch.nn.Linear(10, 20), torch.nn.Linear(20, 1)])
            self.scale = torch.nn.Parameter(torch.ones(1))  # not a Linear's: no matmul FLOPs

    assert train_flops_per_sample(Wrapped()) == 6 * (10 * 20 + 20 + 20 + 1)
    assert train_flops_per_sample(torch.nn.Linear(1000, 1)) == 6 * 1001


def test_metrics_hold_the_models_flops_against_the_measured_peak(run_in_process, monkeypatch, tmp_path):
    monkeypatch.setenv("GPU_LAB_CACHE", str(tmp_path / "cache"))
    metrics, _ = run_in_process(*MLP_ARGS, *QUIET)
    params = 8 * 16 + 16 + 16 * 12 + 12 + 12 + 1
    assert metrics["model_params"] == params
    assert metrics["model_tflops"] == pytest.approx(6 * params * metrics["samples_per_sec"] / 1e12)
    assert metrics["mfu"] == pytest.approx(metrics["model_tflops"] / metrics["peak_tflops"])
    cached = json.loads((tmp_path / "cache" / "matmul_rate.json").read_text())
    (entry,) = cached.values()
    assert entry["tflops"] == metrics["peak_tflops"] and "float32" in next(iter(cached))
    # Measured once a machine: the next run reads it (as long as the machine is not quieter than it was then)
    monkeypatch.setattr(mfu, "measure_matmul_tflops", lambda *a: pytest.fail("measured again"))
    monkeypatch.setattr(os, "getloadavg", lambda: (entry["load"], 0.0, 0.0))
    again, _ = run_in_process(*MLP_ARGS, *QUIET, run_dir=tmp_path / "again")
    assert again["peak_tflops"] == metrics["peak_tflops"]


def test_a_peak_measured_on_a_busier_machine_is_measured_again_and_the_higher_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("GPU_LAB_CACHE", str(tmp_path))
    rates = iter([1.0, 3.0, 2.0])
    monkeypatch.setattr(mfu, "measure_matmul_tflops", lambda *a: next(rates))
    cpu = torch.device("cpu")
    for load, expected in [(9.0, 1.0), (9.5, 1.0), (2.0, 3.0), (0.5, 3.0)]:
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, 0.0, 0.0))
        assert mfu.peak_tflops(cpu, "32-true") == expected


def test_the_matmul_rate_is_measured_within_a_few_seconds():
    import time

    start = time.perf_counter()
    rate = mfu.measure_matmul_tflops(torch.device("cpu"), torch.float32)
    assert rate > 0 and time.perf_counter() - start < 2 * mfu.BUDGET_S


# ------------------------------------------------------------------------------------------- the teacher


def test_the_teachers_own_mse_is_the_optimum_and_a_copy_of_it_reaches_it(tmp_path):
    cfg = compose_config("data=teacher", "data.num_samples=2000", "data.num_features=8",
                         "data.teacher_hidden=[16,16]", "data.noise_std=0.1")  # fmt: skip
    data = instantiate(cfg.data)
    data.setup("fit")
    assert data.optimum is None
    assert data.optimal_val_mse == pytest.approx(0.01, rel=0.15)  # the noise's variance
    assert data.y_train.std().item() == pytest.approx(1.0, rel=0.15)  # unit-variance signal, small noise
    student = MLP(8, 1, hidden=[16, 16], activation="gelu")
    student.load_state_dict(data.teacher.state_dict())
    with torch.no_grad():
        mse = torch.mean((student(data.x_val).double() - data.y_val.double()) ** 2).item()
    assert mse == pytest.approx(data.optimal_val_mse, rel=1e-6)
    # Same seed, same teacher and data; another seed, another
    again = instantiate(cfg.data)
    again.setup("fit")
    assert torch.equal(again.y_train, data.y_train)


def test_a_linear_model_on_teacher_data_has_no_optimum_distance(run_in_process):
    metrics, _ = run_in_process("data=teacher", "data.num_samples=640", "data.num_features=8", *QUIET)
    assert metrics["status"] == "completed" and metrics["optimum_distance"] is None
    assert metrics["optimal_val_mse"] < metrics["val_mse"]  # a Linear cannot fit the teacher
    assert metrics["target_mse"] == pytest.approx(1.02 * metrics["optimal_val_mse"])


def test_a_linear_without_a_bias_completes_with_no_optimum_distance(run_in_process):
    metrics, _ = run_in_process("model.bias=false", *QUIET)  # the optimum is a fit with an intercept
    assert metrics["status"] == "completed" and metrics["optimum_distance"] is None
    assert metrics["val_mse"] >= metrics["optimal_val_mse"]


def test_the_mlp_on_linear_data_keeps_the_exact_optimum_and_no_distance(run_in_process):
    metrics, _ = run_in_process(*MLP_ARGS, *QUIET)
    assert metrics["optimum_distance"] is None and metrics["optimal_val_mse"] > 0


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("override", "allowed"),
    [
        ("model.hidden=[]", "a list of one or more integers >= 1"),
        ("model.hidden=[0,4]", "a list of one or more integers >= 1"),
        ("model.hidden=[-8]", "a list of one or more integers >= 1"),
        ("model.hidden=[1.5]", "a list of one or more integers >= 1"),
        ("model.hidden=[a]", "a list of one or more integers >= 1"),
        ("model.hidden=16", "a list of one or more integers >= 1"),
        ("model.activation=swish", "relu, gelu, tanh, silu"),
        ("compile=yes", "true, false"),
    ],
)
def test_bad_model_settings_are_refused_in_one_line(override, allowed):
    with pytest.raises(ConfigError) as refused:
        check_config(compose_config("model=mlp", override))
    message = str(refused.value)
    assert message.startswith(override.split("=")[0] + "=") and f"allowed: {allowed}" in message, message


def test_bad_teacher_settings_are_refused_in_one_line():
    for override in ("data.teacher_hidden=[]", "data.teacher_activation=step"):
        with pytest.raises(ConfigError, match=f"^{override.split('=')[0]}="):
            check_config(compose_config("data=teacher", override))


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["model=mlp", "model.hidden=[0]"], "model.hidden=[0] is not allowed"),
        (["model=mlp", "model.hidden=[100000,100000,100000,100000,100000]"], "model.hidden="),
    ],
    ids=["zero-width", "parameters-beyond-memory"],
)
def test_cli_bad_model_exits_2_with_one_line_and_writes_nothing(tmp_path, args, named):
    out = tmp_path / "run"
    done = cli(*args, f"hydra.run.dir={out}", timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and named in line, line
    assert not out.exists()


def test_resuming_a_checkpoint_into_another_shape_is_one_line(runs_small, tmp_path):
    ckpt = runs_small / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match=r"its model is MLP\(.*hidden=\[16, 12\].*this run's is MLP\(.*hidden=\[32\]"):
        train(compose_config("model=mlp", "model.hidden=[32]", f"ckpt_path={ckpt}", *QUIET), tmp_path / "run")
    with pytest.raises(ConfigError, match=r"allowed: this run's model as the checkpoint's \(model=mlp .*"
                                          r"model.hidden=\[16,12\]"):  # fmt: skip
        train(compose_config(f"ckpt_path={ckpt}", *QUIET), tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def runs_small(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("mlp_small")
    train(compose_config(*MLP_ARGS, *QUIET), run_dir)
    return run_dir
