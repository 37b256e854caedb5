"""DDP over two CPU processes against one process, at a small and a large global batch, in one script run.

    python scripts/ddp_cpu.py                 # batches 64 and 4096, 1000 features, 2 rounds (about 2 minutes)
    python scripts/ddp_cpu.py --rounds 1 --batches 256 8192

Each round is one Hydra sweep (`train.py -m data.batch_size=... trainer.devices=1,2`), so the single-process
and the DDP run of a batch run one after the other; the ratio DDP / single of steady-state throughput
(`samples_per_sec` in metrics.json, start-up excluded) is taken within a round, and the median over rounds
is reported. Set-up is the rest of `train()`'s wall time (data, process start and rendezvous).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from experiments.run.layout import RunPaths

ROOT = Path(__file__).resolve().parents[1]
PROBLEM = [
    "data.num_samples=20480",
    "data.num_features=1000",
    "trainer.max_steps=60",
    "trainer.limit_val_batches=0",
    "trainer.log_every_n_steps=10",
    "trainer.enable_progress_bar=false",
    "logger=none",
]


def sweep(batches: list[int], sweep_dir: Path) -> dict[tuple[int, int], dict]:
    """One round: metrics.json of each (batch, devices) job."""
    batch_list = ",".join(map(str, batches))
    command = [sys.executable, str(ROOT / "train.py"), "-m", *PROBLEM, f"data.batch_size={batch_list}"]
    command += ["trainer.devices=1,2", f"hydra.sweep.dir={sweep_dir}", "hydra/job_logging=stdout"]
    subprocess.run(command, check=True, capture_output=True, text=True)
    runs = {}
    for job in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        cfg = OmegaConf.load(RunPaths(job).hydra / "config.yaml")
        runs[cfg.data.batch_size, cfg.trainer.devices] = json.loads(RunPaths(job).metrics.read_text())
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 4096])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rounds = [sweep(args.batches, Path(tmp) / str(r)) for r in range(args.rounds)]
    print("| global batch | samples/s, 1 process | samples/s, DDP x2 | DDP / single | set-up s, 1 / DDP x2 |")
    print("|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        single = [r[batch, 1] for r in rounds]
        ddp = [r[batch, 2] for r in rounds]
        ratio = statistics.median(d["samples_per_sec"] / s["samples_per_sec"] for s, d in zip(single, ddp, strict=True))
        speed = [statistics.median(run["samples_per_sec"] for run in runs) for runs in (single, ddp)]
        # Set-up: train()'s wall time less the 60 steps at the steady-state step time (imports not counted).
        setup = [statistics.median(r["wall_time_s"] - 60 * r["step_time_ms"] / 1e3 for r in rs) for rs in (single, ddp)]
        print(f"| {batch} | {speed[0]:,.0f} | {speed[1]:,.0f} | {ratio:.2f} | {setup[0]:.1f} / {setup[1]:.1f} |")


if __name__ == "__main__":
    main()
