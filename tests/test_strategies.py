"""Single device, DataParallel and DDP give the same weights; DDP ranks join their run, sweep job or torchrun.

The DDP runs go through the real CLI in a subprocess, with their outputs under tmp_path. One module-scoped set
of runs serves several tests.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, cli, compose_config, metrics, python, with_tests_on_path
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from experiments.commands.train import train
from experiments.config.checks import check_strategy
from experiments.config.errors import ConfigError
from experiments.data.loader import BatchLoader, EpochShuffle
from experiments.distributed.cpu_cost import cpu_processes_note
from experiments.distributed.launcher import ranks_join_this_job
from experiments.distributed.ranks import silent_rank_overrides

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def start(command: list[str], cwd: Path) -> subprocess.Popen:
    # A session of its own, so that a timeout can end the ranks it started too.
    return subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def train_py(*args: str, cwd: Path, flags: tuple[str, ...] = ()) -> subprocess.Popen:
    """`python <repo>/train.py FLAGS ARGS`, started from `cwd` (to see what lands there); returns the process."""
    return start([python(), str(ROOT / "train.py"), *flags, *TINY, *args], cwd)


def wait(*procs: subprocess.Popen, timeout: float = 240) -> list[str]:
    """Wait for processes started together (the CPU idles while DDP ranks start up); all must succeed.

    Their outputs stay open while any rank they started lives: a stray rank makes this time out.
    """
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, f"{p.args}\n{out[-3000:]}"
    return outputs


def weights(run_dir: Path) -> torch.Tensor:
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    return torch.cat([state["net.weight"].flatten(), state["net.bias"].flatten()]).double()


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()


def event_file_pids(run_dir: Path) -> set[str]:
    """The process ids in TensorBoard event file names (`events.out.tfevents.<time>.<host>.<pid>.<n>`)."""
    return {p.name.split(".")[-2] for p in (run_dir / "tensorboard").rglob("events.out.tfevents.*")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_two_nodes(cwd: Path, *args: str) -> list[subprocess.Popen]:
    """Two torchrun processes on 127.0.0.1, as two nodes of one process each would start them."""
    port = free_port()
    procs = []
    for node in (0, 1):
        torchrun = ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node)]
        torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
        command = [python(), "-m", "torch.distributed.run", *torchrun, str(ROOT / "train.py"), *TINY, *args]
        procs.append(start(command, cwd))
    return procs


WINDOWED = ["data.num_samples=2560", "data.batch_size=64"]  # 32 steps an epoch, 2 epochs
# A cosine schedule over 4 epochs, and EarlyStopping that stops at the first validation (its threshold is met).
SCHEDULED_EARLY_STOP = [
    "trainer.max_epochs=4",
    "scheduler=cosine",
    "callbacks=early_stopping",
    "+callbacks.early_stopping.stopping_threshold=0.5",
]


def tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")} if path.exists() else set()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The same problem trained every way, and two DDP sweeps; the dirs they wrote, by name.

    The CLI runs start together: most of a DDP run's time is start-up, with the CPU waiting on the ranks.
    """
    tmp = tmp_path_factory.mktemp("strategies")
    repo_outputs = tree(ROOT / "outputs")
    procs, dirs = [], {}
    for name, overrides in {
        "ddp_256": ["trainer.devices=2", "data.batch_size=256"],
        "ddp_64x4": ["trainer.devices=2", "data.batch_size=64", "trainer.accumulate_grad_batches=4"],
        # Windows of several steps (experiments.training.windows: to a log step at the ranks' agreed pace, or to the
        # epoch's end).
        "ddp_64_w7": ["trainer.devices=2", *WINDOWED, "trainer.log_every_n_steps=7"],
        "ddp_64_w50": ["trainer.devices=2", *WINDOWED, "trainer.log_every_n_steps=50"],
        "ddp_16x4_w3": [
            "trainer.devices=2",
            *WINDOWED,
            "data.batch_size=16",
            "trainer.accumulate_grad_batches=4",
            "trainer.log_every_n_steps=3",
        ],
        "ddp_spawn_64_w7": ["strategy=ddp_spawn", "trainer.devices=2", *WINDOWED, "trainer.log_every_n_steps=7"],
        "ddp_64_w7_sched_es": ["trainer.devices=2", *WINDOWED, *SCHEDULED_EARLY_STOP, "trainer.log_every_n_steps=7"],
    }.items():
        dirs[name] = tmp / name
        procs.append(train_py(*overrides, f"hydra.run.dir={dirs[name]}", cwd=ROOT))
    # torchrun with no hydra.run.dir: each rank runs Hydra, and each would make its own timestamped dir.
    dirs["torchrun_cwd"] = tmp / "torchrun"
    dirs["torchrun_cwd"].mkdir()
    procs += torchrun_two_nodes(dirs["torchrun_cwd"], "trainer.num_nodes=2", *WINDOWED, "trainer.log_every_n_steps=7")
    # Sweeps started from an empty working directory, to see that nothing lands outside the sweep dir. One
    # joblib worker runs both jobs: the second launches its ranks from a process that already did once.
    launchers = {"basic": [], "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=1"]}
    for launcher, launcher_args in launchers.items():
        cwd, sweep = tmp / f"{launcher}_cwd", tmp / f"{launcher}_sweep"
        cwd.mkdir()
        args = [*launcher_args, "trainer.devices=2", "optimizer.lr=0.01,0.05", f"hydra.sweep.dir={sweep}"]
        procs.append(train_py(*args, cwd=cwd, flags=("-m",)))
        dirs[f"{launcher}_cwd"], dirs[f"{launcher}_sweep"] = cwd, sweep
    # Meanwhile, in this process: one device, with and without accumulation.
    for name, overrides in {
        "single_256": ["strategy=single", "data.batch_size=256"],
        "single_64x4": ["data.batch_size=64", "trainer.accumulate_grad_batches=4"],
        "single_128": ["data.batch_size=128"],  # different maths: shows that the tolerance can tell
        "single_64": [*WINDOWED, "trainer.log_every_n_steps=1"],  # a step a window
        "single_64_sched_es": [*WINDOWED, *SCHEDULED_EARLY_STOP, "trainer.log_every_n_steps=1"],
    }.items():
        dirs[name] = tmp / name
        train(compose_config(*overrides, "logger=none"), dirs[name])
    outputs = wait(*procs)
    dirs["basic_output"], dirs["joblib_output"] = outputs[-2:]
    (dirs["torchrun_2x1_64_w7"],) = (dirs["torchrun_cwd"] / "outputs" / "runs").iterdir()
    dirs["repo_outputs_changed"] = tree(ROOT / "outputs") != repo_outputs
    return dirs


