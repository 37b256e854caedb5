"""Ranks on several hosts: the address they meet at, the interface gloo's traffic takes, and where each rank ran.

Gloo binds each rank to the address its hostname resolves to unless GLOO_SOCKET_IFNAME names an interface. On a
node whose hostname resolves to 127.0.0.1 (a common /etc/hosts line), the other nodes are then told to connect
to loopback and the run hangs; with several interfaces, the wrong one may carry the gradients. So the interface
is the one this host reaches the master address through (the kernel's route, then `ip addr show to` for its
name), not a fixed name; on the master's own host, the interface holding its address, not loopback. Under SLURM
the master is the first host of the job's node list (`scontrol show hostnames`), as Lightning's SLURM environment
takes it; SLURM_LAUNCH_NODE_IPADDR is where srun ran, which need not be a node of the job.
"""

import ipaddress
import os
import socket
import subprocess

import torch
from lightning.pytorch.callbacks import Callback

from experiments.distributed.lost_rank import LostRank, this_process
from experiments.run import provenance
from experiments.run.layout import RunPaths
from experiments.training.last_checkpoint import LastCheckpoint


def _run(*command: str) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def master_address() -> str | None:
    """MASTER_ADDR as set (torchrun, or the user); in a SLURM job of several tasks, the node list's first host."""
    if "MASTER_ADDR" in os.environ:
        return os.environ["MASTER_ADDR"]
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if nodelist and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        hosts = _run("scontrol", "show", "hostnames", nodelist).split()
        return hosts[0] if hosts else None
    return None


def interface_to(address: str) -> str | None:
    """The interface whose address this host uses to reach `address` (its own, when `address` is this host)."""
    try:
        ip = socket.gethostbyname(address)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # UDP connect: a route lookup, no packet
            probe.connect((ip, 9))
            source = probe.getsockname()[0]
    except OSError:
        return None
    for line in _run("ip", "-o", "-4", "addr", "show", "to", source).splitlines():
        return line.split()[1]  # "2: eth0    inet 10.88.0.12/24 ..."
    return None


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except (OSError, ValueError):
        return False


def choose_interface() -> str | None:
    """Before the process group exists: MASTER_ADDR from the node list under SLURM, GLOO_SOCKET_IFNAME from the
    route to it, each unless already set. Returns the interface gloo will use (None: gloo's own choice)."""
    address = master_address()
    if address is None or ("MASTER_ADDR" in os.environ and _loopback(address)):
        return os.environ.get("GLOO_SOCKET_IFNAME")  # one host (Lightning's own launcher): gloo's choice, on every rank
    os.environ.setdefault("MASTER_ADDR", address)
    if "GLOO_SOCKET_IFNAME" not in os.environ and (interface := interface_to(address)) is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    return os.environ.get("GLOO_SOCKET_IFNAME")


class RankHosts(Callback):
    """Once the ranks have met, in one all_gather beside the set-up (none in the steps): every rank's host, node
    rank, interface, pid and addresses. The writing rank records host, node rank and interface in the start's
    provenance entry and the checkpoint's copy of it; every rank hands the whole list to `lost_rank`, which names
    a lost rank from it (experiments.distributed.lost_rank). No bound method of the recipe: ddp_spawn pickles the
    callbacks."""

    def __init__(self, paths: RunPaths, last_checkpoint: LastCheckpoint, lost_rank: LostRank) -> None:
        self.paths, self.last_checkpoint, self.lost_rank = paths, last_checkpoint, lost_rank

    def setup(self, trainer, pl_module, stage: str) -> None:
        me = {
            "rank": trainer.global_rank,
            "node_rank": trainer.node_rank,
            "interface": os.environ.get("GLOO_SOCKET_IFNAME"),
            **this_process(),
        }
        ranks = [me]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            ranks = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(ranks, me)
        self.lost_rank.ranks = ranks
        if trainer.is_global_zero:
            named = [{key: rank[key] for key in ("rank", "node_rank", "host", "interface")} for rank in ranks]
            provenance.record_ranks(self.paths, named)
            if (origin := self.last_checkpoint.record.get("provenance")) is not None:
                self.last_checkpoint.describe_origin({**origin, "ranks": named})  # the checkpoint names them too
