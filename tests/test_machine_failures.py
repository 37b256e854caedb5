"""A run's records survive what real machines do: a hard kill, two runs in one dir, a full disk, a size that
cannot fit (docs/failures.md). Every test runs the real `python train.py` (or eval.py, predict.py) in a
subprocess; a full disk is a real tmpfs mounted by the test (the `tmpfs` fixture: skipped where it cannot
mount, a failure in CI)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY, cli, logged_tags, python, resize, shrink, used_pages
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

LONG = ["trainer.max_epochs=60", "optimizer.momentum=0.9"]  # momentum: optimizer state that must be restored
ENDLESS = ["trainer.max_epochs=100000"]  # runs until the test stops it


def start(*args: str, log: Path, interpreter: str | None = None, **kwargs) -> subprocess.Popen:
    """`python train.py ARGS` in the background, its output in `log` (a pipe could fill and block it). A test that
    reads the process's pid from what it wrote, or SIGKILLs it, names `sys.executable`: the shim's pid is not the
    run's, and a SIGKILL of the shim ends the run a moment later (tests/prefork.py), time in which it can save."""
    out = log.open("w")
    command = [interpreter or python(), "train.py", *shrink(args)]
    return subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=out, **kwargs)


def wait_for(condition, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended (exit {process.returncode}) before the test could act"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def saved(run_dir: Path) -> dict | None:
    """The run's last.ckpt as torch reads it (whole at any moment: it is replaced atomically), or None."""
    path = run_dir / "checkpoints" / "last.ckpt"
    return torch.load(path, weights_only=True) if path.exists() else None


def weights(run_dir: Path) -> dict:
    return saved(run_dir)["state_dict"]


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def starts(run_dir: Path) -> list[dict]:
    path = run_dir / "provenance.json"
    return json.loads(path.read_text())["starts"] if path.exists() else []


def loss_steps(run_dir: Path) -> list[int]:
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    return [e.step for e in events.Scalars("train/loss")]


# ------------------------------------------------------------------------------------- a hard kill (SIGKILL)


@pytest.mark.slow
def test_a_run_killed_with_sigkill_resumes_from_its_last_epoch_bit_for_bit(tmp_path):
    reference = tmp_path / "reference"
    assert cli(*LONG, f"hydra.run.dir={reference}").returncode == 0

    run_dir = tmp_path / "run"
    killed = start(*LONG, f"hydra.run.dir={run_dir}", log=tmp_path / "killed.log", interpreter=sys.executable)
    wait_for(lambda: (saved(run_dir) or {}).get("epoch", -1) >= 1, killed)  # two epochs saved, by default
    killed.kill()
    killed.wait()
    assert not (run_dir / "metrics.json").exists()  # killed mid-run: no record but the checkpoint
    at = saved(run_dir)
    assert at["loops"] and at["epoch"] >= 1

    # A write cut short by SIGKILL (here: of last.ckpt itself) leaves its temporary file, and last.ckpt whole.
    # (The kill above may have cut a save of its own: its temporary file is there already, and goes the same way.)
    def strays() -> set[Path]:
        return {p for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")}

    before = strays()
    cut = "import os, sys\nfrom experiments.run.files import replacing\nwith replacing(sys.argv[1]) as tmp:\n"
    cut += "    tmp.write_bytes(b'half a checkpoint')\n    os.kill(os.getpid(), 9)\n"
    subprocess.run([sys.executable, "-c", cut, str(run_dir / "checkpoints" / "last.ckpt")], cwd=ROOT)
    [stray] = strays() - before
    assert saved(run_dir)["global_step"] == at["global_step"]

    again = cli(*LONG, f"hydra.run.dir={run_dir}")  # the same command
    assert again.returncode == 0, again.stderr[-3000:]
    assert not stray.exists() and strays() == set()  # removed at the start, under the dir's lock
    assert "note: resuming" not in again.stderr  # the same code: nothing to say
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "completed"
    resumed, uninterrupted = weights(run_dir), weights(reference)
    assert [k for k in uninterrupted if not torch.equal(resumed[k], uninterrupted[k])] == []
    assert [s["resumed_from"] for s in starts(run_dir)][1]["global_step"] == at["global_step"]
    # The steps the killed run logged after its checkpoint are there once: TensorBoard shows the reference's.
    assert loss_steps(run_dir) == loss_steps(reference)


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_starts_over_with_one_curve(tmp_path):
    args = ["data.num_samples=20000", "trainer.max_epochs=1"]  # 250 steps before the first save
    reference = tmp_path / "reference"
    assert cli(*args, f"hydra.run.dir={reference}").returncode == 0
    run_dir = tmp_path / "run"
    killed = start(*args, f"hydra.run.dir={run_dir}", log=tmp_path / "killed.log", interpreter=sys.executable)
    wait_for(lambda: "train/loss" in logged_tags(run_dir), killed)
    killed.kill()
    killed.wait()
    assert saved(run_dir) is None
    again = cli(*args, f"hydra.run.dir={run_dir}")
    assert again.returncode == 0, again.stderr[-3000:]
    events = [list((d / "tensorboard").glob("events.out.tfevents.*")) for d in (run_dir, reference)]
    assert len(events[0]) > len(events[1])  # the killed start's file is there too
    assert loss_steps(run_dir) == loss_steps(reference)  # the killed start's steps dropped: each step once
    resumed, uninterrupted = weights(run_dir), weights(reference)
    assert [k for k in uninterrupted if not torch.equal(resumed[k], uninterrupted[k])] == []


@pytest.mark.slow
def test_last_ckpt_is_written_every_epoch_and_every_n_steps_when_asked(tmp_path):
    # TINY: 2 epochs of 8 steps. Default: each epoch's end. every_n_train_steps=3: steps 3, 6, ..., 15 too.
    by_epoch = cli(f"hydra.run.dir={tmp_path / 'epochs'}")
    by_steps = cli("checkpoint.every_n_train_steps=3", "checkpoint.every_n_epochs=0", f"hydra.run.dir={tmp_path / 's'}")
    assert by_epoch.returncode == 0 and by_steps.returncode == 0, by_steps.stderr[-2000:]
    epochs, steps = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("epochs", "s"))
    assert epochs["checkpoints_saved"] == 2 and epochs["checkpoint_save_ms"] > 0
    assert steps["checkpoints_saved"] == 5  # 3, 6, 9, 12, 15; step 16, the end, is the final save
    assert saved(tmp_path / "s")["global_step"] == 16


# ------------------------------------------------------------------------------------ two runs in one dir


@pytest.mark.slow
def test_a_second_run_in_a_busy_dir_is_refused_naming_the_holder_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    holder = start(*ENDLESS, f"hydra.run.dir={run_dir}", log=tmp_path / "holder.log", interpreter=sys.executable)
    try:
        wait_for(lambda: saved(run_dir) is not None, holder)
        hydra_files = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
        event_files = sorted((run_dir / "tensorboard").iterdir())

        second = cli(*ENDLESS, "optimizer.lr=0.01", f"hydra.run.dir={run_dir}")
        assert second.returncode == 2
        [error] = errors(second.stderr)
        assert f"hydra.run.dir={run_dir.resolve()} is in use by another run: pid {holder.pid} on " in error
        assert f"on {socket.gethostname()} since " in error and "Traceback" not in second.stderr
        assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == hydra_files  # its overrides: not
        assert sorted((run_dir / "tensorboard").iterdir()) == event_files

        # eval.py reads a running run's checkpoint (it writes into a dir of its own).
        command = [python(), "eval.py", f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"]
        evaluation = subprocess.run([*command, f"hydra.run.dir={tmp_path / 'eval'}"], cwd=ROOT, capture_output=True)
        assert evaluation.returncode == 0, evaluation.stderr[-2000:]
    finally:
        holder.kill()
        holder.wait()

    # The lock died with its holder: the same command resumes at once.
    resumed = start(*ENDLESS, f"hydra.run.dir={run_dir}", log=tmp_path / "resumed.log")
    wait_for(lambda: len(starts(run_dir)) == 2, resumed)
    resumed.send_signal(signal.SIGTERM)
    assert resumed.wait(timeout=300) == 128 + signal.SIGTERM
    assert starts(run_dir)[1]["resumed_from"]["global_step"] > 0


@pytest.mark.slow
def test_a_ddp_run_holds_its_dir_from_rank_0(tmp_path):
    run_dir = tmp_path / "run"
    holder = start(*ENDLESS, "trainer.devices=2", f"hydra.run.dir={run_dir}", log=tmp_path / "holder.log",
                   interpreter=sys.executable)  # fmt: skip
    try:
        wait_for(lambda: saved(run_dir) is not None, holder)
        second = cli(*ENDLESS, "trainer.devices=2", f"hydra.run.dir={run_dir}")
        assert second.returncode == 2
        assert f"pid {holder.pid} on " in errors(second.stderr)[0]
    finally:
        holder.send_signal(signal.SIGTERM)  # the ranks stop together and save
        holder.wait(timeout=300)
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "interrupted"


@pytest.mark.slow
def test_a_second_sweep_in_a_busy_sweep_dir_is_refused_and_writes_nothing(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["train.py", "-m", *TINY, *ENDLESS, "optimizer.lr=0.01,0.02", f"hydra.sweep.dir={sweep}"]
    with (tmp_path / "first.log").open("w") as out:
        first = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=out)  # its pid is named
    try:
        wait_for(lambda: saved(sweep / "0") is not None, first)
        # Every file but those the first sweep rewrites as it trains (its curves and checkpoints).
        moving = {"tensorboard", "checkpoints"}
        files = {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file() and not moving & set(p.parts)}
        second = subprocess.run([python(), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2
        [error] = errors(second.stderr)
        assert f"hydra.sweep.dir={sweep.resolve()} is in use by another run: pid {first.pid}" in error
        assert {p: p.read_bytes() for p in files} == files
        assert not (sweep / "1").exists()
    finally:
        first.kill()
        first.wait()


@pytest.mark.slow
def test_a_requeued_slurm_job_waits_for_its_previous_start_and_another_job_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    hold = "import sys, time\nfrom experiments.run import lock\nlock.acquire(sys.argv[1])\nprint('held', flush=True)\n"
    hold += "time.sleep(600)\n"
    job = {**os.environ, "SLURM_JOB_ID": "4242"}
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run_dir)], cwd=ROOT, env=job, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        other = cli(f"hydra.run.dir={run_dir}", env={**os.environ, "SLURM_JOB_ID": "4243"})
        assert other.returncode == 2 and "SLURM job 4242" in errors(other.stderr)[0]

        same = start(f"hydra.run.dir={run_dir}", log=tmp_path / "same.log", env=job)  # the job, requeued
        waiting = "waiting for the previous start of SLURM job 4242"
        wait_for(lambda: waiting in (tmp_path / "same.log").read_text(), same)
    finally:
        holder.kill()
        holder.wait()
    assert same.wait(timeout=300) == 0, (tmp_path / "same.log").read_text()[-2000:]
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "completed"


# ------------------------------------------------------------------------------------------ a full disk


def test_a_disk_that_fills_at_a_checkpoint_is_one_line_and_the_last_complete_one_resumes(tmp_path, tmpfs):
    # Without TensorBoard and with a checkpoint of about 40 kB (2,000 features, their mean and std, momentum),
    # a disk with room for the run's small files and 1.5 checkpoints takes the first save and not the second,
    # which needs room for its temporary file beside the last complete checkpoint.
    args = [*LONG, "trainer.max_epochs=4", "data.num_features=2000", "logger=none"]
    reference = tmp_path / "reference"
    assert cli(*args, f"hydra.run.dir={reference}").returncode == 0
    checkpoint = used_pages(reference / "checkpoints")  # about 40 kB: 10 pages
    lock_record = 4096  # the lock file holds its holder's record while the run lives (empty after it)
    disk = tmpfs(used_pages(reference, skip=("last.ckpt", "metrics.json")) + lock_record + checkpoint * 3 // 2)
    run_dir = disk / "run"

    full = cli(*args, f"hydra.run.dir={run_dir}")
    assert full.returncode == 1
    [error] = errors(full.stderr)
    assert f"no space left on device writing {run_dir / 'checkpoints' / 'last.ckpt'}: " in error
    assert " bytes (" in error and "left on its filesystem" in error and "Traceback" not in full.stderr
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "failed"
    assert saved(run_dir)["epoch"] == 0  # the first, complete; the second never replaced it
    assert [p for p in run_dir.rglob("*.tmp")] == []

    resize(disk, 64 * 2**20)  # room again: the same command resumes from it
    again = cli(*args, f"hydra.run.dir={run_dir}")
    assert again.returncode == 0, again.stderr[-3000:]
    resumed, uninterrupted = weights(run_dir), weights(reference)
    assert [k for k in uninterrupted if not torch.equal(resumed[k], uninterrupted[k])] == []


@pytest.mark.slow
def test_a_disk_that_fills_with_tensorboard_events_is_one_line(tmp_path, tmpfs):
    # Checkpoints only at the end: the event file, written at every step, is what fills the disk.
    args = [*ENDLESS, "checkpoint.every_n_epochs=0"]
    reference = tmp_path / "reference"
    assert cli(*LONG[1:], "trainer.max_epochs=1", f"hydra.run.dir={reference}").returncode == 0
    disk = tmpfs(used_pages(reference, skip=("tensorboard", "last.ckpt", "metrics.json")) + 64 * 1024)
    run_dir = disk / "run"

    full = cli(*args, f"hydra.run.dir={run_dir}")
    assert full.returncode == 1
    [error] = errors(full.stderr)
    assert f"no space left on device writing {run_dir / 'tensorboard'}" in error and "left on its filesystem" in error
    assert "Traceback" not in full.stderr and "Exception in thread" not in full.stderr
    assert [p for p in run_dir.rglob("*.tmp")] == []


@pytest.mark.parametrize("command", ["eval.py", "predict.py"])
@pytest.mark.slow
def test_a_full_disk_under_eval_and_predict_is_one_line_and_leaves_nothing(tmp_path, tmpfs, command):
    run_dir = tmp_path / "run"
    table = tmp_path / "new.npy"
    np.save(table, np.random.default_rng(0).normal(size=(64, 8)))
    assert cli(f"hydra.run.dir={run_dir}").returncode == 0
    disk = tmpfs(4096)
    (disk / "filler").write_bytes(b"x" * 4096)  # nothing left
    args = [f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", f"hydra.run.dir={disk / 'out'}"]
    if command == "predict.py":
        args.append(f"data.path={table}")
    done = subprocess.run([python(), command, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    [error] = errors(done.stderr)
    assert f"no space left on device writing {disk / 'out'}" in error and "0 bytes (0.0 MiB) left" in error
    assert not (disk / "out").exists()


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


# ------------------------------------------------------------------------------------ a diverged checkpoint


def test_weights_that_diverged_between_loss_checks_never_reach_a_checkpoint(tmp_path, monkeypatch):
    """On a GPU the loss is read once a window, before the window's last backward pass, so the steps of a window
    can make the weights non-finite unseen. Here the CPU run checks no loss at all, so that only the check before
    each save stands between diverged weights and last.ckpt. At lr=1.5 the error grows at every step (x ~ N(0, 1):
    the loss's curvature is 2) and the weights pass float32's range within a few epochs of 8 steps, after some
    finite checkpoints."""
    from conftest import compose_config

    from experiments.commands.train import train
    from experiments.run.exits import RunFailed
    from experiments.training import module

    monkeypatch.setattr(module, "check_loss", lambda loss, trainer, step, batch_idx: None)
    cfg = compose_config("optimizer.lr=1.5", "trainer.max_epochs=40", "trainer.log_every_n_steps=100000", "logger=none")
    with pytest.raises(RunFailed, match=r"training diverged: .* found before saving a checkpoint, which was not saved"):
        train(cfg, tmp_path / "run")
    last = saved(tmp_path / "run")
    assert 0 < last["epoch"] < 39 and all(torch.isfinite(t).all() for t in last["state_dict"].values())
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["status"] == "failed"


@pytest.mark.cuda
def test_on_a_gpu_weights_that_diverged_between_log_steps_never_reach_a_checkpoint(tmp_path):
    args = ["trainer.accelerator=gpu", "optimizer.lr=1.5", "trainer.max_epochs=40", "trainer.log_every_n_steps=100000"]
    done = cli(*args, f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 1
    assert "found before saving a checkpoint, which was not saved" in errors(done.stderr)[0]
    last = saved(tmp_path / "run")
    assert all(torch.isfinite(t).all() for t in last["state_dict"].values())


@pytest.mark.slow
def test_a_full_disk_under_results_csv_stops_the_sweep_with_one_line(tmp_path, tmpfs):
    # A filesystem out of inodes (file entries) refuses a new file as a full one does (ENOSPC). A sweep of one
    # job on a tmpfs with one inode fewer than the sweep uses runs out at its last new file: results.csv's.
    args = [python(), "train.py", "-m", *TINY, "logger=none", "seed=0"]
    reference = tmpfs(2**26, name="reference")
    done = subprocess.run([*args, f"hydra.sweep.dir={reference / 'sweep'}"], cwd=ROOT, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    stats = os.statvfs(reference)
    used = stats.f_files - stats.f_ffree
    sweep = tmpfs(2**26, inodes=used - 1) / "sweep"
    full = subprocess.run([*args, f"hydra.sweep.dir={sweep}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert full.returncode == 1
    [error] = errors(full.stderr)
    assert f"no space left on device writing {sweep / 'results.csv'}: " in error
    assert "and no file entries (inodes) left" in error and "Traceback" not in full.stderr
    assert json.loads((sweep / "0" / "metrics.json").read_text())["status"] == "completed"


# ------------------------------------------------------------------------------------------ a read-only run dir


@pytest.mark.parametrize(
    "command",
    [
        ["train.py", "hydra.run.dir={dir}"],
        ["train.py", "-m", "seed=1,2", "hydra.sweep.dir={dir}"],
        ["eval.py", "ckpt_path=none.ckpt", "hydra.run.dir={dir}"],
        ["predict.py", "ckpt_path=none.ckpt", "data.path=none.csv", "hydra.run.dir={dir}"],
    ],
    ids=["run", "sweep", "eval", "predict"],
)
@pytest.mark.slow
def test_a_run_dir_on_a_read_only_file_system_is_one_line_exit_2_nothing_written(tmp_path, tmpfs, command):
    disk = tmpfs(1 << 20)  # a real mount, read-only: root's permissions do not pass it (chmod would not stop root)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, capture_output=True)
    target = disk / "outputs" / "run"
    args = [a.format(dir=target) for a in command]
    setting = "hydra.sweep.dir" if "-m" in args else "hydra.run.dir"
    done = subprocess.run([python(), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"error: {setting}={target} cannot be written: {disk} is on a read-only file system; allowed: a dir this "
        f"node can write, e.g. {setting}=<a dir on a writable file system>"
    ]
    assert list(disk.iterdir()) == []