@pytest.mark.parametrize("name", ["single_64x4", "ddp_256", "ddp_64x4"])
@pytest.mark.slow
def test_final_weights_equal_single_device(runs, name):
    assert relative_difference(weights(runs[name]), weights(runs["single_256"])) <= 1e-5


@pytest.mark.parametrize("name", ["ddp_64_w7", "ddp_64_w50", "ddp_16x4_w3", "ddp_spawn_64_w7", "torchrun_2x1_64_w7"])
@pytest.mark.slow
def test_windows_of_steps_under_ddp_equal_single_device(runs, name):
    # 64 optimizer steps, in windows of up to 3, 7 or 50 steps after the warm-up (the windows of both ranks
    # computed from the same position, with no collective but the gradients' all-reduce of each step).
    steps = [
        torch.load(runs[n] / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
        for n in (name, "single_64")
    ]
    assert steps == [64, 64]
    assert relative_difference(weights(runs[name]), weights(runs["single_64"])) <= 1e-5


@pytest.mark.slow
def test_a_different_batch_gives_different_weights(runs):
    assert relative_difference(weights(runs["single_128"]), weights(runs["single_256"])) > 1e-3


@pytest.mark.slow
def test_windows_under_ddp_schedule_and_stop_early_as_one_device(runs):
    ddp, one = metrics(runs["ddp_64_w7_sched_es"]), metrics(runs["single_64_sched_es"])
    assert [(m["global_step"], m["stopped_epoch"], m["stop_reason"]) for m in (ddp, one)] == [
        (32, 0, "stopping_threshold")
    ] * 2
    assert relative_difference(weights(runs["ddp_64_w7_sched_es"]), weights(runs["single_64_sched_es"])) <= 1e-5


@pytest.mark.slow
def test_windows_under_ddp_log_at_the_steps_of_one_device(runs, tmp_path):
    train(compose_config(*WINDOWED, "trainer.log_every_n_steps=7"), tmp_path / "one")
    ddp, one = (EventAccumulator(str(d / "tensorboard")).Reload() for d in (runs["ddp_64_w7"], tmp_path / "one"))
    assert [p.step for p in ddp.Scalars("train/loss")] == [p.step for p in one.Scalars("train/loss")]
    assert [p.step for p in ddp.Scalars("train/loss")][:3] == [6, 13, 20]  # log steps 7, 14, 21 (0-based)
    # perf/* at the windows' ends, as many log intervals as each run's pace gives (the ranks' agreed one under
    # DDP): a log step or an epoch's end (32 steps), after the 5 warm-up steps.
    for events in (ddp, one):
        steps = [p.step for p in events.Scalars("perf/step_time_ms")]
        assert steps and all(s % 7 == 0 or s % 32 == 0 for s in steps) and steps[-1] == 64, steps
    assert min(p.value for p in ddp.Scalars("perf/comm_ms")) > 0  # DDP's all-reduce, timed
    assert max(p.value for p in one.Scalars("perf/comm_ms")) == 0


@pytest.mark.parametrize(
    "name, strategy, world_size, num_nodes",
    [
        ("ddp_256", "ddp", 2, 1),
        ("ddp_64x4", "ddp", 2, 1),
        ("ddp_spawn_64_w7", "ddp_spawn", 2, 1),
        ("torchrun_2x1_64_w7", "ddp", 2, 2),
    ],
)
@pytest.mark.slow
def test_ddp_runs_record_their_ranks(runs, name, strategy, world_size, num_nodes):
    record = metrics(runs[name])
    assert (record["status"], record["world_size"], record["num_nodes"]) == ("completed", world_size, num_nodes)
    assert record["strategy"] == strategy
    # Every rank's host in provenance; on one host each rank leaves gloo's interface to gloo, the same on all.
    ranks = json.loads((runs[name] / "provenance.json").read_text())["starts"][-1]["ranks"]
    assert [r["rank"] for r in ranks] == list(range(world_size))
    assert sorted({r["node_rank"] for r in ranks}) == list(range(num_nodes))
    assert {(r["host"], r["interface"]) for r in ranks} == {(socket.gethostname(), None)}


@pytest.mark.parametrize("name", ["ddp_256", "ddp_64x4", "torchrun_2x1_64_w7"])
@pytest.mark.slow
def test_only_rank_zero_writes(runs, name):
    run_dir = runs[name]
    assert len(event_file_pids(run_dir)) == 1  # a rank > 0 writing TensorBoard files would add its pid
    assert sorted(p.name for p in run_dir.rglob("*.log")) == ["train.log"]
    # Rank 0's Hydra record and the run's copy of it (experiments.run.state); a rank > 0 would add its own.
    assert sorted(p.parent.name for p in run_dir.rglob("config.yaml")) == [".hydra", ".run-hydra"]


@pytest.mark.slow
def test_torchrun_ranks_make_one_run_dir(runs):
    # Rank 1 ran Hydra in the same working directory: it made no dir, config or log of its own.
    cwd = runs["torchrun_cwd"]
    assert sorted(p.name for p in cwd.iterdir()) == ["outputs"]
    assert [p.name for p in (cwd / "outputs").iterdir()] == ["runs"]


@pytest.mark.parametrize("launcher", ["basic", "joblib"])
@pytest.mark.slow
def test_ddp_multirun_makes_one_sweep(runs, launcher):
    sweep = runs[f"{launcher}_sweep"]
    assert runs[f"{launcher}_output"].count("#0 : ") == 1  # a rank that re-ran the sweep would launch job 0 again
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    assert len(list(sweep.rglob("multirun.yaml"))) == 1
    for job, lr in zip(jobs, [0.01, 0.05], strict=True):
        assert metrics(sweep / job)["world_size"] == 2
        assert OmegaConf.load(sweep / job / ".hydra" / "config.yaml").optimizer.lr == lr
        assert len(event_file_pids(sweep / job)) == 1
    if launcher == "joblib":  # both jobs' rank 0 ran in the one worker
        assert len(event_file_pids(sweep / "0") | event_file_pids(sweep / "1")) == 1
    assert list(runs[f"{launcher}_cwd"].iterdir()) == []
    assert not runs["repo_outputs_changed"]


@pytest.mark.slow
def test_dp_without_cuda_stops_before_any_work(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = cli("strategy=dp", "trainer.devices=2", f"hydra.run.dir={tmp_path}")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith("error: strategy=dp needs CUDA GPUs")
    assert "strategy=ddp" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "metrics.json").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_batch_must_split_over_the_ranks_cli(tmp_path):
    result = cli("trainer.devices=3", "data.batch_size=64", f"hydra.run.dir={tmp_path}")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: data.batch_size=64 does not split over 3 ranks (trainer.devices=3 x trainer.num_nodes=1); "
        "allowed: a multiple of 3, e.g. 63 or 66"
    )


