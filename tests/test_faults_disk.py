"""Faults of the disk: a disk that fills (a real tmpfs, the `tmpfs` fixture: at a checkpoint, with TensorBoard's
events, under results.csv out of inodes, under eval and predict) ends the command in one line, exit 1, and the last
complete checkpoint resumes; a run dir on a read-only file system is refused in one line, exit 2, nothing written;
a crash while writing leaves the previous files whole (docs/failures.md). The tmpfs tests skip where this process
cannot mount, a failure in CI."""

import errno
import json
import os
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY, cli, python, resize, used_pages
from faults import ENDLESS, MANY_EPOCHS, errors, saved, weights
from lightning.fabric.plugins import TorchCheckpointIO

from experiments.run.exits import OutOfSpace
from experiments.run.files import IN_PLACE_LATER, UMASK, AtomicCheckpointIO, write_atomic

# ------------------------------------------------------------------------------------------ a full disk


def test_a_disk_that_fills_at_a_checkpoint_is_one_line_and_the_last_complete_one_resumes(tmp_path, tmpfs):
    # Without TensorBoard and with a checkpoint of about 40 kB (2,000 features, their mean and std, momentum),
    # a disk with room for the run's small files and 1.5 checkpoints takes the first save and not the second,
    # which needs room for its temporary file beside the last complete checkpoint.
    args = [*MANY_EPOCHS, "trainer.max_epochs=4", "data.num_features=2000", "logger=none"]
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
    assert cli(*MANY_EPOCHS[1:], "trainer.max_epochs=1", f"hydra.run.dir={reference}").returncode == 0
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
