"""Does the advice hold? `python advise.py OVERRIDES`, then its recommended command and the user's own as full
`python train.py` runs, interleaved (`--reps` pairs), and their measured speed-up against the predicted one.

    python scripts/advice_check.py                                  # the seed's Linear on this machine
    python scripts/advice_check.py model=mlp model.hidden=[1024,1024]
    python scripts/advice_check.py --reps 3 trainer.accelerator=gpu # scripts/gpu_check.sh's advice leg

Exit 1 when the predicted speed-up is not within 15% of the median measured ratio of the pairs, or the recommended
run's val_mse is not within the advice's stated tolerance of the user's.
"""

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AGREEMENT = 0.15  # the predicted speed-up within 15% of the measured one


def run(script: str, args: list[str], run_dir: Path) -> None:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, script, *args, f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode:
        sys.exit(f"error: {script} {shlex.join(args)} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    if script == "advise.py":
        print(done.stdout)
        print(f"python advise.py {shlex.join(args)}: {time.perf_counter() - start:.1f} s, the whole command\n")


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="pairs of full runs, interleaved")
    parser.add_argument("overrides", nargs="*", help="train.py overrides (advise.* too)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="advice-check-") as tmp:
        tmp = Path(tmp)
        run("advise.py", args.overrides, tmp / "advice")
        advice = json.loads((tmp / "advice" / "advice.json").read_text())
        yours, ours = shlex.split(advice["yours"])[2:], shlex.split(advice["command"])[2:]
        quiet = ["trainer.enable_progress_bar=false"]
        ratios, pairs = [], []
        for rep in range(args.reps):
            run("train.py", yours + quiet, tmp / f"yours-{rep}")
            run("train.py", ours + quiet, tmp / f"recommended-{rep}")
            pair = metrics(tmp / f"yours-{rep}"), metrics(tmp / f"recommended-{rep}")
            pairs.append(pair)
            ratios.append(pair[1]["samples_per_sec"] / pair[0]["samples_per_sec"])
    measured, predicted = statistics.median(ratios), advice["speedup"]
    agreement = abs(predicted / measured - 1)
    gaps = [abs(b["val_mse"] / a["val_mse"] - 1) for a, b in pairs]
    print(f"yours:       {advice['yours']}")
    print(f"recommended: {advice['command']}")
    for rep, (a, b) in enumerate(pairs):
        print(f"  pair {rep}: yours {a['samples_per_sec']:,.0f} samples/s (val_mse {a['val_mse']:.6g}), recommended "
              f"{b['samples_per_sec']:,.0f} samples/s (val_mse {b['val_mse']:.6g}): {ratios[rep]:.3f}x")  # fmt: skip
    held = agreement <= AGREEMENT and max(gaps) <= advice["val_mse_tolerance"]
    print(
        f"predicted speed-up {predicted:.3f}x, measured {measured:.3f}x (median of {args.reps} pairs, "
        f"{min(ratios):.3f}-{max(ratios):.3f}): {100 * agreement:.1f}% apart (target <= {100 * AGREEMENT:.0f}%); "
        f"val_mse {100 * max(gaps):.3g}% apart at most (tolerance {100 * advice['val_mse_tolerance']:g}%): "
        f"{'held' if held else 'MISSED'}"
    )
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
