"""A DDP rank that died mid-run: one line naming it, its host, the step, and the checkpoint to resume from.

When a rank dies (SIGKILL, the out-of-memory killer, a lost node), gloo raises in every other rank at its next
collective: "Connection closed by peer" or "Connection reset by peer", naming the peer's address, not its rank.
So each rank's host, addresses and pid are exchanged once, when training starts (distributed.nodes.RankHosts,
one all_gather beside the set-up, none in the steps), and the address in gloo's error is matched against them; on
this host, the rank whose process is gone is the lost one. The line's wording is stable (docs/failures.md):

    error: lost rank 1 of 2 (pid 4711 on node07) at step 57: Connection reset by peer; resume from
    D/checkpoints/last.ckpt (step 50): run the same command again
"""

import os
import re
import socket
from pathlib import Path

import torch

from experiments.run.exits import RunFailed

# gloo's words for a peer that went away (torch 2.x, gloo's tcp transport).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
PEER_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:(\d+)")


def peer_gone(err: BaseException) -> str | None:
    """gloo's words in `err` when it is the error for a lost peer (or this module's line, which keeps them)."""
    return next((words for words in PEER_GONE if words in str(err)), None)


def this_process() -> dict:
    """Who this rank is, as the others will name it: host, pid, and the addresses gloo may use for it."""
    host = socket.gethostname()
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        addresses = set()
    return {"host": host, "pid": os.getpid(), "addresses": sorted(addresses | local_addresses())}


def local_addresses() -> set[str]:
    """This network namespace's own IPv4 addresses (Linux: /proc/net/fib_trie): gloo may bind one that the host
    name does not resolve to (GLOO_SOCKET_IFNAME)."""
    try:
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
    except OSError:
        return set()
    return {lines[i - 1].split()[-1] for i, line in enumerate(lines) if i and line.strip() == "/32 host LOCAL"}


def saved_step(checkpoint: Path) -> int | None:
    """The step `checkpoint` holds, read from the file (the lost rank may have died while saving a newer one: the
    file on disk is the previous, whole one); None when there is none."""
    try:
        return int(torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=False)["global_step"])
    except (OSError, KeyError, RuntimeError):
        return None


def alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()  # a zombie has ended
    except FileNotFoundError:
        return False


class LostRank:
    """Turns gloo's error for a lost peer into a `RunFailed` line, naming the rank from `ranks` (every rank's host,
    pid and addresses, exchanged once when training starts: experiments.distributed.nodes.RankHosts)."""

    def __init__(self, checkpoint: Path):
        self.checkpoint = Path(checkpoint)
        self.ranks: list[dict] = []

    def error(self, err: BaseException, step: int) -> RunFailed | None:
        """The one-line error for `err`, met at `step`, when it is gloo's for a lost peer; None for any other error."""
        gone = peer_gone(err)
        if gone is None or len(self.ranks) < 2:
            return None
        found = PEER_ADDRESS.search(str(err))
        lost = self._lost_ranks(found.group(1) if found else None)
        who = " or ".join(f"rank {r} of {len(self.ranks)}" for r in lost) or "a rank"
        where = ", ".join(f"pid {self.ranks[r]['pid']} on {self.ranks[r]['host']}" for r in lost)
        if (saved := saved_step(self.checkpoint)) is not None:
            resume = f"resume from {self.checkpoint} (step {saved}): run the same command again"
        else:
            resume = "no checkpoint to resume from (none saved yet): the same command starts the run again"
        return RunFailed(f"lost {who} ({where or 'unknown'}) at step {step}: {gone}; {resume}")

    def _lost_ranks(self, address: str | None) -> list[int]:
        me = os.getpid()
        here = socket.gethostname()
        others = [r for r, rank in enumerate(self.ranks) if rank.get("pid") != me or rank.get("host") != here]
        if address is not None:
            loopback = address.startswith("127.") or address == "::1"
            at = [
                r for r in others
                if address in self.ranks[r]["addresses"] or (loopback and self.ranks[r]["host"] == here)
            ]  # fmt: skip
            others = at or others
        # On this host a lost rank's process is gone; on another, every rank there is a candidate.
        local = [r for r in others if self.ranks[r]["host"] == here]
        dead = [r for r in local if not alive(self.ranks[r]["pid"])]
        remote = [r for r in others if self.ranks[r]["host"] != here]
        return dead or remote or others
