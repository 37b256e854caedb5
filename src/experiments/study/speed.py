"""The analyses of the claims about speed: the host-to-device copy (a), batch size and throughput (b), one device
against several (d), time to the target (f). Each reads the jobs of its claim's sweeps (one list a sweep, in the
order of the claim's record) and returns its `Findings`; the plots go under `out`."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and in tests
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from experiments.study.findings import Findings, by_series, gpu_line, pooled, ratio_text  # noqa: E402
from experiments.sweeps.figures import Section, completed, save  # noqa: E402
from experiments.sweeps.record import Job  # noqa: E402
from experiments.sweeps.report import (  # noqa: E402
    scaling_section,
    speedup_section,
    throughput_section,
    time_to_target_section,
)


def transfer(runs: list[list[Job]], out: Path) -> Findings:
    rows = []
    for j in completed(pooled(runs)):
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
    return Findings([section], lines, verified)


def throughput(runs: list[list[Job]], out: Path) -> Findings:
    jobs = pooled(runs)
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
    return Findings([section], lines, gpu_line(jobs, "the GPU's throughput against batch size"))


def scaling(runs: list[list[Job]], out: Path) -> Findings:
    jobs = pooled(runs)
    speedup, scaled = speedup_section(jobs, out), scaling_section(jobs, out)
    lines = [
        f"{r['series']}: {r['samples_per_sec']:.3g} samples/s on {r['devices']} devices against "
        f"{r['single_device_samples_per_sec']:.3g} on one: {r['speedup']:.2f}x, {r['efficiency_pct']:.3g}% "
        "scaling efficiency."
        for r in scaled.rows
    ]
    if any(r["efficiency_pct"] > 110 for r in scaled.rows):
        lines.append(
            "An efficiency above 100% cannot come from the devices themselves: the one-device job of that row was "
            "slowed by other load on this machine while it ran. Re-run the study on an idle machine."
        )
    failed = [j for j in jobs if j.status != "completed"]
    lines += [f"Job {j.num} ({' '.join(j.overrides)}) {j.status}: {j.error or 'see its metrics.json'}" for j in failed]
    if not scaled.rows:
        lines.append("No multi-device job completed beside a one-device job: nothing to compare.")
    lines.append(
        "These sweeps are short (60 steps, start-up excluded). DDP on a CPU is measured once, in docs/benchmarks.md, "
        "section 'DDP on CPU' (`python scripts/benchmark.py --ddp`)."
    )
    return Findings([speedup, scaled], lines, f"GPU: measured on {torch.cuda.device_count()} GPUs.")


def time_to_target(runs: list[list[Job]], out: Path) -> Findings:
    jobs = pooled(runs)
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
    return Findings([section], lines, gpu_line(jobs, "the GPU's time to target"))


def model_size(runs: list[list[Job]], out: Path) -> Findings:
    """Claim h: the same steps for the Linear and MLPs of growing width, at a small and a large batch. Every
    parameter of these models is a Linear layer's, so a sample's training FLOPs are 6 x model_params, and mfu is
    recomputed from the median samples_per_sec of the repeats (model_tflops is the representative job's own)."""
    rows = []
    for j in completed(pooled(runs)):
        m = j.metrics
        hidden = j.settings.get("model.hidden")
        tflops = 6 * m["model_params"] * m["samples_per_sec"] / 1e12
        rows.append(
            {
                "model": f"MLP{hidden}".replace(" ", "") if hidden else j.settings["model._target_"].split(".")[-1],
                "model_params": m["model_params"],
                "accelerator": m["accelerator"],
                "global_batch_size": m["global_batch_size"],
                "step_time_ms": m["step_time_ms"],
                "compute_pct": 100 * m["compute_ms"] / m["step_time_ms"],
                "samples_per_sec": m["samples_per_sec"],
                "model_tflops": tflops,
                "mfu": tflops / m["peak_tflops"] if m.get("peak_tflops") else None,
            }
        )
    rows.sort(key=lambda r: (r["accelerator"], r["global_batch_size"], r["model_params"]))
    section = Section("Step time and mfu as the model grows", columns=list(rows[0]) if rows else [], rows=rows)
    series: dict[tuple, list[dict]] = {}
    for r in rows:
        series.setdefault((r["accelerator"], r["global_batch_size"]), []).append(r)
    lines = []
    if rows:
        fig, (speed_ax, mfu_ax) = plt.subplots(1, 2, figsize=(10, 4.2))
        for (device, batch), points in series.items():
            params = [r["model_params"] for r in points]
            speed_ax.plot(params, [r["samples_per_sec"] for r in points], marker="o", label=f"{device}, B={batch}")
            mfu_ax.plot(params, [r["mfu"] or 0 for r in points], marker="o", label=f"{device}, B={batch}")
        speed_ax.set(xscale="log", yscale="log", xlabel="model parameters", ylabel="samples per second",
                     title="Throughput as the model grows")  # fmt: skip
        mfu_ax.set(xscale="log", xlabel="model parameters", ylabel="mfu (model FLOPs / measured matmul rate)",
                   title="Share of the machine's matmul rate")  # fmt: skip
        mfu_ax.legend()
        section.plot = save(fig, out / "models.png")
    for (device, batch), points in series.items():
        base, largest = points[0], points[-1]
        computing = next((r for r in points[1:] if r["step_time_ms"] >= 2 * base["step_time_ms"]), None)
        where = (
            f"from {computing['model']} on, a step takes at least twice the {base['model']}'s: its compute "
            "outweighs a step's fixed cost"
            if computing
            else f"no model here takes twice the {base['model']}'s step: every step is mostly fixed cost"
        )
        mfus = [r["mfu"] for r in points if r["mfu"] is not None]
        mfu = f"; mfu from {min(mfus):.2g} to {max(mfus):.2g}" if mfus else ""
        lines.append(
            f"{device}, B={batch}: the {base['model']} ({base['model_params']:,} parameters) takes "
            f"{base['step_time_ms']:.3g} ms a step, the {largest['model']} ({largest['model_params']:,}, "
            f"{largest['model_params'] / base['model_params']:.3g}x the FLOPs) {largest['step_time_ms']:.3g} ms "
            f"({largest['step_time_ms'] / base['step_time_ms']:.3g}x), compute {base['compute_pct']:.3g}% of a step "
            f"against {largest['compute_pct']:.3g}%; {where}{mfu}."
        )
    verified = "GPU: measured." if any(r["accelerator"] == "cuda" for r in rows) else (
        "**GPU: unverified** (no GPU ran this study): how much faster a GPU runs each model than this CPU, the other "
        "half of the seed's sentence, was not measured; the CPU rows show at which size a step stops being fixed "
        "cost and how close it comes to the CPU's own matmul rate."
    )  # fmt: skip
    return Findings([section], lines, verified)