@pytest.mark.parametrize(
    "overrides, ranks",
    [
        (["trainer.devices=2", "trainer.num_nodes=3", "data.batch_size=64"], 6),
        (["strategy=ddp", "trainer.devices=4", "data.batch_size=66"], 4),
        (["strategy=ddp_spawn", "trainer.devices=[0,1,2]", "data.batch_size=64"], 3),
    ],
)
def test_batch_must_split_over_the_ranks(overrides, ranks):
    with pytest.raises(ConfigError, match=rf"data.batch_size=\d+ does not split over {ranks} ranks"):
        check_strategy(compose_config(*overrides))


@pytest.mark.parametrize(
    "overrides", [["trainer.devices=2", "data.batch_size=64"], ["strategy=ddp", "trainer.devices=4"]]
)
def test_batches_that_split_pass(overrides):
    check_strategy(compose_config(*overrides))


def test_single_refuses_two_devices():
    with pytest.raises(ConfigError, match="strategy=single: trainer.devices=2"):
        check_strategy(compose_config("strategy=single", "trainer.devices=2"))


def test_ranks_shard_every_global_batch_in_one_device_order():
    x, y = torch.arange(40.0)[:, None], torch.arange(40.0)[:, None]
    one = list(BatchLoader(x, y, 8, EpochShuffle(40, seed=3)))
    shards = [list(BatchLoader(x, y, 8, EpochShuffle(40, seed=3), rank=r, world_size=2)) for r in (0, 1)]
    for whole, half0, half1 in zip(one, *shards, strict=True):
        assert len(half0[0]) == len(half1[0]) == 4
        assert torch.equal(torch.cat([half0[0], half1[0]]), whole[0])


