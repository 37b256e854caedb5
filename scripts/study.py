"""The seed's five pieces of advice as measured, re-runnable results: runs the study sweeps, writes docs/study.md.

    python scripts/study.py                    # every claim: about 13 minutes on 2 CPU cores
    python scripts/study.py --only batch       # one claim (transfer, batch, memory, scaling, accumulation,
                                               # target, batch_fit, models): its section replaced, the others kept

Each claim is one record of experiments.study.claims: its title, the seed's sentence, one or two Hydra multiruns
of conf/experiment/study_*.yaml (outputs/study/<time>/<sweep>/), read back through results.csv's sources
(sweeps.record), and its analysis. Each claim is one section of docs/study.md, between markers
(<!-- study:CLAIM begin --> ... end), that says which run wrote it; every conclusion in a section is computed from
the numbers of that run. Claims about GPUs are marked unverified unless a GPU ran them; with CUDA present the
sweeps add the GPU (and larger sizes).
"""

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from experiments.run.files import write_atomic
from experiments.study.claims import CLAIMS, NAMES, Sweep
from experiments.study.document import render_claim, render_short_of_gpus, splice
from experiments.sweeps.record import Job, find_jobs

ROOT = Path(__file__).resolve().parents[1]
GPUS = torch.cuda.device_count()


def run_sweep(sweep: Sweep, study_dir: Path, threads: int) -> tuple[list[Job], str]:
    """Runs one multirun; returns its jobs and the command as a user would type it."""
    sweep_dir = study_dir / sweep.name
    overrides = [*sweep.overrides, *(sweep.gpu_overrides if GPUS else ())]
    command = [sys.executable, "train.py", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"]
    sweep_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(sweep_dir / "sweep.log", "w") as log:
        env = os.environ | {"OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    typed = f"OMP_NUM_THREADS={threads} python train.py -m " + " ".join(f"'{o}'" if "(" in o else o for o in overrides)
    print(f"{sweep.name}: exit {done.returncode} in {time.perf_counter() - started:.0f} s ({sweep_dir})", flush=True)
    return find_jobs(sweep_dir), typed


def machine() -> str:
    gpu = ", ".join(torch.cuda.get_device_name(i) for i in range(GPUS)) or "none"
    return (
        f"{platform.machine()}, {os.cpu_count()} CPU cores, GPU: {gpu}; Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only",
        choices=NAMES,
        action="append",
        help="run these claims alone: their sections of --out are replaced, the others kept",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "study.md", help="the markdown file to write")
    parser.add_argument("--threads", type=int, default=1, help="intra-op CPU threads per process (default 1)")
    args = parser.parse_args()
    claims = {claim.name: claim for claim in CLAIMS}
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    study_dir = ROOT / "outputs" / "study" / stamp
    started = time.perf_counter()

    measured, new = {}, {}
    for claim in (claims[name] for name in args.only or NAMES):
        if GPUS < claim.min_gpus:
            new[claim.name] = render_short_of_gpus(claim, GPUS)
            continue
        results = [run_sweep(sweep, study_dir, args.threads) for sweep in claim.sweeps]
        found = claim.analysis([jobs for jobs, _ in results], args.out.parent / "study" / claim.name)
        measured[claim.name] = (claim, results, found)

    command = "python scripts/study.py" + "".join(f" --only {name}" for name in args.only or [])
    minutes = (time.perf_counter() - started) / 60
    run = (
        f"From the run of {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC (`{command}`, "
        f"{minutes:.1f} minutes) on: {machine()}; {args.threads} intra-op CPU thread{'s' if args.threads > 1 else ''} "
        f"per process; its sweep dirs under `outputs/study/{stamp}/`."
    )
    new |= {name: render_claim(*found, args.out.parent, run) for name, found in measured.items()}
    write_atomic(args.out, splice(args.out.read_text() if args.out.exists() else "", new))
    print(args.out)


if __name__ == "__main__":
    main()
