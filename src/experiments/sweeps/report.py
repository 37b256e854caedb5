"""Tables and plots of a run or a sweep: `<dir>/report/report.md` (scripts/report.py, scripts/study.py), and the
plots as TensorBoard images in `<dir>/report/` (`tensorboard --logdir <dir>`: the run `report`).

Each section compares jobs that differ in one thing (batch size, device count, accumulation...) and holds
everything else fixed: a job's "series" is the set of swept settings other than the section's x axis, so a
sweep over two models and four batch sizes draws two throughput lines, never one zig-zag.
"""

from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and in tests
import matplotlib.pyplot as plt  # noqa: E402

from experiments.run.files import write_atomic  # noqa: E402
from experiments.sweeps.figures import (  # noqa: E402
    ACCUMULATION_KEYS,
    BATCH_KEYS,
    DEVICE_KEYS,
    Section,
    baseline_key,
    best_val_mse,
    by_series,
    completed,
    compute_share,
    device_label,
    log2_axis,
    loss_curves,
    markdown_table,
    median_of_repeats,
    over_optimum,
    samples_seen,
    save,
    series_label,
    series_lines,
    varying,
    with_plot,
    xy_section,
)
from experiments.sweeps.record import Job, find_jobs  # noqa: E402


def jobs_section(jobs: list[Job]) -> Section:
    columns = ["job", "status", "overrides", "val_mse", "samples_per_sec", "step_time_ms", "peak_memory_mb", "error"]
    rows = [
        {"job": j.num, "status": j.status, "overrides": " ".join(j.overrides), "error": j.error}
        | {k: j.metrics.get(k, "") for k in columns[3:-1]}
        for j in jobs
    ]
    return Section("Jobs", columns, rows)


def loss_section(jobs: list[Job], out: Path) -> Section:
    section = Section("Training loss per job")
    keys = varying(jobs)
    curves = [(j, loss_curves(j)) for j in jobs if samples_seen(j, 0) is not None]
    curves = [(job, points) for job, points in curves if points]
    if not curves:
        section.note = "No plot: no job logged `train/loss` to TensorBoard."
        return section
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for job, points in curves:
        label = f"{job.num}: {series_label(job, keys)}"
        (line,) = ax.plot([samples_seen(job, s) for s, _ in points], [v for _, v in points], label=label)
        val = loss_curves(job, "val/mse")
        if val:  # each validation, on the same axis: the fit the run is judged by
            ax.plot([samples_seen(job, s) for s, _ in val], [v for _, v in val], linestyle="none", marker="o",
                    markersize=3, color=line.get_color(), gid="val/mse")  # fmt: skip
    for optimum in sorted({j.metrics["optimal_val_mse"] for j, _ in curves if j.metrics.get("optimal_val_mse")}):
        ax.axhline(optimum, color="black", linestyle="--", linewidth=1, gid="optimum")
    ax.plot([], [], color="black", linestyle="--", linewidth=1, label="optimum: exact least squares, val MSE")
    ax.plot([], [], color="gray", linestyle="none", marker="o", markersize=3, label="val/mse at each validation")
    ax.set(
        title="Training loss per job: train/loss at each log step (lines), val/mse (dots)",
        xlabel="samples seen (optimizer steps x effective batch), log scale",
        ylabel="MSE (target units²), log scale",
    )
    ax.set_xscale("log")
    if all(v > 0 for _, points in curves for _, v in points):
        ax.set_yscale("log")
    ax.legend(fontsize="x-small")
    section.plot = save(fig, out / "loss_curves.png")
    section.columns = ["job", "log steps", "first: step", "first: train/loss", "last: step", "last: train/loss",
                       "val_mse / optimum"]  # fmt: skip
    section.rows = [
        {
            "job": f"{job.num}: {series_label(job, keys)}",
            "log steps": len(points),
            "first: step": points[0][0] + 1,
            "first: train/loss": points[0][1],
            "last: step": points[-1][0] + 1,
            "last: train/loss": points[-1][1],
            "val_mse / optimum": over_optimum(job.metrics),
        }
        for job, points in curves
    ]
    section.note = (
        "train/loss is the MSE of the one training batch of each log step (every `trainer.log_every_n_steps` "
        "optimizer steps), first and last logged; near the optimum a batch's MSE scatters around it, above and "
        "below. How close a run came is `val_mse / optimum`: its validation MSE over the exact least-squares "
        "optimum's (1.0 is the best any linear model can do)."
    )
    return section


