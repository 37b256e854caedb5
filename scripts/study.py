"""The seed's five pieces of advice as measured, re-runnable results: runs the study sweeps, writes docs/study.md.

    python scripts/study.py                    # every claim: about 10 minutes on 2 CPU cores
    python scripts/study.py --only batch       # one claim (transfer, batch, memory, scaling, accumulation,
                                               # target, batch_fit): its section replaced, the others kept

Each claim is one or two Hydra multiruns of conf/experiment/study_*.yaml (outputs/study/<time>/<claim>/),
read back through results.csv's sources (sweeps.record) and drawn with sweeps.report. Each claim is
one section of docs/study.md, between markers (<!-- study:CLAIM begin --> ... end), that says which run wrote
it; every conclusion in a section is computed from the numbers of that run. Claims about GPUs are marked
unverified unless a GPU ran them; with CUDA present the sweeps add the GPU (and larger sizes).
"""

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from experiments.run.files import write_atomic  # noqa: E402
from experiments.run.layout import RunPaths  # noqa: E402
from experiments.sweeps.record import Job, find_jobs  # noqa: E402
from experiments.sweeps.report import (  # noqa: E402
    Section,
    accumulation_section,
    completed,
    log2_axis,
    markdown_table,
    median_of_repeats,
    memory_section,
    save,
    scaling_section,
    speedup_section,
    throughput_section,
    time_to_target_section,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GPUS = torch.cuda.device_count()


@dataclass
class Sweep:
    name: str
    overrides: list[str]
    gpu_overrides: list[str]  # added when CUDA is there


# The seed's advice (shared/seed/, in Chinese), in English.
SEED_SAYS = {
    "transfer": "Moving data from the CPU to the GPU has a cost: small models or small batches may see no "
    "clear speed-up; larger models and data gain more.",
    "batch": "Use batches as far as possible, to make the most of the GPU's parallel computation.",
    "memory": "GPU memory is limited: manage it so that it does not overflow.",
    "scaling": "PyTorch can compute in parallel on several GPUs, with torch.nn.DataParallel or "
    "torch.nn.parallel.DistributedDataParallel.",
    "accumulation": "Accumulating the gradients of several small batches before one parameter update "
    "relieves the pressure on GPU memory.",
    "target": "(not the seed's: what a user wants from faster training) Time to reach a given quality, "
    "against batch size and accumulation.",
    "batch_fit": "(its advice on memory and on accumulation, as one option) At a fixed effective batch, the "
    "micro-batch trades memory against speed: batch.effective=E picks the largest whose step fits the budget.",
}

SWEEPS = {
    "transfer": [
        Sweep("transfer", ["experiment=study_transfer"], ["trainer.accelerator=cpu,gpu", "data.on_device=false,true"])
    ],
    "batch": [Sweep("batch", ["experiment=study_batch"], ["trainer.accelerator=gpu", "data.num_features=1000"])],
    "memory": [Sweep("memory", ["experiment=study_memory"], ["trainer.accelerator=gpu"])],
    # Several GPUs only: on a CPU the one account of DDP is the benchmark's (CPU_SCALING below).
    "scaling": [
        Sweep("scaling", ["experiment=study_scaling"], ["trainer.accelerator=gpu"]),
        Sweep("scaling-dp", ["experiment=study_scaling", "strategy=dp"], ["trainer.accelerator=gpu"]),
    ]
    * (GPUS >= 2),
    "accumulation": [
        # in a process of its own per job (the experiment's launcher): each job's own peak memory
        Sweep(
            "accumulation-memory",
            ["experiment=glob(study_accumulation_b*)", "hydra/launcher=submitit_local"],
            ["trainer.accelerator=gpu"],
        ),
        # one after another in one process: throughput without neighbours
        Sweep(
            "accumulation-speed", ["seed=0,1,2", "experiment=glob(study_accumulation_b*)"], ["trainer.accelerator=gpu"]
        ),
    ],
    "target": [Sweep("target", ["experiment=study_target"], ["trainer.accelerator=gpu"])],
    # On a GPU the 160 MiB of data stays on the host: the budgets are for the step alone.
    "batch_fit": [
        Sweep(
            "batch_fit-memory",
            ["experiment=study_batch_fit", "hydra/launcher=submitit_local"],
            ["trainer.accelerator=gpu", "data.on_device=false"],
        ),
        Sweep(
            "batch_fit-speed",
            ["seed=0,1,2", "experiment=study_batch_fit"],
            ["trainer.accelerator=gpu", "data.on_device=false"],
        ),
    ],
}


def run_sweep(sweep: Sweep, study_dir: Path, threads: int) -> tuple[list[Job], str]:
    """Runs one multirun; returns its jobs and the command as a user would type it."""
    sweep_dir = study_dir / sweep.name
    overrides = sweep.overrides + (sweep.gpu_overrides if GPUS else [])
    command = [sys.executable, "train.py", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"]
    sweep_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(sweep_dir / "sweep.log", "w") as log:
        env = os.environ | {"OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    typed = f"OMP_NUM_THREADS={threads} python train.py -m " + " ".join(f"'{o}'" if "(" in o else o for o in overrides)
    print(f"{sweep.name}: exit {done.returncode} in {time.perf_counter() - started:.0f} s ({sweep_dir})", flush=True)
    return find_jobs(sweep_dir), typed


def ratio_text(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


# Each claim: (sections, conclusion lines, verified-on line) from its jobs.


def transfer_claim(jobs: list[Job], out: Path) -> tuple[list[Section], list[str], str]:
    done = completed(jobs)
    rows = []
    for j in done:
        m = j.metrics
        rows.append(
            {
                "num_features": int(j.settings["data.num_features"]),
                "global_batch_size": m["global_batch_size"],
                "accelerator": m["accelerator"],
                "data_device": m.get("data_device", "?"),
                "step_time_ms": m["step_time_ms"],
                "transfer_ms": m.get("transfer_ms", 0.0),
                "transfer_share_pct": 100 * m.get("transfer_ms", 0.0) / m["step_time_ms"],
                "us_per_sample": 1e3 * m["step_time_ms"] / m["global_batch_size"],
            }
        )
    section = Section("Step time: host-to-device copy and the rest", columns=list(rows[0]) if rows else [], rows=rows)
    lines = []
    if rows:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        labels = [f"d={r['num_features']}, B={r['global_batch_size']}\n{r['accelerator']}, data on {r['data_device']}"
                  for r in rows]  # fmt: skip
        copy = [r["transfer_ms"] for r in rows]
        rest = [r["step_time_ms"] - r["transfer_ms"] for r in rows]
        ax.bar(labels, copy, label="host-to-device copy")
        ax.bar(labels, rest, bottom=copy, label="rest of the step")
        ax.set(title="Time per training step: copy vs compute", ylabel="time per step (ms)",
               xlabel="model width d (features), global batch B, device, where the data lives")  # fmt: skip
        ax.tick_params(axis="x", labelsize="x-small")
        ax.legend()
        section.plot = save(fig, out / "transfer.png")
        cpu = {(r["num_features"], r["global_batch_size"]): r for r in rows if r["accelerator"] == "cpu"}
        for d in sorted({r["num_features"] for r in cpu.values()}):
            batches = sorted(b for dd, b in cpu if dd == d)
            if len(batches) > 1:
                small, large = cpu[(d, batches[0])], cpu[(d, batches[-1])]
                lines.append(
                    f"CPU, d={d}: {small['us_per_sample']:.3g} µs per sample at B={batches[0]} against "
                    f"{large['us_per_sample']:.3g} µs at B={batches[-1]} "
                    f"({ratio_text(small['us_per_sample'], large['us_per_sample'])} more per sample in small batches)."
                )
        lines.append(
            f"On the CPU no copy happens: transfer_ms is at most {max(r['transfer_ms'] for r in cpu.values()):.3g} ms "
            "per step."
            if cpu
            else "No CPU job completed."
        )
        gpu = [r for r in rows if r["accelerator"] == "cuda"]
        for r in gpu:
            base = cpu.get((r["num_features"], r["global_batch_size"]))
            speedup = f", {ratio_text(base['step_time_ms'], r['step_time_ms'])} faster than the CPU" if base else ""
            lines.append(
                f"GPU, d={r['num_features']}, B={r['global_batch_size']}, data on {r['data_device']}: the copy is "
                f"{r['transfer_share_pct']:.3g}% of a {r['step_time_ms']:.3g} ms step{speedup}."
            )
    verified = "GPU: measured." if any(r["accelerator"] == "cuda" for r in rows) else (
        "**GPU: unverified** (no GPU ran this study): the copy to a GPU and the GPU speed-up were not measured; "
        "the CPU rows show the fixed cost per step that makes a small model gain little."
    )  # fmt: skip
    return [section], lines, verified


def by_series(section: Section, y: str) -> dict[str, list[tuple]]:
    """(global batch size, y) of each series of a section's table, in the table's order."""
    labels = dict.fromkeys(r["series"] for r in section.rows)
    return {label: [(r["global_batch_size"], r[y]) for r in section.rows if r["series"] == label] for label in labels}


def batch_claim(jobs: list[Job], out: Path) -> tuple[list[Section], list[str], str]:
    section = throughput_section(jobs, out)
    lines = []
    for label, points in by_series(section, "samples_per_sec").items():
        (b0, s0), (b1, s1) = points[0], points[-1]
        best_b, best_s = max(points, key=lambda p: p[1])
        near = min(b for b, s in points if s >= 0.9 * best_s)
        lines.append(
            f"{label}: {s0:.3g} samples/s at B={b0}, {s1:.3g} at B={b1} ({ratio_text(s1, s0)}); the most, "
            f"{best_s:.3g} samples/s, at B={best_b}; within 10% of it from B={near}."
        )
    return [section], lines, gpu_line(jobs, "the GPU's throughput against batch size")


def memory_claim(jobs: list[Job], out: Path) -> tuple[list[Section], list[str], str]:
    section = memory_section(jobs, out)
    lines = []
    for label, points in by_series(section, "peak_memory_mb").items():
        (b0, m0), (b1, m1) = points[0], points[-1]
        width = int(next(j for j in jobs if j.status == "completed").settings["data.num_features"])
        per_sample = (m1 - m0) * 2**20 / (b1 - b0)
        lines.append(
            f"{label}: peak {m0:.4g} MiB at B={b0}, {m1:.4g} MiB at B={b1} (+{m1 - m0:.3g} MiB): about "
            f"{per_sample:.3g} bytes per extra sample in a batch, against the {4 * width} bytes of its "
            f"{width} float32 features."
        )
    cpu_note = " On the CPU, peak memory is the process's peak resident set during training."
    return [section], [*lines, cpu_note.strip()], gpu_line(jobs, "GPU memory")


# With fewer than two GPUs the study runs no sweep of its own for claim d: DDP on a CPU has one account, the
# benchmark's (whole processes, an expert's raw DDP loop beside it, the all-reduce timed alone), which a 60-step
# sweep here would only contradict.
CPU_SCALING = """## {title}

The seed: *{seed}*

GPUs on the machine that wrote this: {gpus}, so no DataParallel here, nor DDP across GPUs. DDP on a CPU (two processes
over gloo) is measured once, in [benchmarks.md](benchmarks.md#ddp-on-cpu) (`python scripts/benchmark.py --ddp`): one
process, `trainer.devices=2` and an expert's raw DDP loop side by side at a small and a large batch, per step from
whole processes, with a gloo all_reduce of the seed's gradients timed alone, which says when two CPU processes pay
and when they cannot.

CPU: DDP measured in benchmarks.md. **GPU: unverified**: DataParallel needs CUDA, and DDP across GPUs needs two
(`scripts/gpu_check.sh` times DDP x2 against raw DDP x2 over NCCL where two are present; `python scripts/study.py
--only scaling` runs this claim's sweeps there).
"""


def scaling_claim(jobs: list[Job], out: Path) -> tuple[list[Section], list[str], str]:
    speedup, scaling = speedup_section(jobs, out), scaling_section(jobs, out)
    lines = [
        f"{r['series']}: {r['samples_per_sec']:.3g} samples/s on {r['devices']} devices against "
        f"{r['single_device_samples_per_sec']:.3g} on one: {r['speedup']:.2f}x, {r['efficiency_pct']:.3g}% "
        "scaling efficiency."
        for r in scaling.rows
    ]
    if any(r["efficiency_pct"] > 110 for r in scaling.rows):
        lines.append(
            "An efficiency above 100% cannot come from the devices themselves: the one-device job of that row was "
            "slowed by other load on this machine while it ran. Re-run the study on an idle machine."
        )
    failed = [j for j in jobs if j.status != "completed"]
    lines += [f"Job {j.num} ({' '.join(j.overrides)}) {j.status}: {j.error or 'see its metrics.json'}" for j in failed]
    if not scaling.rows:
        lines.append("No multi-device job completed beside a one-device job: nothing to compare.")
    lines.append(
        "These sweeps are short (60 steps, start-up excluded). DDP on a CPU is measured once, in docs/benchmarks.md, "
        "section 'DDP on CPU' (`python scripts/benchmark.py --ddp`)."
    )
    return [speedup, scaling], lines, f"GPU: measured on {GPUS} GPUs."


def accumulation_claim(memory_jobs: list[Job], speed_jobs: list[Job], out: Path):
    """Memory from the jobs that ran in processes of their own; speed and results from the sequential ones."""
    peak = {j.settings.get("trainer.accumulate_grad_batches"): j.metrics.get("peak_memory_mb") for j in memory_jobs}
    merged = [
        replace(j, metrics=j.metrics | {"peak_memory_mb": peak.get(j.settings.get("trainer.accumulate_grad_batches"))})
        for j in completed(speed_jobs)
        if peak.get(j.settings.get("trainer.accumulate_grad_batches")) is not None
    ]
    section = accumulation_section(merged, out)
    lines = []
    by_acc = {j.metrics["accumulate_grad_batches"]: j for j in merged}
    if 1 in by_acc and len(by_acc) > 1:
        one = by_acc[1]
        w_one = final_weights(one)
        for acc, j in sorted(by_acc.items()):
            if acc == 1:
                continue
            m, m1 = j.metrics, one.metrics
            diff = (final_weights(j) - w_one).norm() / w_one.norm()
            lines.append(
                f"{acc} x {m['global_batch_size']} against 1 x {m1['global_batch_size']} (effective batch "
                f"{m['effective_batch_size']}): final weights differ by {diff:.2g} (relative), val MSE "
                f"{m['val_mse']:.6g} vs {m1['val_mse']:.6g}; peak memory {m['peak_memory_mb']:.4g} vs "
                f"{m1['peak_memory_mb']:.4g} MiB ({m['peak_memory_mb'] - m1['peak_memory_mb']:+.3g} MiB); "
                f"throughput {m['samples_per_sec']:.3g} vs {m1['samples_per_sec']:.3g} samples/s "
                f"({ratio_text(m['samples_per_sec'], m1['samples_per_sec'])})."
            )
    else:
        lines.append("No accumulation job completed beside the 1-step baseline: nothing to compare.")
    return [section], lines, gpu_line(merged, "GPU memory and speed")


def target_claim(jobs: list[Job], out: Path) -> tuple[list[Section], list[str], str]:
    section = time_to_target_section(jobs, out)
    done = [j for j in completed(jobs) if j.metrics.get("time_to_target_s") is not None]
    missed = [j for j in completed(jobs) if j.metrics.get("time_to_target_s") is None]
    lines = []
    if done:
        fastest = max(done, key=lambda j: j.metrics["samples_per_sec"])
        soonest = min(done, key=lambda j: j.metrics["time_to_target_s"])
        for name, j in (("The most samples per second", fastest), ("The least time to the target", soonest)):
            m = j.metrics
            lines.append(
                f"{name}: B={m['global_batch_size']} x {m['accumulate_grad_batches']} (effective "
                f"{m['effective_batch_size']}), {m['samples_per_sec']:.3g} samples/s, target in "
                f"{m['time_to_target_s']:.3g} s, {m['steps_to_target']} optimizer steps, "
                f"{m['epochs_to_target']:.3g} epochs; "
                f"{100 * m['compute_ms'] / m['step_time_ms']:.3g}% of a step compute."
            )
        if fastest is not soonest:
            ratio = fastest.metrics["time_to_target_s"] / soonest.metrics["time_to_target_s"]
            lines.append(f"The highest throughput took {ratio:.2f}x the least time to reach the target.")
    lines += [
        f"Effective batch {j.metrics['effective_batch_size']} ({' '.join(j.overrides)}): not within the target "
        f"in {j.metrics['epochs']} epochs."
        for j in missed
    ]
    return [section], lines, gpu_line(jobs, "the GPU's time to target")


def batch_fit_claim(memory_jobs: list[Job], speed_jobs: list[Job], out: Path):
    """At one effective batch: the micro-batch that each budget got, its optimizer step's time, throughput and peak
    memory (from the jobs in processes of their own), and the default budget's pick among them."""
    peak = {j.settings.get("batch.memory_mb"): j.metrics.get("peak_memory_mb") for j in completed(memory_jobs)}
    rows = []
    for j in sorted(completed(speed_jobs), key=lambda j: (j.metrics["batch_fit"]["micro_batch"], j.num)):
        m, fitted = j.metrics, j.metrics["batch_fit"]
        budget = j.settings.get("batch.memory_mb")
        rows.append({
            "budget": "default" if budget == "None" else f"{budget} MiB",
            "budget_mb": fitted["budget_mb"],
            "micro_batch": fitted["micro_batch"],
            "accumulate_grad_batches": m["accumulate_grad_batches"],
            "optimizer_step_ms": m["step_time_ms"] * m["accumulate_grad_batches"],
            "samples_per_sec": m["samples_per_sec"],
            "peak_memory_mb": peak.get(budget),
            "bytes_per_sample": fitted["bytes_per_sample"],
            "job": j,
        })  # fmt: skip
    columns = [c for c in (rows[0] if rows else {}) if c != "job"]
    section = Section("Step time, throughput and peak memory against the micro-batch", columns=columns, rows=rows)
    if not rows:
        return [section], ["No batch_fit job completed: nothing to compare."], gpu_line(speed_jobs, "GPU memory")
    pick = next((r for r in rows if r["budget"] == "default"), None)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    for ax, key, label in zip(
        axes,
        ("optimizer_step_ms", "samples_per_sec", "peak_memory_mb"),
        ("time of one optimizer step (ms)", "throughput (samples/s)", "peak memory (MiB)"),
        strict=True,
    ):
        points = [(r["micro_batch"], r[key]) for r in rows if r["budget"] != "default" and r[key] is not None]
        ax.plot(*zip(*points, strict=True), marker="o", label="batch.memory_mb budgets")
        if pick and pick[key] is not None:
            ax.plot([pick["micro_batch"]], [pick[key]], marker="*", markersize=14, linestyle="", label="default pick")
        log2_axis(ax)
        ax.set(xlabel="micro-batch per rank (samples)", ylabel=label)
        ax.tick_params(axis="x", labelsize="small")
    axes[0].legend()
    effective = rows[0]["job"].metrics["effective_batch_size"]
    fig.suptitle(
        f"One effective batch of {effective} (accumulation = {effective} / micro-batch): what the micro-batch costs "
        "and what batch.effective picks"
    )
    section.plot = save(fig, out / "batch_fit.png")
    lines = []
    fastest = max(rows, key=lambda r: r["samples_per_sec"])
    small, large = rows[0], max(rows, key=lambda r: r["micro_batch"])
    lines.append(
        f"Effective batch {effective}: {small['micro_batch']} x {small['accumulate_grad_batches']} runs "
        f"{small['samples_per_sec']:.3g} samples/s, {large['micro_batch']} x {large['accumulate_grad_batches']} "
        f"{large['samples_per_sec']:.3g} ({ratio_text(large['samples_per_sec'], small['samples_per_sec'])}); the "
        f"most, {fastest['samples_per_sec']:.3g} samples/s, at a micro-batch of {fastest['micro_batch']}."
    )
    measured = [(r["micro_batch"], r["peak_memory_mb"] * 2**20) for r in rows if r["peak_memory_mb"] is not None]
    if len({x for x, _ in measured}) > 1:
        slope = statistics.linear_regression(*zip(*measured, strict=True)).slope  # least squares over every row
        lines.append(
            f"Peak memory (the process's, a process a job) {small['peak_memory_mb']:.4g} MiB at a micro-batch of "
            f"{small['micro_batch']}, {large['peak_memory_mb']:.4g} MiB at {large['micro_batch']}: {slope:.4g} "
            f"bytes a sample (least squares over the rows): {slope / large['bytes_per_sample']:.3g} x the "
            f"{large['bytes_per_sample']:.4g} bytes of the step's tensors that the probe counts."
        )
    over = [r for r in rows if r["micro_batch"] * r["bytes_per_sample"] > r["budget_mb"] * 2**20]
    lines.append(
        "Every budget's micro-batch fits it: micro-batch x bytes a sample is within the budget in every row."
        if not over
        else f"{len(over)} rows hold a micro-batch over their budget: " + ", ".join(r["budget"] for r in over)
    )
    if pick:
        share = 100 * pick["samples_per_sec"] / fastest["samples_per_sec"]
        settings = pick["job"].settings
        if pick["job"].metrics["accelerator"] == "cuda":
            default = f"the GPU's free memory less {float(settings['batch.gpu_margin']):.0%} of it"
        else:
            default = f"{float(settings['batch.cpu_share']):.0%} of the host's available memory"
        lines.append(
            f"The default budget ({pick['budget_mb']:,.0f} MiB: {default}) picks {pick['micro_batch']} x "
            f"{pick['accumulate_grad_batches']}, {pick['samples_per_sec']:.3g} samples/s: {share:.3g}% of the "
            "fastest row."
        )
        reference = final_weights(pick["job"])
        worst = max(((final_weights(r["job"]) - reference).norm() / reference.norm()).item() for r in rows)
        lines.append(
            f"The same result: every row's final weights are within {worst:.2g} (relative) of the default pick's."
        )
        if fastest["micro_batch"] != pick["micro_batch"]:
            lines.append(
                f"The option maximises the micro-batch within the budget, not the speed: here a micro-batch of "
                f"{fastest['micro_batch']} runs {ratio_text(fastest['samples_per_sec'], pick['samples_per_sec'])} "
                f"the pick's throughput; batch.memory_mb caps the micro-batch where a smaller one is faster."
            )
        twins = [r for r in rows if r is not pick and r["micro_batch"] == pick["micro_batch"]]
        for twin in twins:
            gap = abs(twin["samples_per_sec"] / pick["samples_per_sec"] - 1)
            lines.append(
                f"The {twin['budget']} row ran what the default ran ({pick['micro_batch']} x "
                f"{pick['accumulate_grad_batches']}): their throughputs differ by {100 * gap:.2g}%, the noise of "
                "this machine between two runs of one configuration."
            )
    for r in rows:
        r.pop("job")
    return [section], lines, gpu_line(speed_jobs, "GPU memory and speed against the micro-batch")


def final_weights(job: Job) -> torch.Tensor:
    state = torch.load(RunPaths(job.dir).last_checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    return torch.cat([state["net.weight"].flatten(), state["net.bias"].flatten()]).double()


def gpu_line(jobs: list[Job], what: str) -> str:
    if any(j.metrics.get("accelerator") == "cuda" for j in completed(jobs)):
        return "GPU: measured."
    return f"CPU: measured. **GPU: unverified** ({what} not measured: no GPU ran this study)."


TITLES = {
    "transfer": "(a) Host-to-device transfer overhead",
    "batch": "(b) Batch size and throughput",
    "memory": "(c) Memory and batch size",
    "scaling": "(d) One device, DataParallel and DDP",
    "accumulation": "(e) Gradient accumulation",
    "target": "(f) Time to target against batch size and accumulation",
    "batch_fit": "(g) The largest micro-batch that fits, accumulated to the effective batch",
}


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
        choices=list(SWEEPS),
        action="append",
        help="run these claims alone: their sections of --out are replaced, the others kept",
    )
    parser.add_argument("--out", type=Path, default=DOCS / "study.md", help="the markdown file to write")
    parser.add_argument("--threads", type=int, default=1, help="intra-op CPU threads per process (default 1)")
    args = parser.parse_args()
    claims = args.only or list(SWEEPS)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    study_dir = ROOT / "outputs" / "study" / stamp
    started = time.perf_counter()

    sections, new = {}, {}
    for claim in claims:
        if claim == "scaling" and GPUS < 2:
            new[claim] = CPU_SCALING.format(title=TITLES[claim], seed=SEED_SAYS[claim], gpus=GPUS)
            continue
        results = [run_sweep(sweep, study_dir, args.threads) for sweep in SWEEPS[claim]]
        out = args.out.parent / "study" / claim
        # Timed sweeps repeat each configuration with seeds 0, 1, 2 (the slowest-varying setting, so that the
        # repeats are minutes apart): their medians stand for it.
        jobs = median_of_repeats([job for sweep_jobs, _ in results for job in sweep_jobs])
        if claim == "transfer":
            found = transfer_claim(jobs, out)
        elif claim == "batch":
            found = batch_claim(jobs, out)
        elif claim == "memory":
            found = memory_claim(jobs, out)
        elif claim == "scaling":
            found = scaling_claim(jobs, out)
        elif claim == "target":
            found = target_claim(jobs, out)
        elif claim == "batch_fit":
            found = batch_fit_claim(results[0][0], median_of_repeats(results[1][0]), out)
        else:
            found = accumulation_claim(results[0][0], median_of_repeats(results[1][0]), out)
        sections[claim] = (results, *found)

    command = "python scripts/study.py" + "".join(f" --only {claim}" for claim in args.only or [])
    minutes = (time.perf_counter() - started) / 60
    run = (
        f"From the run of {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC (`{command}`, "
        f"{minutes:.1f} minutes) on: {machine()}; {args.threads} intra-op CPU thread{'s' if args.threads > 1 else ''} "
        f"per process; its sweep dirs under `outputs/study/{stamp}/`."
    )
    new |= {claim: render_claim(claim, *found, args.out.parent, run) for claim, found in sections.items()}
    write_atomic(args.out, splice(args.out.read_text() if args.out.exists() else "", new))
    print(args.out)


HEADER = """# The seed's advice, measured

Written by `python scripts/study.py`, which runs the sweeps of every section below; `python scripts/study.py
--only CLAIM` runs one section's sweeps again and replaces that section alone, keeping the others, so the
sections may come from different runs. Each section says which run it comes from, on what machine, and how many
repeats stand behind its figures; every number and conclusion in it is computed from that run. Do not edit a
section by hand: the next run of its claim replaces it.

Speeds are from machines shared with other work: compare the rows of one table (one run), not absolute figures
between sections. Each job's full record is in `results.csv` of its sweep dir, and `python scripts/report.py
<that dir>` draws all its plots. `--threads` (default 1) sets every process's intra-op CPU threads
(OMP_NUM_THREADS): on a machine whose cores other work also uses, a step split over two threads waits for the
busier core, which makes small batches erratic; with one thread per process, DDP x2 is two cores against one.
"""
SECTION = re.compile(r"<!-- study:(\w+) begin -->\n(.*?)\n<!-- study:\1 end -->", re.DOTALL)


def sections_of(text: str) -> dict[str, str]:
    """The sections of a study file by claim: the text between each claim's begin and end markers."""
    found = {claim: body for claim, body in SECTION.findall(text)}
    begun = re.findall(r"<!-- study:(\w+) begin -->", text)
    if sorted(begun) != sorted(found) or not set(found) <= set(TITLES):
        raise ValueError(f"the study file's markers do not pair up with known claims: {begun}")
    return found


def splice(old: str, new: dict[str, str]) -> str:
    """The study file: the header, then every claim's section in the order of TITLES, from `new` where it was
    run now, else as `old` (the file as it was) has it; a claim in neither is left out."""
    kept = sections_of(old) | new
    body = [f"<!-- study:{c} begin -->\n{kept[c].strip()}\n<!-- study:{c} end -->\n" for c in TITLES if c in kept]
    return "\n".join([HEADER, *body])


def repeats_line(results: list[tuple[list[Job], str]]) -> str:
    """How many jobs stand behind each figure, counted in each sweep's own jobs."""
    counts = []
    for sweep_jobs, _ in results:
        repeats = sorted({job.metrics["repeats"] for job in median_of_repeats(sweep_jobs)})
        if not repeats:
            counts.append("no job completed")
        elif repeats == [1]:
            counts.append("one job per configuration, no repeats")
        else:
            n = str(repeats[0]) if len(repeats) == 1 else f"{repeats[0]} to {repeats[-1]}"
            counts.append(f"{n} repeats per configuration (seeds), each speed their median")
    if len(counts) == 1:
        return f"Repeats: {counts[0]}."
    return "Repeats: " + "; ".join(f"sweep {i}, {count}" for i, count in enumerate(counts, 1)) + "."


def render_claim(claim, results, sections, lines, verified, relative_to: Path, run: str) -> str:
    text = [f"## {TITLES[claim]}\n", f"The seed: *{SEED_SAYS[claim]}*\n", f"{run}\n", "Sweeps:\n"]
    text += [f"    {typed}" for _, typed in results]
    text.append(f"\n{repeats_line(results)}\n")
    for s in sections:
        if s.plot:
            text.append(f"![{s.title}]({s.plot.relative_to(relative_to)})\n")
        if s.rows:
            text.append(markdown_table(s.columns, s.rows) + "\n")
        elif s.note:
            text.append(s.note + "\n")
    text.append("**What the numbers say.**\n")
    text += [f"- {line}" for line in lines]
    text.append(f"\n{verified}\n")
    return "\n".join(text)


if __name__ == "__main__":
    main()
