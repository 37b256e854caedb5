"""What produced a run: the code (git commit, and the uncommitted changes, saved beside the run), the package
versions, the command, the machine and the data's fingerprint (a hash of its file, or the generator's settings).

Each start that trains adds an entry to `<run dir>/provenance.json` (a resume on other code is a second entry
beside the first); the checkpoint carries its start's entry (run.last_checkpoint), so eval.json and predict.json
name what trained the model they used, and metrics.json and results.csv carry the commit. Collected once, by
the writing rank, in a background thread started with the run (git takes tens of milliseconds); nothing here
may fail a run: a probe that cannot answer gives null.
"""

import hashlib
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from datetime import datetime
from pathlib import Path

import hydra
import lightning
import torch
import torchmetrics
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from experiments.run.files import write_atomic
from experiments.run.layout import RunPaths

REPOSITORY = Path(__file__).resolve().parents[3]  # the code's own repository (installed editable), not the cwd
# Data settings that change how the data is fed, never its values: left out of the generator's fingerprint.
FEEDING = ("batch_size", "on_device", "pin_memory")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPOSITORY), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def code() -> tuple[dict, str | None]:
    """The commit, whether the tree differs from it, and the diff (None when clean or unknown)."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:  # not a git checkout (an installed wheel), or no git
        return {"repository": None, "commit": None, "dirty": None, "diff_sha256": None, "untracked": None}, None
    diff = _git("diff", "HEAD", "--binary") or ""
    untracked = (_git("ls-files", "--others", "--exclude-standard") or "").splitlines()
    return {
        "repository": str(REPOSITORY),
        "commit": commit.strip(),
        "dirty": bool(diff or untracked),
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
        "untracked": untracked,  # new files the diff does not hold: named, not saved
    }, diff or None


def versions() -> dict:
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),  # a TorchVersion, which torch.load(weights_only=True) refuses
        "lightning": str(lightning.__version__),
        "hydra": str(hydra.__version__),
        "torchmetrics": str(torchmetrics.__version__),
    }


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _gpu_driver() -> str | None:
    try:
        return Path("/proc/driver/nvidia/version").read_text().split("Kernel Module")[1].split()[0]
    except (OSError, IndexError):
        pass
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.split()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return None


def gpus() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    driver = _gpu_driver()
    found = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        memory, cuda = properties.total_memory // 2**20, str(torch.version.cuda)
        found.append({"name": properties.name, "memory_mib": memory, "driver": driver, "cuda": cuda})
    return found


def machine() -> dict:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "gpus": gpus(),
    }


def file_fingerprint(path: str | Path) -> dict:
    path = Path(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return {"path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def data_fingerprint(data_cfg: DictConfig | None) -> dict | None:
    if not data_cfg:
        return None
    settings = OmegaConf.to_container(data_cfg, resolve=True)
    if settings.get("path"):
        return {"file": file_fingerprint(settings["path"])}
    return {"generator": {k: v for k, v in settings.items() if k not in FEEDING}, "torch": str(torch.__version__)}


def command() -> dict:
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None
    return {"argv": shlex.join(sys.argv), "cwd": os.getcwd(), "overrides": overrides}


def collect(data_cfg: DictConfig | None) -> tuple[dict, str | None]:
    """(this start's provenance, the diff of uncommitted changes or None)."""
    found, diff = code()
    return {
        "started_at": datetime.now().astimezone().isoformat(timespec="seconds"),
        "code": found,
        "versions": versions(),
        "machine": machine(),
        "data": data_fingerprint(data_cfg),
    }, diff


def start_collecting(cfg: DictConfig) -> Future:
    """Collect in a thread, so that git and the data file's hash do not delay the run: (entry, diff). The
    command line is read here, where Hydra's config is."""
    started, data_cfg, entry = command(), cfg.get("data"), Future()

    def run() -> None:
        try:
            found, diff = collect(data_cfg)
            entry.set_result(({**found, "command": started}, diff))
        except BaseException as err:  # handed to whoever reads it
            entry.set_exception(err)

    threading.Thread(target=run, name="provenance", daemon=True).start()
    return entry


def record_start(paths: RunPaths, entry: dict, diff: str | None, resumed_from: dict | None) -> dict:
    """Add this start to `provenance.json` (and its diff beside it); returns the entry as recorded."""
    entry = {**entry, "resumed_from": resumed_from}
    if diff is not None:
        diff_file = paths.code_diff(entry["code"]["diff_sha256"])
        if not diff_file.exists():
            write_atomic(diff_file, diff)
        entry["code"] = {**entry["code"], "diff_file": diff_file.name}
    starts = json.loads(paths.provenance.read_text())["starts"] if paths.provenance.exists() else []
    write_atomic(paths.provenance, json.dumps({"starts": [*starts, entry]}, indent=2) + "\n")
    return entry


def code_fields(entry: dict | None) -> dict:
    """metrics.json's record of the code from a start's entry (None: not collected)."""
    code = (entry or {}).get("code") or {}
    return {"git_commit": code.get("commit"), "git_dirty": code.get("dirty")}


def record_ranks(paths: RunPaths, ranks: list[dict]) -> None:
    """Every rank's host, node rank and gloo interface, in this start's entry (known once the ranks have met)."""
    if not paths.provenance.exists():  # the start's entry could not be collected
        return
    starts = json.loads(paths.provenance.read_text())["starts"]
    starts[-1]["ranks"] = ranks
    write_atomic(paths.provenance, json.dumps({"starts": starts}, indent=2) + "\n")


def _describe(found: dict) -> str:
    if not found or found.get("commit") is None:
        return "unrecorded code"
    changes = " with uncommitted changes" if found.get("dirty") else ""
    return f"commit {found['commit'][:12]}{changes}"


def code_change(saved: dict | None, now: dict) -> str | None:
    """One line when a checkpoint saved by some code resumes with other code; None when it is the same."""
    before = (saved or {}).get("code") or {}
    after = now.get("code") or {}
    same = (before.get("commit"), before.get("diff_sha256")) == (after.get("commit"), after.get("diff_sha256"))
    if same and before.get("commit") is not None:
        return None
    if before.get("commit") is None and after.get("commit") is None:
        return None  # neither is known: nothing to compare
    return (
        f"note: resuming a checkpoint saved by {_describe(before)} with {_describe(after)}: the rest of the run "
        "is trained by other code (provenance.json records each start)"
    )