def time_to_target_section(jobs: list[Job], out: Path) -> Section:
    """The time and the optimizer steps to the target against the effective batch: a larger batch needs fewer
    steps, each longer; the time is what the user waits for. A job that missed the target is there too, "not
    reached", with the best val_mse it got to against the optimum."""
    targeted = [replace(j, metrics=j.metrics | best_val_mse(j)) for j in jobs if j.metrics.get("target_mse")]
    return xy_section(
        targeted, out, "Time to target vs batch size", "effective_batch_size", "time_to_target_s",
        BATCH_KEYS + ACCUMULATION_KEYS, "effective batch size (samples per optimizer step)",
        "training time to val_mse <= target (s)", "time_to_target_vs_batch.png",
        # an effective batch is B x 1 and B/4 x 4; how close a job came, whether it got there or not
        shown=("global_batch_size", "accumulate_grad_batches", "best_val_mse", "best_over_optimum"),
        also=(("steps_to_target", "optimizer steps to val_mse <= target", "Steps to target vs batch size"),),
        missing="not reached",
    )  # fmt: skip


def throughput_section(jobs: list[Job], out: Path) -> Section:
    return xy_section(
        jobs, out, "Throughput vs batch size", "global_batch_size", "samples_per_sec", BATCH_KEYS,
        "global batch size (samples per micro-step)", "throughput (samples/s)", "throughput_vs_batch.png",
    )  # fmt: skip


def memory_section(jobs: list[Job], out: Path) -> Section:
    return xy_section(
        jobs, out, "Peak memory vs batch size", "global_batch_size", "peak_memory_mb", BATCH_KEYS,
        "global batch size (samples per micro-step)", "peak memory (MiB)", "memory_vs_batch.png",
    )  # fmt: skip


def speedup_section(jobs: list[Job], out: Path) -> Section:
    section = Section("Speed-up over the CPU baseline (1 CPU device, same batch and settings)")
    done = completed(jobs)
    keys = varying(done, but=DEVICE_KEYS + BATCH_KEYS + ACCUMULATION_KEYS)
    baselines = {
        baseline_key(j, keys): j for j in done if j.metrics["accelerator"] == "cpu" and j.metrics["devices"] == 1
    }
    rows = []
    for job in done:
        base = baselines.get(baseline_key(job, keys))
        if base is None or base is job:
            continue
        rows.append(
            {
                "series": series_label(job, keys, (device_label(job.metrics),)),
                "global_batch_size": job.metrics["global_batch_size"],
                "samples_per_sec": job.metrics["samples_per_sec"],
                "baseline_samples_per_sec": base.metrics["samples_per_sec"],
                "speedup": job.metrics["samples_per_sec"] / base.metrics["samples_per_sec"],
                **compute_share(job),
            }
        )
    if not rows:
        section.note = "No plot: no job ran on another accelerator or device count beside a 1-CPU baseline."
        return section
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series_lines(ax, rows, "global_batch_size", "speedup")
    ax.axhline(1.0, color="grey", linestyle="--", label="CPU baseline (1x)")
    ax.set(title="Speed-up over 1 CPU device", xlabel="global batch size (samples per micro-step)",
           ylabel="speed-up (x, throughput ratio)")  # fmt: skip
    log2_axis(ax)
    return with_plot(section, rows, fig, ax, out / "speedup_over_cpu.png")


def scaling_section(jobs: list[Job], out: Path) -> Section:
    """Throughput on N devices over N times the throughput on one device of the same kind and batch."""
    section = Section("Multi-device scaling efficiency (DP, DDP)")
    done = completed(jobs)
    keys = varying(done, but=DEVICE_KEYS + BATCH_KEYS + ACCUMULATION_KEYS)
    singles = {(j.metrics["accelerator"], *baseline_key(j, keys)): j for j in done if j.metrics["devices"] == 1}
    rows = []
    for job in done:
        m = job.metrics
        single = singles.get((m["accelerator"], *baseline_key(job, keys)))
        n = m["devices"] * m["num_nodes"]
        if single is None or n == 1:
            continue
        rows.append(
            {
                "series": f"{m['accelerator']} {m['strategy']}, batch {m['global_batch_size']}"
                + "".join(f", {k}={job.settings.get(k)}" for k in keys),
                "devices": n,
                "samples_per_sec": m["samples_per_sec"],
                "single_device_samples_per_sec": single.metrics["samples_per_sec"],
                "speedup": m["samples_per_sec"] / single.metrics["samples_per_sec"],
                "efficiency_pct": 100 * m["samples_per_sec"] / (n * single.metrics["samples_per_sec"]),
                **compute_share(job),
            }
        )
    if not rows:
        section.note = "No plot: no multi-device job beside a one-device job of the same accelerator and batch."
        return section
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series_lines(ax, rows, "devices", "efficiency_pct", first=[(1, 100.0)])
    ax.axhline(100.0, color="grey", linestyle="--", label="ideal (N x one device)")
    ax.set_xticks(sorted({1, *(r["devices"] for r in rows)}))  # whole devices only
    ax.set(title="Scaling efficiency", xlabel="devices (count)", ylabel="efficiency (% of N x one-device throughput)")
    return with_plot(section, rows, fig, ax, out / "scaling_efficiency.png")


