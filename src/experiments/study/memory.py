"""The analyses of the claims about memory: peak memory against the batch (c), gradient accumulation (e), the
largest micro-batch that fits a budget (g). Each reads the jobs of its claim's sweeps (one list a sweep, in the
order of the claim's record) and returns its `Findings`; the plots go under `out`. Accumulation and batch fit
take each job's peak memory from their first sweep (a process a job) and the rest from their second (jobs one
after another, repeated with seeds), and compare the final weights, which must not depend on the split."""

import statistics
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and in tests
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from experiments.run.layout import RunPaths  # noqa: E402
from experiments.study.findings import Findings, by_series, gpu_line, pooled, ratio_text  # noqa: E402
from experiments.sweeps.figures import Section, completed, log2_axis, median_of_repeats, save  # noqa: E402
from experiments.sweeps.record import Job  # noqa: E402
from experiments.sweeps.report import accumulation_section, memory_section  # noqa: E402


def final_weights(job: Job) -> dict[str, torch.Tensor]:
    """The model's tensors at the end of a job (its last.ckpt), in float64: every floating-point entry of the
    LightningModule's state_dict under `net.`, the plain model it composes, whatever its layers."""
    state = torch.load(RunPaths(job.dir).last_checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v.double() for k, v in state.items() if k.startswith("net.") and v.is_floating_point()}


def weights_apart(job: Job, reference: Job) -> float:
    """|w - w_ref| / |w_ref|, all of the model's tensors taken as one vector: how far one job's final weights are
    from another's, relative to the other's."""
    w, ref = final_weights(job), final_weights(reference)
    if {k: v.shape for k, v in w.items()} != {k: v.shape for k, v in ref.items()}:
        raise ValueError(f"{job.dir} and {reference.dir} trained different models: their weights do not compare")
    diff = torch.cat([(w[k] - ref[k]).flatten() for k in ref])
    return (diff.norm() / torch.cat([t.flatten() for t in ref.values()]).norm()).item()


def memory_by_batch(runs: list[list[Job]], out: Path) -> Findings:
    jobs = pooled(runs)
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
    return Findings([section], [*lines, cpu_note.strip()], gpu_line(jobs, "GPU memory"))


def accumulation(runs: list[list[Job]], out: Path) -> Findings:
    memory_jobs, speed_jobs = runs[0], median_of_repeats(runs[1])
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
        for acc, j in sorted(by_acc.items()):
            if acc == 1:
                continue
            m, m1 = j.metrics, one.metrics
            lines.append(
                f"{acc} x {m['global_batch_size']} against 1 x {m1['global_batch_size']} (effective batch "
                f"{m['effective_batch_size']}): final weights differ by {weights_apart(j, one):.2g} (relative), val "
                f"MSE {m['val_mse']:.6g} vs {m1['val_mse']:.6g}; peak memory {m['peak_memory_mb']:.4g} vs "
                f"{m1['peak_memory_mb']:.4g} MiB ({m['peak_memory_mb'] - m1['peak_memory_mb']:+.3g} MiB); "
                f"throughput {m['samples_per_sec']:.3g} vs {m1['samples_per_sec']:.3g} samples/s "
                f"({ratio_text(m['samples_per_sec'], m1['samples_per_sec'])})."
            )
    else:
        lines.append("No accumulation job completed beside the 1-step baseline: nothing to compare.")
    return Findings([section], lines, gpu_line(merged, "GPU memory and speed"))


def largest_micro_batch(runs: list[list[Job]], out: Path) -> Findings:
    """At one effective batch: the micro-batch that each budget got, its optimizer step's time, throughput and peak
    memory, and the default budget's pick among them."""
    memory_jobs, speed_jobs = runs[0], median_of_repeats(runs[1])
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
        return Findings(
            [section], ["No batch_fit job completed: nothing to compare."], gpu_line(speed_jobs, "GPU memory")
        )
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
        lines += default_pick_lines(pick, fastest, rows)
    for r in rows:
        r.pop("job")
    return Findings([section], lines, gpu_line(speed_jobs, "GPU memory and speed against the micro-batch"))


def default_pick_lines(pick: dict, fastest: dict, rows: list[dict]) -> list[str]:
    """What the default budget chose, against the fastest row and the rows that ran the same micro-batch."""
    share = 100 * pick["samples_per_sec"] / fastest["samples_per_sec"]
    settings = pick["job"].settings
    if pick["job"].metrics["accelerator"] == "cuda":
        default = f"the GPU's free memory less {float(settings['batch.gpu_margin']):.0%} of it"
    else:
        default = f"{float(settings['batch.cpu_share']):.0%} of the host's available memory"
    lines = [
        f"The default budget ({pick['budget_mb']:,.0f} MiB: {default}) picks {pick['micro_batch']} x "
        f"{pick['accumulate_grad_batches']}, {pick['samples_per_sec']:.3g} samples/s: {share:.3g}% of the "
        "fastest row."
    ]
    worst = max(weights_apart(r["job"], pick["job"]) for r in rows)
    lines.append(f"The same result: every row's final weights are within {worst:.2g} (relative) of the default pick's.")
    if fastest["micro_batch"] != pick["micro_batch"]:
        lines.append(
            f"The option maximises the micro-batch within the budget, not the speed: here a micro-batch of "
            f"{fastest['micro_batch']} runs {ratio_text(fastest['samples_per_sec'], pick['samples_per_sec'])} "
            f"the pick's throughput; batch.memory_mb caps the micro-batch where a smaller one is faster."
        )
    for twin in [r for r in rows if r is not pick and r["micro_batch"] == pick["micro_batch"]]:
        gap = abs(twin["samples_per_sec"] / pick["samples_per_sec"] - 1)
        lines.append(
            f"The {twin['budget']} row ran what the default ran ({pick['micro_batch']} x "
            f"{pick['accumulate_grad_batches']}): their throughputs differ by {100 * gap:.2g}%, the noise of "
            "this machine between two runs of one configuration."
        )
    return lines
