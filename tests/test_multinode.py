"""Beyond one machine: a real two-node SLURM cluster (scripts/local_slurm.sh start --nodes 2: two slurmd, each in a
network and UTS namespace of its own, on a bridge). DDP across the nodes through sbatch (1 and 2 tasks a node),
with the gradients' bytes on the nodes' interfaces; pre-emption and requeue across nodes; a lost node (its job's
processes killed, or its slurmd stopped) ending the other rank and resuming; torchrun from each node; a sweep of
two-node jobs.

Skipped, with the script's one line, where the machine cannot hold two nodes (not root, no namespaces, no
multiple-slurmd support) or the cluster is not running; CI sets GPU_LAB_REQUIRE_MULTINODE=1, so a skip fails there.
"""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from background import wait_for
from conftest import ROOT, TINY, compose_config, final_weights, logged_tags, metrics, with_tests_on_path
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from experiments.commands.train import train

pytestmark = pytest.mark.slurm
DIR = Path(os.environ.get("GPU_LAB_2NODES_DIR", "/tmp/gpu-lab-slurm-2nodes"))
NETNS, VETH = os.environ.get("GPU_LAB_NETNS", "glab-n"), os.environ.get("GPU_LAB_VETH", "glab-v")
MASTER_PORT = os.environ.get("GPU_LAB_MASTER_PORT", "29700")  # torchrun's, on n1
N1_ADDRESS = os.environ.get("GPU_LAB_NET", "10.88.0") + ".11"  # torchrun's master


def env(base: dict | None = None) -> dict:
    return {**(base or os.environ), "SLURM_CONF": str(DIR / "slurm.conf")}


def script(*args: str) -> subprocess.CompletedProcess:
    command = ["scripts/local_slurm.sh", *args, "--nodes", "2"]
    return subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module", autouse=True)
def cluster():
    reason = None
    if (check := script("check")).returncode != 0:
        reason = check.stderr.strip().removeprefix("error: ")
    elif script("status").returncode != 0:
        reason = f"no two-node cluster in {DIR} (scripts/local_slurm.sh start --nodes 2, GPU_LAB_2NODES_DIR)"
    if reason is not None:
        if os.environ.get("GPU_LAB_REQUIRE_MULTINODE"):
            pytest.fail(f"GPU_LAB_REQUIRE_MULTINODE=1 but {reason}")
        pytest.skip(reason)


def slurm(*command: str, check: bool = True) -> str:
    done = subprocess.run(command, env=env(), capture_output=True, text=True, timeout=60, check=check)
    return done.stdout.strip()


def submit(tmp_path: Path, name: str, *args: str, nodes: int = 2, tasks: int = 1, base=None) -> str:
    command = ["sbatch", "--parsable", f"--job-name={name}", f"--output={tmp_path}/{name}-%j.out"]
    command += [f"--nodes={nodes}", f"--ntasks-per-node={tasks}", "scripts/slurm.sbatch", "trainer.accelerator=cpu"]
    command += [*TINY, *args, f"hydra.run.dir={tmp_path / name}"]
    done = subprocess.run(command, cwd=ROOT, env=env(base), capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip().split(";")[0]


def state(job: str) -> str:
    return slurm("squeue", "-h", "-j", job, "-o", "%T", check=False)  # "" once the job has left the queue


def wait_until(condition, what: str, timeout: float = 240) -> float:
    """Seconds until `condition` held, asked at the scheduler's pace (squeue asks slurmctld)."""
    return wait_for(condition, what, timeout=timeout, every=0.25)


def assert_weights_of_one_device(run_dir: Path, one_dir: Path, *args: str) -> float:
    """Within 1e-5 of the largest weight (sums over 1024 features in another order differ in the last float
    bits: elementwise, a weight near 0 may differ by more than 1e-5 of itself). Returns the largest difference."""
    train(compose_config(*args), one_dir)
    got, one = final_weights(run_dir), final_weights(one_dir)
    worst = 0.0
    for name, tensor in one.items():
        difference = (got[name].double() - tensor.double()).abs().max().item()
        assert difference <= 1e-5 * tensor.double().abs().max().item(), (name, difference)
        worst = max(worst, difference)
    return worst


def veth_bytes() -> dict[str, int]:
    """Bytes through each node's veth, counted on the host's side: what left and entered that node."""
    counts = {}
    for i in (1, 2):
        stats = Path(f"/sys/class/net/{VETH}{i}/statistics")
        counts[f"n{i}"] = int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())
    return counts


