"""Bad input fails fast and clearly; divergence, signals and dead ranks end a run cleanly; resuming is exact."""

import csv
import errno
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, cli, compose_config, python, with_tests_on_path
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from experiments.commands.train import train
from experiments.config.errors import ConfigError
from experiments.data.loader import BatchLoader
from experiments.distributed.lost_rank import LostRank
from experiments.run.exits import OutOfSpace, RunFailed
from experiments.run.files import IN_PLACE_LATER, UMASK, AtomicCheckpointIO, write_atomic
from experiments.run.signals import Interrupted
from experiments.training.interruption import Interruption
from experiments.training.module import Regressor

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


# ------------------------------------------------------------------------------------ divergence, memory


def test_divergence_stops_at_the_step_with_a_hint(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(RunFailed, match=r"diverged.*at step \d+.*lower optimizer\.lr") as err:
        train(compose_config("optimizer.lr=10000", "trainer.max_epochs=10"), run_dir)
    step = int(str(err.value).split("at step ")[1].split()[0])
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "failed"
    # TensorBoard was flushed: every step before the diverged one is on disk, one train/loss point each.
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert len(events.Scalars("train/loss")) == step
    assert step < 10 * 8  # it stopped early, not at the end of training


@pytest.mark.slow
def test_cli_divergence_exits_1_with_the_message(tmp_path):
    result = cli("optimizer.lr=10000", "trainer.max_epochs=10", f"hydra.run.dir={tmp_path / 'run'}", timeout=60)
    assert result.returncode == 1
    assert "error: training diverged" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_in_a_sweep_only_the_diverged_job_fails(tmp_path):
    command = [python(), "train.py", "-m", *TINY, "optimizer.lr=0.05,10000", f"hydra.sweep.dir={tmp_path}"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "diverged" in result.stderr
    status = [json.loads((tmp_path / job / "metrics.json").read_text())["status"] for job in ("0", "1")]
    assert status == ["completed", "failed"]


def test_out_of_memory_suggests_a_smaller_batch(tmp_path, monkeypatch):
    def out_of_memory(self, batch, batch_idx):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Regressor, "training_step", out_of_memory)
    with pytest.raises(RunFailed, match=r"data\.batch_size=32 trainer\.accumulate_grad_batches=2") as err:
        train(compose_config(), tmp_path / "run")
    assert "out of device memory with data.batch_size=64" in str(err.value)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["status"] == "failed"


@pytest.mark.cuda
def test_real_gpu_out_of_memory_suggests_a_smaller_batch(tmp_path, monkeypatch):
    def allocate_too_much(self, batch, batch_idx):
        return torch.empty(2**50, device=self.device).sum()  # 4 PiB

    monkeypatch.setattr(Regressor, "training_step", allocate_too_much)
    with pytest.raises(RunFailed, match=r"out of device memory.*smaller data\.batch_size") as err:
        train(compose_config("trainer.accelerator=gpu"), tmp_path / "run")
    assert "or let the lab choose with batch.effective=64: measured now, it would train" in str(err.value)


# ------------------------------------------------------------------------------ interruption and resume

RESUMABLE = ["trainer.max_epochs=3", "optimizer.momentum=0.9", "logger=none"]  # momentum: optimizer state


def final_state(run_dir: Path) -> dict:
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    return {
        "weights": checkpoint["state_dict"],
        "optimizer": checkpoint["optimizer_states"][0]["state"],
        "global_step": checkpoint["global_step"],
        "epoch": checkpoint["epoch"],
    }


def assert_bit_identical(a: dict, b: dict) -> None:
    assert (a["global_step"], a["epoch"]) == (b["global_step"], b["epoch"])
    for name, tensor in a["weights"].items():
        assert torch.equal(tensor, b["weights"][name]), name
    for index, state in a["optimizer"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"][index]["momentum_buffer"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final state of a run that was never interrupted, for each list of extra overrides."""
    states = {}

    def run(*overrides: str) -> dict:
        if overrides not in states:
            run_dir = tmp_path_factory.mktemp("uninterrupted")
            train(compose_config(*RESUMABLE, *overrides), run_dir)
            states[overrides] = final_state(run_dir)
        return states[overrides]

    return run


# (class and method that send the signal, at its n-th call, extra overrides, (global_step, epoch) where the run
# stops). 8 training batches per epoch; the run stops at the end of the optimizer step that the signal falls in.
# Lightning's per-batch hooks run once a window (experiments.training.windows): a step a window when every step is a log
# step (TINY), several otherwise; a window draws its micro-batches with `BatchLoader.next_batch`.
INTERRUPTIONS = {
    "mid-epoch": (Regressor, "on_train_batch_start", 5, (), (5, 0)),
    "first batch": (Regressor, "on_train_batch_start", 1, (), (1, 0)),
    "last batch of an epoch": (Regressor, "on_train_batch_start", 16, (), (16, 1)),
    "during validation": (Regressor, "on_validation_batch_start", 1, (), (9, 1)),  # after epoch 0: at the next step
    # the 4th micro-step is in the 2nd window of 3: the run stops after micro-step 6, at optimizer step 2
    "mid accumulation": (BatchLoader, "next_batch", 4, ("trainer.accumulate_grad_batches=3",), (2, 0)),
    # log steps 4, 8, ...: after the 5 warm-up steps (a window each), steps 6 to 8 are one window
    "mid-window": (BatchLoader, "next_batch", 7, ("trainer.log_every_n_steps=4",), (7, 0)),
}


# SIGINT takes the same path as SIGTERM: one point is enough for it.
@pytest.mark.parametrize(
    ("point", "signum"),
    [
        *(pytest.param(p, signal.SIGTERM, id=f"{p}-SIGTERM") for p in INTERRUPTIONS),
        pytest.param("mid-epoch", signal.SIGINT, id="mid-epoch-SIGINT"),
    ],
)
def test_interrupted_anywhere_then_resumed_equals_uninterrupted(tmp_path, monkeypatch, uninterrupted, point, signum):
    cls, hook, at_call, overrides, (step, epoch) = INTERRUPTIONS[point]
    calls = []
    original = getattr(cls, hook)

    def send_signal(self, *args):
        calls.append(args)
        if len(calls) == at_call:
            os.kill(os.getpid(), signum)
        return original(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(cls, hook, send_signal)
        with pytest.raises(Interrupted) as stop:
            train(compose_config(*RESUMABLE, *overrides), tmp_path / "interrupted")
    assert stop.value.exit_code == 128 + signum
    metrics = json.loads((tmp_path / "interrupted" / "metrics.json").read_text())
    assert (metrics["status"], metrics["global_step"], metrics["epochs"]) == ("interrupted", step, epoch)
    assert (final_state(tmp_path / "interrupted")["global_step"], final_state(tmp_path / "interrupted")["epoch"]) == (
        step,
        epoch,
    )

    checkpoint = tmp_path / "interrupted" / "checkpoints" / "last.ckpt"
    train(compose_config(*RESUMABLE, *overrides, f"ckpt_path={checkpoint}"), tmp_path / "resumed")
    assert_bit_identical(final_state(tmp_path / "resumed"), uninterrupted(*overrides))


# The CLI: a run long enough (200 steps an epoch) to signal it mid-epoch, once the steps that CSVLogger
# writes to csv/metrics.csv have reached 100.
LONG = ["data.num_samples=1000", "data.batch_size=4", "trainer.max_epochs=2"]


def start(run_dir: Path, *args: str, env: dict | None = None, interpreter: str | None = None) -> subprocess.Popen:
    command = [
        interpreter or python(),
        "train.py",
        *TINY,
        *RESUMABLE,
        *LONG,
        "logger=csv",
        *args,
        f"hydra.run.dir={run_dir}",
    ]
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def wait_for_steps(run_dir: Path, process: subprocess.Popen, steps: int = 100, timeout: float = 120) -> None:
    def last_step() -> int:
        try:  # CSVLogger rewrites the file in place: a read may catch it half written
            rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
            return max(int(row["step"]) for row in rows)
        except (OSError, ValueError, KeyError, TypeError):
            return -1

    deadline = time.monotonic() + timeout
    while last_step() < steps:
        assert process.poll() is None, f"the run ended ({process.returncode}) before step {steps}"
        assert time.monotonic() < deadline, f"no step {steps} after {timeout} s"
        time.sleep(0.02)


@pytest.mark.parametrize(
    ("signum", "resume_with"),
    [pytest.param(signal.SIGTERM, "file", id="SIGTERM-file"), pytest.param(signal.SIGINT, "last", id="SIGINT-last")],
)
@pytest.mark.slow
def test_cli_signal_mid_epoch_then_resume_is_exact(tmp_path, uninterrupted, signum, resume_with):
    runs = tmp_path / "runs"
    runs.mkdir()
    process = start(runs / "interrupted")
    try:
        wait_for_steps(runs / "interrupted", process)
        process.send_signal(signum)
        code = process.wait(timeout=60)
    finally:
        process.kill()
    log = (runs / "interrupted.log").read_text()
    assert code == 128 + signum, log[-2000:]
    assert f"interrupted by {signal.Signals(signum).name}; resume with ckpt_path=" in log
    metrics = json.loads((runs / "interrupted" / "metrics.json").read_text())
    assert metrics["status"] == "interrupted" and metrics["epochs"] == 0  # mid-epoch: 200 steps an epoch
    assert 100 <= metrics["global_step"] < 200

    ckpt = runs / "interrupted" / "checkpoints" / "last.ckpt" if resume_with == "file" else "last"
    resumed = start(runs / "resumed", f"ckpt_path={ckpt}")
    assert resumed.wait(timeout=120) == 0, (runs / "resumed.log").read_text()[-2000:]
    # The CLI runs the same `train` as a test does in process: its uninterrupted result is the reference.
    assert_bit_identical(final_state(runs / "resumed"), uninterrupted(*LONG))


# ------------------------------------------------------------------------------------------ DDP ranks


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found


def running(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()  # a zombie has ended
    except FileNotFoundError:
        return False


def _agreeing_rank(rank: int, tmp_path: Path) -> None:
    """One of two real gloo ranks asking `Interruption.agree` twice, rank 1 sending SIGTERM to rank 0 while rank 0
    waits in the first all-reduce (rank 1 not there yet)."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2")
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=rank, world_size=2)
    strategy = DDPStrategy(parallel_devices=[torch.device("cpu")] * 2, cluster_environment=LightningEnvironment())
    interruption = Interruption(str(tmp_path / "unused.ckpt"))
    interruption.phase = "training"
    (tmp_path / f"pid{rank}").write_text(str(os.getpid()))
    with interruption.handling():
        torch.distributed.barrier()
        if rank == 1:
            time.sleep(1)  # rank 0 is in the all-reduce by now
            os.kill(int((tmp_path / "pid0").read_text()), signal.SIGTERM)
            time.sleep(0.5)
        stops = [interruption.agree(strategy), interruption.agree(strategy)]
    (tmp_path / f"stops{rank}.json").write_text(json.dumps(stops))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_a_signal_during_the_ranks_agreement_stops_every_rank_at_the_next_step(tmp_path):
    """Handled on rank 0 as its all-reduce returns, the signal is not a stop there alone (rank 0 would wait in
    the checkpoint's barrier, rank 1 in the next step's collectives: a hang, then SLURM's SIGKILL, nothing
    saved): both ranks go on, and both stop at the next agreement."""
    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=_agreeing_rank, args=(rank, tmp_path)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    assert [process.exitcode for process in ranks] == [0, 0]
    stops = [json.loads((tmp_path / f"stops{rank}.json").read_text()) for rank in (0, 1)]
    assert stops == [[None, signal.SIGTERM]] * 2


def uninterrupted_cli_run(run_dir: Path, *args: str) -> dict:
    """The final state of a run through the CLI (`start`), never interrupted: the reference of a module's tests."""
    process = start(run_dir, *args)
    assert process.wait(timeout=300) == 0, (run_dir.parent / f"{run_dir.name}.log").read_text()[-2000:]
    return final_state(run_dir)


@pytest.fixture(scope="module")
def uninterrupted_ddp(tmp_path_factory):
    """The final state of the DDP run of `test_a_killed_ddp_rank_...`, never interrupted, through the CLI."""
    return uninterrupted_cli_run(tmp_path_factory.mktemp("ddp") / "run", *KILLED_DDP)


# Two ranks, 200 steps an epoch, last.ckpt every 50 steps: killed after step 120, it resumes from step 100.
KILLED_DDP = ["trainer.devices=2", "checkpoint.every_n_train_steps=50"]
LOST_LINE = (
    r"^error: lost rank (\d) of 2 \(pid (\d+) on (\S+)\) at step (\d+): Connection (?:closed|reset) by peer; "
    r"resume from (\S+) \(step (\d+)\): run the same command again$"
)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from Linux's /proc")
@pytest.mark.parametrize("victim", ["rank 1", "rank 0"])
@pytest.mark.slow
def test_a_killed_ddp_rank_ends_the_whole_job_in_one_line_and_resumes_exactly(tmp_path, victim, uninterrupted_ddp):
    run_dir = tmp_path / "run"
    process = start(run_dir, *KILLED_DDP, interpreter=sys.executable)  # its ranks are its children
    ranks = []
    try:
        wait_for_steps(run_dir, process, steps=120)  # both ranks are training, last.ckpt holds step 100
        ranks = [process.pid, *descendants(process.pid)]
        assert len(ranks) == 2
        lost = ranks[0] if victim == "rank 0" else ranks[1]
        os.kill(lost, signal.SIGKILL)
        killed = time.monotonic()
        code = process.wait(timeout=30)
        while any(map(running, ranks)) and time.monotonic() - killed < 30:
            time.sleep(0.1)
        left = [pid for pid in ranks if running(pid)]
    finally:
        for pid in [process.pid, *ranks]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes left behind 30 s after {victim} died"
    log = (tmp_path / "run.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    lines = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, log[-3000:]
    found = re.match(LOST_LINE, lines[0])
    assert found, lines[0]
    rank, pid, host, step, checkpoint, saved = found.groups()
    assert (int(rank), int(pid), host) == (int(victim[-1]), lost, os.uname().nodename)
    assert int(step) >= 120 and Path(checkpoint) == run_dir / "checkpoints" / "last.ckpt"
    assert int(saved) == final_state(run_dir)["global_step"] >= 100
    if victim == "rank 1":  # rank 0 saw it: the run failed, recorded as such
        assert code == 1
        assert json.loads((run_dir / "metrics.json").read_text())["status"] == "failed"
    else:
        assert code == -signal.SIGKILL

    # The same command in the same dir resumes from that checkpoint and ends as a run never interrupted.
    resumed = start(run_dir, *KILLED_DDP)
    assert resumed.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()[-2000:]
    assert_bit_identical(final_state(run_dir), uninterrupted_ddp)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from Linux's /proc")
def test_a_killed_rank_under_torchrun_is_one_line_of_the_run(tmp_path):
    """torchrun's agent stops the other worker and prints its own report after the run's line."""
    run_dir = tmp_path / "run"
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "train.py"]
    command = [*torchrun, *TINY, *RESUMABLE, *LONG, "logger=csv", *KILLED_DDP, f"hydra.run.dir={run_dir}"]
    log = open(tmp_path / "run.log", "w")  # noqa: SIM115 (closed with the process)
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    workers = []
    try:
        wait_for_steps(run_dir, process, steps=120)
        workers = descendants(process.pid)
        environs = {pid: Path(f"/proc/{pid}/environ").read_text().split("\0") for pid in workers}
        ranks = {int(v[5:]): pid for pid, env in environs.items() for v in env if v.startswith("RANK=")}
        os.kill(ranks[1], signal.SIGKILL)
        code = process.wait(timeout=60)
    finally:
        for pid in [process.pid, *workers]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    assert code != 0
    lines = [line for line in (tmp_path / "run.log").read_text().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and re.match(LOST_LINE, lines[0]), lines
    assert re.match(LOST_LINE, lines[0]).group(2) == str(ranks[1])
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "failed"


def test_a_lost_rank_on_another_host_is_named_by_the_address_in_gloos_error(tmp_path):
    """Three nodes: gloo's error names the lost peer's address, which names its host; on another host
    both of its ranks are candidates (their processes cannot be looked at from here); any other error is not one."""
    me = os.uname().nodename
    lost = LostRank(tmp_path / "last.ckpt")
    lost.ranks = [
        {"host": me, "pid": os.getpid(), "addresses": ["10.88.0.11", "127.0.0.1"]},
        {"host": me, "pid": os.getppid(), "addresses": ["10.88.0.11", "127.0.0.1"]},  # alive: not the lost one
        {"host": "n2", "pid": 51, "addresses": ["10.88.0.12"]},
        {"host": "n2", "pid": 52, "addresses": ["10.88.0.12"]},
        {"host": "n3", "pid": 61, "addresses": ["10.88.0.13"]},
    ]
    gloo = "[gloo/transport/tcp/pair.cc:534] Read error [10.88.0.12]:40631: Connection reset by peer"
    assert str(lost.error(RuntimeError(gloo), step=7)) == (
        "lost rank 2 of 5 or rank 3 of 5 (pid 51 on n2, pid 52 on n2) at step 7: Connection reset by peer; "
        "no checkpoint to resume from (none saved yet): the same command starts the run again"
    )
    assert lost.error(RuntimeError("some other failure"), step=7) is None


# Windows of 25 steps under DDP (training.windows): the ranks agree on a signal's stop once a window, at its end.
DDP_WINDOWS = ["trainer.devices=2", "trainer.log_every_n_steps=25"]


@pytest.fixture(scope="module")
def uninterrupted_windows(tmp_path_factory):
    """The final state of the DDP run of `test_a_signal_to_one_ddp_rank_...`, never interrupted, through the CLI."""
    return uninterrupted_cli_run(tmp_path_factory.mktemp("windows") / "run", *DDP_WINDOWS)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from Linux's /proc")
@pytest.mark.parametrize("victim", ["rank 1", "rank 0"])
@pytest.mark.slow
def test_a_signal_to_one_ddp_rank_stops_both_at_a_window_end_and_resumes_exactly(
    tmp_path, victim, uninterrupted_windows
):
    runs = tmp_path / "runs"
    runs.mkdir()
    process = start(runs / "interrupted", *DDP_WINDOWS, interpreter=sys.executable)  # its ranks are its children
    ranks = []
    try:
        wait_for_steps(runs / "interrupted", process, steps=100)
        ranks = [process.pid, *descendants(process.pid)]
        assert len(ranks) == 2
        os.kill(ranks[0] if victim == "rank 0" else ranks[1], signal.SIGTERM)  # that rank alone, mid-window
        code = process.wait(timeout=60)
    finally:
        for pid in [process.pid, *ranks]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    log = (runs / "interrupted.log").read_text()
    assert code == 128 + signal.SIGTERM, log[-2000:]
    metrics = json.loads((runs / "interrupted" / "metrics.json").read_text())
    assert metrics["status"] == "interrupted" and metrics["epochs"] == 0  # 200 steps an epoch
    # Both ranks ran their window to its end and stopped there, at a log step; the stop's one save is last.ckpt.
    assert metrics["global_step"] % 25 == 0 and 100 <= metrics["global_step"] < 200
    assert [p.name for p in (runs / "interrupted" / "checkpoints").iterdir()] == ["last.ckpt"]
    assert final_state(runs / "interrupted")["global_step"] == metrics["global_step"]

    resumed = start(runs / "resumed", *DDP_WINDOWS, f"ckpt_path={runs / 'interrupted' / 'checkpoints' / 'last.ckpt'}")
    assert resumed.wait(timeout=180) == 0, (runs / "resumed.log").read_text()[-2000:]
    assert_bit_identical(final_state(runs / "resumed"), uninterrupted_windows)


@pytest.mark.parametrize("sender", [0, 1], ids=["rank 0 signals rank 1", "rank 1 signals rank 0"])
@pytest.mark.slow
def test_a_signal_during_the_ranks_agreement_stops_both_a_window_later(tmp_path, sender):
    """The CLI's DDP run, the signal landing on one rank while it waits in the agreement at step 50's window end
    (tests/signal_rank.py): not a stop there alone (a hang: one rank in the checkpoint's barrier, the other in the
    next window), but both ranks stop at the next window's end, step 75, with one checkpoint."""
    run_dir = tmp_path / "run"
    callback = ["+callbacks.signal_peer._target_=signal_rank.SignalPeer", f"+callbacks.signal_peer.sender={sender}",
                "+callbacks.signal_peer.step=50"]  # fmt: skip
    process = start(run_dir, *DDP_WINDOWS, *callback, env=with_tests_on_path())
    try:
        code = process.wait(timeout=300)
    except subprocess.TimeoutExpired:
        for pid in [process.pid, *descendants(process.pid)]:
            os.kill(pid, signal.SIGKILL)
        pytest.fail("the run hung")
    assert code == 128 + signal.SIGTERM, (tmp_path / "run.log").read_text()[-2000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (metrics["status"], metrics["global_step"]) == ("interrupted", 75)
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["last.ckpt"]
    assert final_state(run_dir)["global_step"] == 75


# ------------------------------------------------------------------------------------------ determinism


def test_same_seed_same_weights_bit_for_bit(tmp_path):
    weights = {}
    for name, seed in [("a", 3), ("b", 3), ("c", 4)]:
        train(compose_config(f"seed={seed}", "logger=none"), tmp_path / name)
        weights[name] = final_state(tmp_path / name)["weights"]
    assert all(torch.equal(weights["a"][k], weights["b"][k]) for k in weights["a"])
    assert not torch.equal(weights["a"]["net.weight"], weights["c"]["net.weight"])  # the seed matters


# ---------------------------------------------------------------------------------------- atomic writes


def test_a_crash_while_writing_leaves_the_previous_files_whole(tmp_path, monkeypatch):
    metrics, checkpoint = tmp_path / "metrics.json", tmp_path / "last.ckpt"
    write_atomic(metrics, '{"status": "completed"}\n')
    AtomicCheckpointIO().save_checkpoint({"step": 1}, checkpoint)

    def crash(*args):
        raise OSError("disk full")

    def half_then_crash(self, checkpoint, path, storage_options=None):
        Path(path).write_bytes(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", half_then_crash)
    with pytest.raises(OSError):
        write_atomic(metrics, '{"status": "fail')
    with pytest.raises(OSError):
        AtomicCheckpointIO().save_checkpoint({"step": 2}, checkpoint)
    assert json.loads(metrics.read_text()) == {"status": "completed"}
    assert torch.load(checkpoint, weights_only=True) == {"step": 1}
    assert oct(metrics.stat().st_mode & 0o777) == oct(0o666 & ~UMASK)  # not mkstemp's private 0600


def test_a_save_put_in_place_later_lands_before_the_next_and_fails_at_teardown(tmp_path, monkeypatch):
    checkpoint, io = tmp_path / "last.ckpt", AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, checkpoint, storage_options=IN_PLACE_LATER)
    io.save_checkpoint({"step": 2}, checkpoint, storage_options=IN_PLACE_LATER)  # waits for step 1's rename
    assert io.load_checkpoint(checkpoint) == {"step": 2}  # waits for step 2's
    with pytest.raises(TypeError, match="IN_PLACE_LATER"):
        io.save_checkpoint({"step": 3}, checkpoint, storage_options={"compress": True})

    renames, rename, full = [], os.replace, ["full"]

    def full_disk_at_the_rename(src, dst):  # fails once for each entry of `full`
        renames.append(threading.current_thread().name)
        if full:
            full.pop()
            raise OSError(errno.ENOSPC, "No space left on device")
        rename(src, dst)

    monkeypatch.setattr(os, "replace", full_disk_at_the_rename)
    io.save_checkpoint({"step": 3}, checkpoint, storage_options=IN_PLACE_LATER)  # returns; its rename fails
    with pytest.raises(OutOfSpace) as failed:
        io.save_checkpoint({"step": 4}, checkpoint)  # the next save raises it, before it writes anything
    assert str(checkpoint) in str(failed.value)
    assert renames[0].startswith("checkpoint-in-place") and len(renames) == 1  # in the thread, not the caller's
    full.append("full")
    io.save_checkpoint({"step": 5}, checkpoint, storage_options=IN_PLACE_LATER)
    with pytest.raises(OutOfSpace):
        io.teardown()  # Lightning's, on every way out of a fit
    monkeypatch.undo()
    assert torch.load(checkpoint, weights_only=True) == {"step": 2}  # the last complete one stays
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # the failed one's temporary file removed
