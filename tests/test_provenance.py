"""Every run says what produced it: the code (commit, uncommitted changes saved beside it), the packages, the
command, the machine and the data; in provenance.json, metrics.json, results.csv and the checkpoint, and from
there in eval.json and predict.json. Each test runs the real commands in subprocesses."""

import csv
import hashlib
import json
import os
import platform
import signal
import socket
import subprocess
from pathlib import Path

import hydra
import lightning
import numpy as np
import pytest
import torch
import torchmetrics
from background import start_train, wait_for
from conftest import ROOT, TINY, cli, python
from faults import saved, starts


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
def test_a_sweep_job_from_a_dirty_checkout_records_its_code_packages_command_machine_and_data(tmp_path):
    # A clone of this commit, changed and not committed, run with its own code (PYTHONPATH before the install).
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--no-checkout", str(ROOT), str(clone)], check=True)
    git(clone, "checkout", "--quiet", git(ROOT, "rev-parse", "HEAD").strip())
    (clone / "README.md").write_text((clone / "README.md").read_text() + "\nA change not committed.\n")
    (clone / "notes.txt").write_text("a new file\n")
    sweep = tmp_path / "sweep"
    command = [python(), "train.py", "-m", *TINY, "seed=0", f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, "PYTHONPATH": str(clone / "src")}
    done = subprocess.run(command, cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    job = sweep / "0"
    [entry] = starts(job)
    code = entry["code"]
    assert code["repository"] == str(clone) and code["commit"] == git(clone, "rev-parse", "HEAD").strip()
    assert code["dirty"] is True and code["untracked"] == ["notes.txt"]
    assert (job / code["diff_file"]).read_text() == git(clone, "diff", "HEAD", "--binary")
    assert code["diff_sha256"] == hashlib.sha256((job / code["diff_file"]).read_bytes()).hexdigest()
    assert entry["versions"] == {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "lightning": lightning.__version__,
        "hydra": hydra.__version__,
        "torchmetrics": torchmetrics.__version__,
    }
    assert f"hydra.sweep.dir={sweep}" in entry["command"]["argv"] and entry["command"]["cwd"] == str(clone)
    assert "seed=0" in entry["command"]["overrides"]
    machine = entry["machine"]
    assert machine["host"] == socket.gethostname() and machine["cpu_count"] == os.cpu_count()
    assert machine["cpu"] and machine["gpus"] == ([] if not torch.cuda.is_available() else machine["gpus"])
    generator = entry["data"]["generator"]
    assert generator["num_samples"] == 640 and generator["num_features"] == 8 and generator["seed"] == 0
    assert entry["resumed_from"] is None

    metrics = json.loads((job / "metrics.json").read_text())
    assert metrics["git_commit"] == code["commit"] and metrics["git_dirty"] is True
    assert saved(job)["run"]["provenance"] == entry  # the checkpoint carries it
    [row] = list(csv.DictReader((sweep / "results.csv").open()))
    assert row["git_commit"] == code["commit"] and row["git_dirty"] == "True"


@pytest.mark.slow
def test_eval_and_predict_name_the_checkpoint_and_what_trained_it(tmp_path):
    data = tmp_path / "train.csv"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 3))
    rows = [f"{a:.6f},{b:.6f},{c:.6f},{a - 2 * b + c:.6f}" for a, b, c in x]
    data.write_text("a,b,c,y\n" + "\n".join(rows) + "\n")
    run_dir = tmp_path / "run"
    assert cli("data=file", f"data.path={data}", "data.batch_size=64", f"hydra.run.dir={run_dir}").returncode == 0
    [entry] = starts(run_dir)
    assert entry["data"]["file"] == {
        "path": str(data),
        "bytes": data.stat().st_size,
        "sha256": hashlib.sha256(data.read_bytes()).hexdigest(),
    }

    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    for command, args in [("eval.py", []), ("predict.py", [f"data.path={data}"])]:
        out = tmp_path / command
        done = subprocess.run([python(), command, f"ckpt_path={checkpoint}", *args, f"hydra.run.dir={out}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        record = json.loads((out / f"{command.removesuffix('.py')}.json").read_text())
        assert record["checkpoint"] == str(checkpoint) and record["checkpoint_provenance"] == entry
    predicted = json.loads((tmp_path / "predict.py" / "predict.json").read_text())
    assert predicted["input"] == entry["data"]["file"] and predicted["rows"] == 400
    assert predicted["predictions"] == "predictions.csv"
    scored = json.loads((tmp_path / "eval.py" / "eval.json").read_text())
    assert scored["data"]["fingerprint"] == entry["data"]


@pytest.mark.slow
def test_a_resume_on_other_code_says_so_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    args = ["trainer.max_epochs=40", f"hydra.run.dir={run_dir}"]
    stopped = start_train(*args, log=tmp_path / "stopped.log")
    wait_for(lambda: saved(run_dir) is not None, "the first checkpoint", stopped)
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(timeout=300) == 128 + signal.SIGTERM
    # The checkpoint as other code would have saved it: another commit in its record.
    checkpoint = saved(run_dir)
    checkpoint["run"]["provenance"]["code"] |= {"commit": "0" * 40, "dirty": False, "diff_sha256": None}
    torch.save(checkpoint, run_dir / "checkpoints" / "last.ckpt")

    resumed = cli(*args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    [note] = [line for line in resumed.stderr.splitlines() if line.startswith("note:")]
    now = starts(run_dir)[1]["code"]
    assert note.startswith("note: resuming a checkpoint saved by commit 000000000000 with ")
    assert f"commit {now['commit'][:12]}" in note and "provenance.json records each start" in note
    assert starts(run_dir)[1]["resumed_from"]["global_step"] == checkpoint["global_step"]
