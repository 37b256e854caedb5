"""The advice as a person reads it (a table of what was measured, each knob's line, the command) and as a program
reads it (`<advice dir>/advice.json`), and the plot of throughput against batch, one series per option."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and in tests
import matplotlib.pyplot as plt  # noqa: E402

from experiments.advice.trials import Measurement  # noqa: E402
from experiments.advice.verdicts import Line, ratio  # noqa: E402
from experiments.run.files import replacing, write_atomic  # noqa: E402
from experiments.run.provenance import machine, versions  # noqa: E402


def table(measured: list[Measurement], yours: Measurement) -> str:
    head = f"{'option':<34} {'B x acc x dev':>15} {'samples/s: median [quartiles]':>36} {'vs yours':>9} {'warm-up':>8}"
    head += f" {'val_mse':>10}"
    lines = [head, "-" * len(head)]
    for m in measured:
        shape = f"{m.option.micro} x{m.option.accumulate} x{m.option.devices}"
        name = m.option.name + ("" if m.option.keeps_result else " *")
        if m.error:
            lines.append(f"{name:<34} {shape:>15}   {m.error[:80]}")
            continue
        speed = f"{m.median:,.0f} [{m.low:,.0f}-{m.high:,.0f}]"
        warmup = f"{m.warmup_s:.2f} s" if m.warmup_s is not None else "-"
        val = m.metrics.get("val_mse")
        lines.append(
            f"{name:<34} {shape:>15} {speed:>36} {ratio(m, yours):>8.2f}x {warmup:>8} "
            f"{val if val is None else format(val, '.4g'):>10}"
        )
    lines.append("* another effective batch: changes the result (a larger batch takes other steps)")
    return "\n".join(lines)


def advice_text(lines: list[Line], notes: list[str], command: str, speedup: float, tolerance: str) -> str:
    out = ["", "What pays here:"]
    out += [f"  {line.knob:<13} {line.text}" for line in lines]
    out += [f"  {'not measured':<13} {note}" for note in notes]
    out += ["", f"Run (predicted {speedup:.2f}x your command's samples/s; val_mse {tolerance}):", f"  {command}"]
    return "\n".join(out)


def write_advice(run_dir: Path, record: dict) -> Path:
    path = run_dir / "advice.json"
    full = {**record, "machine": machine(), "versions": versions()}
    write_atomic(path, json.dumps(full, indent=1, default=str) + "\n")
    return path


def plot(run_dir: Path, measured: list[Measurement], yours: Measurement) -> Path:
    """Samples a second against the micro-batch: the batch sweep as a line, every other option as a point with its
    range; the user's command ringed."""
    series: dict[str, list[Measurement]] = {}
    for m in measured:
        if m.rates:
            swept = m.option.knob in ("batch", "yours", "accumulation") and m.option.accumulate == m.option.devices == 1
            label = "batch sweep (one batch a step, 1 device)" if swept else m.option.name
            series.setdefault(label, []).append(m)
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in series.items():
        points = sorted(points, key=lambda m: m.option.micro)
        xs, ys = [m.option.micro for m in points], [m.median for m in points]
        errors = [[m.median - m.low for m in points], [m.high - m.median for m in points]]
        ax.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=label, linestyle="-" if len(xs) > 1 else "")
    if yours.rates:
        ax.plot([yours.option.micro], [yours.median], "o", markersize=16, fillstyle="none", color="black",
                label="your command")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch of a micro-step (samples)")
    ax.set_ylabel("samples / s (median of the timed stretches, bar: quartiles)")
    ax.set_title("Throughput against batch, per option (this machine)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    path = run_dir / "throughput.png"
    with replacing(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