@pytest.mark.parametrize(
    "env, silent",
    [
        ({}, False),
        ({"RANK": "0"}, False),
        ({"RANK": "1"}, True),
        ({"SLURM_PROCID": "3"}, True),
        ({"LOCAL_RANK": "1"}, True),
        ({"SLURM_PROCID": "0", "LOCAL_RANK": "1"}, True),  # Lightning's rank 1 inside a one-task SLURM job
        ({"NODE_RANK": "1", "LOCAL_RANK": "0"}, True),
    ],
)
def test_ranks_above_zero_run_hydra_silently(monkeypatch, env, silent):
    for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    overrides = silent_rank_overrides([])
    assert ("hydra.output_subdir=null" in overrides) == silent
    assert ("hydra.run.dir=." in overrides) == silent
    assert "hydra.run.dir=." not in silent_rank_overrides(["hydra.run.dir=/a/run"])


@pytest.mark.slow
def test_dataparallel_code_path_on_cpu_equals_single_device(runs, tmp_path, monkeypatch):
    # Without CUDA, torch.nn.DataParallel calls the module directly: this runs the strategy's path (the module's
    # windows of steps with the net's forward pass through DataParallel) and its logging, though not the scatter.
    monkeypatch.setattr("experiments.config.checks.check_strategy", lambda cfg: None)
    cfg = compose_config("strategy=dp", "trainer.accelerator=cpu", "data.batch_size=256", "logger=csv")
    record = train(cfg, tmp_path)
    assert record["strategy"] == "dp"
    assert relative_difference(weights(tmp_path), weights(runs["single_256"])) <= 1e-5
    logged = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()
    assert "train/loss" in logged[0]
    assert (
        sum(1 for row in logged[1:] if row.split(",")[logged[0].split(",").index("train/loss")]) == 4
    )  # once per step