def accumulation_section(jobs: list[Job], out: Path) -> Section:
    section = Section("Memory and throughput vs gradient accumulation")
    groups = {
        k: sorted(v, key=lambda j: j.metrics["accumulate_grad_batches"])
        for k, v in by_series(completed(jobs), BATCH_KEYS + ACCUMULATION_KEYS).items()
    }
    # Compare at one effective batch: accumulation trades micro-batch size for micro-steps.
    series = {}
    for label, group in groups.items():
        for effective in sorted({j.metrics["effective_batch_size"] for j in group}):
            same = [j for j in group if j.metrics["effective_batch_size"] == effective]
            if len({j.metrics["accumulate_grad_batches"] for j in same}) > 1:
                series[f"{label}, effective batch {effective}"] = same
    if not series:
        section.note = "No plot: no two completed jobs share an effective batch with different accumulation."
        return section
    fig, (ax_mem, ax_speed) = plt.subplots(1, 2, figsize=(10, 4.2))
    for label, group in series.items():
        acc = [j.metrics["accumulate_grad_batches"] for j in group]
        ax_mem.plot(acc, [j.metrics["peak_memory_mb"] for j in group], marker="o", label=label)
        ax_speed.plot(acc, [j.metrics["samples_per_sec"] for j in group], marker="o", label=label)
        section.rows += [{"series": label} | {k: j.metrics.get(k) for k in ACCUMULATION_COLUMNS[1:]} for j in group]
    xlabel = "accumulate_grad_batches (micro-steps per optimizer step)"
    ax_mem.set(title="Peak memory vs accumulation", xlabel=xlabel, ylabel="peak memory (MiB)")
    ax_speed.set(title="Throughput vs accumulation", xlabel=xlabel, ylabel="throughput (samples/s)")
    for ax in (ax_mem, ax_speed):
        log2_axis(ax)
        ax.legend(fontsize="x-small")
    section.columns = ACCUMULATION_COLUMNS
    section.plot = save(fig, out / "accumulation.png")
    return section


ACCUMULATION_COLUMNS = [
    "series", "accumulate_grad_batches", "global_batch_size", "effective_batch_size", "peak_memory_mb",
    "samples_per_sec", "compute_ms", "step_time_ms", "val_mse", "optimum_distance", "time_to_target_s",
]  # fmt: skip


def build_sections(root: Path, out: Path) -> list[Section]:
    jobs = find_jobs(root)
    configurations = median_of_repeats(jobs)  # every job in the table and the loss curves; one point per config
    return [
        jobs_section(jobs),
        loss_section(jobs, out),
        throughput_section(configurations, out),
        speedup_section(configurations, out),
        scaling_section(configurations, out),
        memory_section(configurations, out),
        accumulation_section(configurations, out),
        time_to_target_section(configurations, out),
    ]


def render(title: str, sections: list[Section], relative_to: Path) -> str:
    parts = [f"# {title}\n"]
    for s in sections:
        parts.append(f"## {s.title}\n")
        if s.note:
            parts.append(s.note + "\n")
        if s.plot:
            parts.append(f"![{s.title}]({s.plot.relative_to(relative_to)})\n")
        if s.rows:
            parts.append(markdown_table(s.columns, s.rows) + "\n")
    return "\n".join(parts)


def write_report(root: Path) -> Path:
    """`<root>/report/report.md` and its PNG plots, for a sweep dir or one run's dir."""
    out = root / "report"
    sections = build_sections(root, out)
    if not sections[0].rows:
        raise FileNotFoundError(f"no run under {root}: expected metrics.json or .hydra/ in it or its job dirs")
    path = out / "report.md"
    write_atomic(path, render(f"Report: {root}", sections, out))
    write_tensorboard_images(sections, out)
    return path


def write_tensorboard_images(sections: list[Section], out: Path) -> None:
    """The report's plots as images of TensorBoard's run `report` (its IMAGES tab, and Time Series' `whole_sweep`
    group, which sorts after the curves); a report written again replaces the previous one's."""
    from torch.utils.tensorboard import SummaryWriter  # here: the report's tables need no torch

    for old in out.glob("events.out.tfevents.*"):
        old.unlink()
    with SummaryWriter(str(out)) as writer:
        for section in sections:
            if section.plot:
                writer.add_image(f"whole_sweep/{section.plot.stem}", plt.imread(section.plot), dataformats="HWC")