def log(tmp_path: Path, name: str) -> str:
    return "".join(p.read_text() for p in tmp_path.glob(f"{name}-*.out"))[-3000:]


# Wide enough that each step's gradient (1025 floats, 4 kB) outweighs SLURM's own traffic on the veths.
WIDE = ["data.num_features=1024", "data.num_samples=2048"]


@pytest.mark.parametrize("tasks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_sbatch_ddp_across_two_nodes(tmp_path, tasks):
    before = veth_bytes()
    job = submit(tmp_path, "ddp", *WIDE, nodes=2, tasks=tasks)
    wait_until(lambda: state(job) == "", "the two-node job to end")
    moved = {node: count - before[node] for node, count in veth_bytes().items()}
    run_dir, world = tmp_path / "ddp", 2 * tasks
    record = metrics(run_dir)
    assert record.get("status") == "completed", log(tmp_path, "ddp")
    assert (record["world_size"], record["devices"], record["num_nodes"]) == (world, tasks, 2)
    ranks = json.loads((run_dir / "provenance.json").read_text())["starts"][-1]["ranks"]
    assert [(r["rank"], r["node_rank"], r["host"]) for r in ranks] == [
        (rank, rank // tasks, f"n{rank // tasks + 1}") for rank in range(world)
    ]
    assert {r["interface"] for r in ranks} == {"eth0"}  # the route to the master, not loopback
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ddp", f"ddp-{job}.out"])  # one run dir
    # Every step all-reduces the 1025 gradients (float32) across the nodes: each node sends and receives at least
    # that many bytes (the checkpoints and TensorBoard go through the shared /tmp, not the network).
    steps = record["global_step"]
    assert min(moved.values()) > steps * 1025 * 4, (moved, steps)
    difference = assert_weights_of_one_device(run_dir, tmp_path / "one", *WIDE)
    print(f"\ntwo nodes x {tasks}: hosts {[r['host'] for r in ranks]}, world {world}, steps {steps}, bytes through the")
    print(f"nodes' veths {moved}, largest weight difference to one device {difference:.2e}")


# 200 steps an epoch over 2 ranks, 20 epochs, so that a signal or a lost node lands mid-run; momentum: optimizer
# state to restore. The reference is the same two-node job, uninterrupted: resumes must give its weights bit
# for bit (one device sums the gradients in another order).
LONG = ["data.num_samples=1000", "data.batch_size=4", "trainer.max_epochs=20", "optimizer.momentum=0.9"]
LONG += ["optimizer.lr=0.01"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    job = submit(tmp_path, "run", *LONG)
    wait_until(lambda: state(job) == "", "the uninterrupted two-node job", timeout=400)
    assert metrics(tmp_path / "run").get("status") == "completed", log(tmp_path, "run")
    return tmp_path / "run"


def loss_steps(run_dir: Path) -> list[int]:
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    return [e.step for e in events.Scalars("train/loss")]


# Not `now`: slurmd revoked the job's credential when its first run was killed, and it refuses a new one of the same
# second ("Killing non-startable batch JobId=N: Job credential revoked"): the requeued job would end there.
# Once a job: each move puts the begin time 3 s from then.
SOON = "now+3"
MOVED: set[str] = set()


def start_if_pending(job: str) -> None:
    if job not in MOVED and state(job) == "PENDING":  # a requeued job's begin time is about two minutes away
        slurm("scontrol", "update", f"JobId={job}", f"StartTime={SOON}", check=False)
        MOVED.add(job)


def assert_resumed_bit_for_bit(run_dir: Path, reference: Path) -> None:
    resumed, expected = final_weights(run_dir), final_weights(reference)
    assert [k for k in expected if not torch.equal(resumed[k], expected[k])] == []
    assert loss_steps(run_dir) == loss_steps(reference)  # each step once in TensorBoard


@pytest.mark.parametrize("preemption", ["scontrol requeue", "SIGUSR1"])
@pytest.mark.slow
def test_a_preempted_two_node_job_is_requeued_and_resumes_bit_for_bit(tmp_path, uninterrupted, preemption):
    name = "preempted-" + preemption.split()[-1].lower()
    run_dir = tmp_path / name
    job = submit(tmp_path, name, *LONG)
    wait_until(lambda: "train/loss" in logged_tags(run_dir), "training to start")
    if preemption == "SIGUSR1":  # as `--signal=USR1@90` does: to the job's steps on both nodes
        slurm("scancel", "--signal=USR1", job)
    else:
        slurm("scontrol", "requeue", job)
    wait_until(lambda: metrics(run_dir).get("status") == "interrupted" or state(job) == "", "the stop")
    interrupted = metrics(run_dir)
    assert interrupted.get("status") == "interrupted" and 0 < interrupted["global_step"] < 4000, log(tmp_path, name)
    wait_until(lambda: start_if_pending(job) or metrics(run_dir).get("status") == "completed", "the resumed run")
    wait_until(lambda: state(job) == "", "the job to leave the queue", timeout=60)
    starts = json.loads((run_dir / "provenance.json").read_text())["starts"]
    assert [sorted({r["host"] for r in s["ranks"]}) for s in starts] == [["n1", "n2"]] * 2
    # From the stop's own checkpoint: a run started again from scratch gives the same weights too.
    assert (starts[-1]["resumed_from"] or {}).get("global_step") == interrupted["global_step"], starts[-1]
    assert_resumed_bit_for_bit(run_dir, uninterrupted)


# distributed.lost_rank's line (docs/failures.md#a-lost-rank).
LOST_LINE = (
    r"error: lost rank (?P<rank>\d) of 2 \(pid \d+ on (?P<host>\S+)\) at step \d+: Connection (?:closed|reset) by "
    r"peer; resume from (?P<checkpoint>\S+) \(step (?P<saved>\d+)\): run the same command again"
    r"(?:$|slurmstepd: error: \*\*\* STEP .* CANCELLED .*$)"
)  # slurmstepd's cancel notice can land on the same line of the .out: the rank's line ends where it began


def job_pids(node: int) -> list[int]:
    """The processes in node `node`'s namespace but its slurmd: the job's (slurmstepd, srun, the ranks)."""
    slurmd = int((DIR / f"slurmd-n{node}.pid").read_text())
    pids = subprocess.run(["ip", "netns", "pids", f"{NETNS}{node}"], capture_output=True, text=True, check=True)
    return [int(pid) for pid in pids.stdout.split() if int(pid) != slurmd]


def job_record(job: str) -> dict:
    line = slurm("scontrol", "show", "job", "-o", job, check=False)
    return dict(field.split("=", 1) for field in line.split() if "=" in field)


def last_epoch_checkpoint(run_dir: Path) -> int:
    try:
        return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    except (OSError, RuntimeError, EOFError, KeyError):
        return 0


@pytest.mark.parametrize("loss", ["the job's processes killed", "slurmd stopped"])
@pytest.mark.slow
def test_a_lost_node_ends_the_other_rank_and_the_job_resumes_bit_for_bit(tmp_path, uninterrupted, loss):
    name = "lost-" + loss.split()[-1]
    run_dir = tmp_path / name
    # SLURM takes 20-30 s to mark a silent node DOWN, longer than what is left of LONG on a quiet machine: in its
    # first start rank 1 sleeps 10 ms a step (the same weights), so that the run is still going when it is requeued.
    paced = ["model._target_=slow_rank.SlowOnRankOne", "+model.seconds=0.010", "+model.first_start_only=true"]
    paced = paced if loss == "slurmd stopped" else []
    job = submit(tmp_path, name, *LONG, *paced, base=with_tests_on_path())
    wait_until(lambda: last_epoch_checkpoint(run_dir) > 0, "the first epoch's checkpoint")
    lost_at = time.monotonic()
    if loss == "slurmd stopped":
        # The node falls silent: SLURM marks it DOWN (SlurmdTimeout) and requeues the job, ending its step on n1;
        # the rank there stops, and the rank left on n2 must not hang in a collective.
        os.kill(int((DIR / "slurmd-n2.pid").read_text()), signal.SIGKILL)
    else:
        for pid in job_pids(2):
            os.kill(pid, signal.SIGKILL)
    # No rank left: nothing of the job in either namespace, within a bounded time. Killed: gloo's error on n1 at
    # once, and srun's KillWait (10 s) once that rank cancelled its step. Stopped: SlurmdTimeout (20 s) and SLURM's
    # ping interval before n2 is DOWN, then KillWait.
    bound = 30 if loss == "the job's processes killed" else 90
    gone = lambda: job_pids(1) == [] and (loss != "slurmd stopped" or job_pids(2) == [])  # noqa: E731
    ended = wait_until(gone, "no process of the job left", bound)
    print(f"\n{loss}: the job's processes on both nodes ended {ended:.1f} s later")
    if loss == "slurmd stopped":
        assert script("start").returncode == 0  # the node comes back; the requeued job runs on it
        # slurmctld requeues the job once it has marked n2 DOWN, which may be after the last process ended.
        requeued = lambda: job_record(job).get("Restarts") == "1" or metrics(run_dir).get("status") == "completed"  # noqa: E731
        wait_until(requeued, "the job requeued once", 60)
        assert job_record(job).get("Restarts") == "1", ("the run ended before n2 was DOWN", job_record(job))
        wait_until(lambda: start_if_pending(job) or metrics(run_dir).get("status") == "completed", "the resumed run")
    else:
        wait_until(lambda: state(job) in ("", "FAILED", "COMPLETING"), "the job to end")
        record = job_record(job)
        assert (record.get("JobState"), record.get("ExitCode", "0:0") != "0:0") == ("FAILED", True), record
        assert metrics(run_dir).get("status") == "failed"
        # The rank on n1 says, in one line instead of gloo's traceback, who was lost, where, and what to resume.
        said = (tmp_path / f"{name}-{job}.out").read_text()
        lost = [line for line in said.splitlines() if line.startswith("error: lost rank")]
        assert len(lost) == 1 and "[rank0]: Traceback" not in said, said[-3000:]
        found = re.match(LOST_LINE, lost[0])
        assert found and found["rank"] == "1" and found["host"] == "n2", lost[0]
        assert found["checkpoint"] == str(run_dir / "checkpoints" / "last.ckpt"), lost[0]
        print(lost[0])
        # The same command again, a new job: it resumes from the checkpoint the line named.
        again = submit(tmp_path, name, *LONG)
        wait_until(lambda: state(again) == "", "the re-submitted job")
        starts = json.loads((run_dir / "provenance.json").read_text())["starts"]
        assert starts[-1]["resumed_from"]["global_step"] == int(found["saved"])
    assert time.monotonic() - lost_at < 400
    assert metrics(run_dir).get("status") == "completed", log(tmp_path, name)
    assert_resumed_bit_for_bit(run_dir, uninterrupted)


def on_node(node: int, command: list[str]) -> list[str]:
    """`command` on node `node`, as its slurmd runs jobs: in its network namespace, under its hostname."""
    net = ["nsenter", f"--net=/run/netns/{NETNS}{node}", "--", "unshare", "--uts", "--"]
    return [*net, "sh", "-c", f'hostname n{node} && exec "$@"', "sh", *command]


@pytest.mark.slow
def test_torchrun_from_each_node_gives_the_weights_of_one_device(tmp_path):
    """docs/strategies.md's two-node torchrun command, run on n1 (--node-rank 0, its address as master) and n2."""
    run_dir, before = tmp_path / "torchrun", veth_bytes()
    procs = []
    for node in (1, 2):
        torchrun = ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node - 1)]
        torchrun += [
            "--master-addr",
            N1_ADDRESS,
            "--master-port",
            os.environ.get("GPU_LAB_MASTER_PORT", "29700"),
        ]
        command = [sys.executable, "-m", "torch.distributed.run", *torchrun, "train.py", "trainer.num_nodes=2"]
        command += ["trainer.accelerator=cpu", *TINY, *WIDE, f"hydra.run.dir={run_dir}"]
        procs.append(
            subprocess.Popen(
                on_node(node, command), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    moved = {node: count - before[node] for node, count in veth_bytes().items()}
    assert [proc.returncode for proc in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    record = metrics(run_dir)
    assert (record["status"], record["world_size"], record["num_nodes"]) == ("completed", 2, 2)
    ranks = json.loads((run_dir / "provenance.json").read_text())["starts"][-1]["ranks"]
    assert [(r["rank"], r["node_rank"], r["host"], r["interface"]) for r in ranks] == [
        (0, 0, "n1", "eth0"),
        (1, 1, "n2", "eth0"),
    ]
    assert min(moved.values()) > record["global_step"] * 1025 * 4, moved
    difference = assert_weights_of_one_device(run_dir, tmp_path / "one", *WIDE)
    print(f"\ntorchrun on n1 and n2: bytes through the veths {moved}, weight difference to one device {difference:.2e}")


@pytest.mark.slow
def test_a_submitit_sweep_of_two_node_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    command = [sys.executable, "train.py", "-m", *TINY, "trainer.accelerator=cpu", "optimizer.lr=0.01,0.02"]
    command += ["hydra/launcher=submitit_slurm", "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=1"]
    command += ["trainer.num_nodes=2", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2"]
    command += [
        "hydra.launcher.timeout_min=10",
        f"hydra.launcher.name=submitit-{tmp_path.name}",
        f"hydra.sweep.dir={sweep}",
    ]
    done = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = list(csv.DictReader((sweep / "results.csv").open()))
    assert [(row["status"], row["world_size"], row["num_nodes"]) for row in rows] == [("completed", "2", "2")] * 2
    for job in ("0", "1"):
        ranks = json.loads((sweep / job / "provenance.json").read_text())["starts"][-1]["ranks"]
        assert [r["host"] for r in ranks] == ["n1", "n2"], job


# A search whose trials are SLURM jobs, two at a time, each taking a whole node (its 2 CPUs): 4000 steps a trial
# (20 epochs of 200), so that a node can be lost, or a trial requeued, in mid-trial.
SEARCH = [*TINY, *LONG, "hparams_search=optuna", "optimizer=sgd", "optimizer.lr=interval(0.005,0.02)"]
SEARCH += ["hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2", "hydra/launcher=submitit_slurm"]
SEARCH += ["hydra.launcher.cpus_per_task=2", "hydra.launcher.mem_gb=2", "hydra.launcher.timeout_min=10"]


def holder(job_dir: Path) -> dict:
    """Who runs job `job_dir` (experiments.run.lock's record: host, SLURM job); {} before it started."""
    try:
        return json.loads((job_dir / ".lock").read_text() or "{}")
    except (OSError, ValueError):
        return {}


@pytest.mark.slow
def test_a_search_across_two_nodes_survives_a_lost_node_and_a_requeue(tmp_path):
    """`hydra/launcher=submitit_slurm`: the trials run as SLURM jobs two at a time, on n1 and n2, one study in the
    sweep dir (Optuna's journal file, on the file system both nodes share). n2 lost in trial 0 or 1 (its slurmd and
    the trial's processes killed: the machine gone): SLURM requeues the job and the trial resumes from its last
    epoch's checkpoint. Trial 2 requeued by `scontrol requeue`: it resumes from the exact position its SIGTERM
    saved. The search waits through both and ends with 4 completed trials, results.csv agreeing."""
    import optuna  # a search's dependency: loaded by this test only

    sweep, name = tmp_path / "sweep", f"search-{tmp_path.name}"
    command = [sys.executable, "train.py", "-m", *SEARCH, f"hydra.launcher.name={name}", f"hydra.sweep.dir={sweep}"]
    with open(tmp_path / "search.log", "w") as log:
        driver = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT)
    said = lambda: (tmp_path / "search.log").read_text()[-3000:]  # noqa: E731
    try:
        on_node = lambda: {h.get("host"): n for n in (0, 1) if (h := holder(sweep / str(n)))}  # noqa: E731
        wait_until(lambda: len(on_node()) == 2 and last_epoch_checkpoint(sweep / str(on_node()["n2"])) > 0,
                   "trials 0 and 1 on n1 and n2, n2's past its first epoch")  # fmt: skip
        lost = on_node()["n2"]
        lost_job = holder(sweep / str(lost))["slurm_job"]
        os.kill(int((DIR / "slurmd-n2.pid").read_text()), signal.SIGKILL)
        for pid in job_pids(2):
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: job_record(lost_job).get("Restarts") == "1", "n2 DOWN and the trial's job requeued", 90)
        assert script("start").returncode == 0  # the node comes back
        wait_until(lambda: start_if_pending(lost_job) or metrics(sweep / str(lost)).get("status") == "completed",
                   "the lost trial resumed")  # fmt: skip

        wait_until(lambda: "train/loss" in logged_tags(sweep / "2"), "trial 2 training", 300)
        requeued_job = holder(sweep / "2")["slurm_job"]
        slurm("scontrol", "requeue", requeued_job)
        wait_until(lambda: metrics(sweep / "2").get("status") in ("interrupted", "completed"), "trial 2 stopped")
        interrupted = metrics(sweep / "2")
        assert interrupted["status"] == "interrupted", said()
        wait_until(lambda: start_if_pending(requeued_job) or driver.poll() is not None, "the search's end", 400)
    finally:
        if driver.poll() is None:
            driver.kill()
        slurm("scancel", "-n", name, check=False)
    assert driver.returncode == 0, said()

    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(sweep / "optuna.journal")))
    trials = optuna.load_study(study_name="gpu-lab", storage=storage).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 4, said()
    assert not (sweep / "optuna.db").exists()
    rows = {int(row["job"]): row for row in csv.DictReader((sweep / "results.csv").open())}
    assert [rows[t.number]["status"] for t in trials] == ["completed"] * 4
    assert [float(rows[t.number]["val_mse"]) for t in trials] == pytest.approx([t.value for t in trials])
    starts = {n: json.loads((sweep / str(n) / "provenance.json").read_text())["starts"] for n in range(4)}
    assert {starts[n][0]["ranks"][0]["host"] for n in (0, 1)} == {"n1", "n2"}
    assert len(starts[lost]) == 2 and starts[lost][1]["resumed_from"]["global_step"] % 200 == 0 < 4000
    assert starts[2][-1]["resumed_from"]["global_step"] == interrupted["global_step"]
    print(f"\nlost n2 in trial {lost} (SLURM job {lost_job}): resumed from step "
          f"{starts[lost][1]['resumed_from']['global_step']} on {starts[lost][1]['ranks'][0]['host']}; trial 2 "
          f"requeued at step {interrupted['global_step']}; values {[round(t.value, 6) for t in trials]}")