@pytest.mark.cuda
@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=TWO_GPUS)])
def test_dataparallel_on_gpus_equals_single_device(tmp_path, devices):
    common = ["trainer.accelerator=gpu", "data.batch_size=256", "logger=none"]
    single = train(compose_config("strategy=single", *common), tmp_path / "single")
    dp = train(compose_config("strategy=dp", f"trainer.devices={devices}", *common), tmp_path / "dp")
    assert (dp["strategy"], dp["devices"], dp["world_size"]) == ("dp", devices, 1)
    assert relative_difference(weights(tmp_path / "dp"), weights(tmp_path / "single")) <= 1e-5
    assert dp["global_step"] == single["global_step"]


@pytest.mark.cuda
def test_dataparallel_refuses_more_gpus_than_there_are(tmp_path):
    with pytest.raises(ConfigError, match="strategy=dp: trainer.devices="):
        check_strategy(compose_config("strategy=dp", f"trainer.devices={torch.cuda.device_count() + 1}"))


def test_environment_is_restored_after_a_job(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    before = dict(os.environ)
    with ranks_join_this_job():
        os.environ["LOCAL_RANK"] = "0"  # what Lightning's launcher leaves behind
        os.environ["MASTER_PORT"] = "1"
    assert dict(os.environ) == before


def test_ddp_ranks_agree_once_a_log_step_and_not_at_an_epoch_end_or_its_save(tmp_path):
    """Beyond the gradients' all-reduce (DDP's own, in C++: no Python call to count), a DDP run holds one small
    all-reduce at each log step's window end (the ranks' agreement on a signal), none at the other windows' ends
    (here each epoch's end) and none at a save (every rank judges the same weights: experiments.training.divergence): no
    barrier (Lightning's reduce puts one before each all-reduce, its save_checkpoint one after the write), no
    broadcast (Lightning's of its SIGTERM flag before every window). 8 steps an epoch, a log step every 16, no
    validation: two epochs hold one log step."""
    out = tmp_path / "counts"
    overrides = ["trainer.devices=2", "trainer.max_epochs=4", "trainer.log_every_n_steps=16"]
    overrides += ["trainer.limit_val_batches=0"]
    overrides += ["+callbacks.count._target_=count_collectives.CountCollectives", f"+callbacks.count.out={out}"]
    done = cli(*overrides, f"hydra.run.dir={tmp_path / 'run'}", env=with_tests_on_path())
    assert done.returncode == 0, done.stderr[-2000:]
    for rank in (0, 1):
        start, end = (json.loads(Path(f"{out}.rank{rank}.epoch{e}.json").read_text()) for e in (1, 3))
        two_epochs = {name: end[name] - start.get(name, 0) for name in end if end[name] != start.get(name, 0)}
        assert two_epochs == {"all_reduce": 1}, f"rank {rank}"


def test_ddp_on_a_cpu_says_once_what_it_costs(runs):
    # Rank 0 says it, into the run's train.log too; the run then trains as asked.
    notes = [line for line in (runs["ddp_256"] / "train.log").read_text().splitlines() if "note: " in line]
    assert len(notes) == 1 and "trainer.devices=2 runs DDP over CPU processes" in notes[0]
    assert "docs/strategies.md#ddp-on-a-cpu" in notes[0]
    assert json.loads((runs["ddp_256"] / "metrics.json").read_text())["status"] == "completed"


@pytest.mark.parametrize(
    ("processes", "cores", "batch", "features", "says"),
    [
        (4, 2, 256, 100, "starts 4 CPU processes on 2 cores"),  # more processes than cores: whatever the size
        (4, 2, 65536, 4096, "starts 4 CPU processes on 2 cores"),
        (2, 2, 256, 100, "took 1.6x to 6.1x as long a step"),  # the default problem: DDP on a CPU is slower
        (2, 2, 4096, 1000, "took 1.6x to 6.1x as long a step"),  # the largest size measured
        (2, 2, 8192, 1000, None),  # beyond what the lab measured: no claim
        (1, 2, 256, 100, None),
    ],
)
def test_what_cpu_processes_cost_follows_the_labs_measurements(processes, cores, batch, features, says):
    note = cpu_processes_note(processes, 1, batch, features, cores)
    assert note is None if says is None else (says in note and note.startswith("note: trainer.devices="))
