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
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, compose_config, logged_tags

from experiments.commands.train import train

pytestmark = pytest.mark.slurm
DIR = Path(os.environ.get("GPU_LAB_SLURM_2NODES_DIR", "/tmp/gpu-lab-slurm-2nodes"))
NETNS, VETH = os.environ.get("GPU_LAB_NETNS", "glab-n"), os.environ.get("GPU_LAB_VETH", "glab-v")
NODE_ADDRESS = {"n1": os.environ.get("GPU_LAB_NET", "10.88.0") + ".11"}


def env() -> dict:
    return {**os.environ, "SLURM_CONF": str(DIR / "slurm.conf"), "GPU_LAB_SLURM_DIR": str(DIR)}


def script(*args: str) -> subprocess.CompletedProcess:
    command = ["scripts/local_slurm.sh", *args, "--nodes", "2"]
    return subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module", autouse=True)
def cluster():
    reason = None
    if (check := script("check")).returncode != 0:
        reason = check.stderr.strip().removeprefix("error: ")
    elif script("status").returncode != 0:
        reason = f"no two-node cluster in {DIR} (scripts/local_slurm.sh start --nodes 2, GPU_LAB_SLURM_2NODES_DIR)"
    if reason is not None:
        if os.environ.get("GPU_LAB_REQUIRE_MULTINODE"):
            pytest.fail(f"GPU_LAB_REQUIRE_MULTINODE=1 but {reason}")
        pytest.skip(reason)


def slurm(*command: str, check: bool = True) -> str:
    done = subprocess.run(command, env=env(), capture_output=True, text=True, timeout=60, check=check)
    return done.stdout.strip()


def submit(tmp_path: Path, name: str, *args: str, nodes: int = 2, tasks: int = 1) -> str:
    command = ["sbatch", "--parsable", f"--job-name={name}", f"--output={tmp_path}/{name}-%j.out"]
    command += [f"--nodes={nodes}", f"--ntasks-per-node={tasks}", "scripts/slurm.sbatch", "trainer.accelerator=cpu"]
    command += [*TINY, *args, f"hydra.run.dir={tmp_path / name}"]
    done = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip().split(";")[0]


def state(job: str) -> str:
    return slurm("squeue", "-h", "-j", job, "-o", "%T", check=False)  # "" once the job has left the queue


def wait_until(condition, what: str, timeout: float = 240) -> float:
    """Seconds until `condition` held."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"{what}: not after {timeout} s"
        time.sleep(0.25)
    return time.monotonic() - started


def metrics(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        return {}


def final_weights(run_dir: Path) -> dict:
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    return {**checkpoint["state_dict"], "global_step": torch.tensor(checkpoint["global_step"])}


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


@pytest.mark.parametrize("tasks", [1, 2])
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
