"""Faults of DDP ranks: a rank killed (SIGKILL) ends the whole job in one line naming it, under the lab's launcher
and torchrun, and the same command resumes bit for bit; a rank lost on another host is named by its address; a
signal to one rank, or one landing while the ranks agree on a stop, stops every rank at the same step, never one
alone (docs/failures.md). Each DDP run is the real CLI with two gloo ranks on the CPU; the tests that look at a
run's ranks start the real interpreter (tests/background.py)."""

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from background import start, wait_for
from conftest import TINY, with_tests_on_path
from faults import MANY_STEPS, RESUMABLE, assert_bit_identical, final_state, last_step, start_long
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy

from experiments.distributed.lost_rank import LostRank
from experiments.training.interruption import Interruption


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
    """The final state of a run through the CLI (`start_long`), never interrupted: the reference of a module's tests."""
    process = start_long(run_dir, *args)
    assert process.wait(timeout=300) == 0, process.output()
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
    process = start_long(run_dir, *KILLED_DDP, interpreter=sys.executable)  # its ranks are its children
    ranks = []
    try:
        # Both ranks are training, last.ckpt holds step 100.
        wait_for(lambda: last_step(run_dir) >= 120, "step 120", process, timeout=120)
        ranks = [process.pid, *descendants(process.pid)]
        assert len(ranks) == 2
        lost = ranks[0] if victim == "rank 0" else ranks[1]
        os.kill(lost, signal.SIGKILL)
        killed = time.monotonic()
        code = process.wait(timeout=30)
        ended = lambda: not any(map(running, ranks))  # noqa: E731
        wait_for(ended, f"no process left 30 s after {victim} died", timeout=killed + 30 - time.monotonic(), every=0.1)
    finally:
        for pid in [process.pid, *ranks]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
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
    resumed = start_long(run_dir, *KILLED_DDP)
    assert resumed.wait(timeout=300) == 0, resumed.output()
    assert_bit_identical(final_state(run_dir), uninterrupted_ddp)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from Linux's /proc")
def test_a_killed_rank_under_torchrun_is_one_line_of_the_run(tmp_path):
    """torchrun's agent stops the other worker and prints its own report after the run's line."""
    run_dir = tmp_path / "run"
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "train.py"]
    command = [*torchrun, *TINY, *RESUMABLE, *MANY_STEPS, "logger=csv", *KILLED_DDP, f"hydra.run.dir={run_dir}"]
    process = start(command, log=tmp_path / "run.log")
    workers = []
    try:
        wait_for(lambda: last_step(run_dir) >= 120, "step 120", process, timeout=120)
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
    process = start_long(runs / "interrupted", *DDP_WINDOWS, interpreter=sys.executable)  # its ranks are its children
    ranks = []
    try:
        wait_for(lambda: last_step(runs / "interrupted") >= 100, "step 100", process, timeout=120)
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

    checkpoint = runs / "interrupted" / "checkpoints" / "last.ckpt"
    resumed = start_long(runs / "resumed", *DDP_WINDOWS, f"ckpt_path={checkpoint}")
    assert resumed.wait(timeout=180) == 0, resumed.output()
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
    process = start_long(run_dir, *DDP_WINDOWS, *callback, env=with_tests_on_path())
    try:
        code = process.wait(timeout=300)
    except subprocess.TimeoutExpired:
        for pid in [process.pid, *descendants(process.pid)]:
            os.kill(pid, signal.SIGKILL)
        pytest.fail("the run hung")
    assert code == 128 + signal.SIGTERM, process.output()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (metrics["status"], metrics["global_step"]) == ("interrupted", 75)
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["last.ckpt"]
    assert final_state(run_dir)["global_step"] == 75
