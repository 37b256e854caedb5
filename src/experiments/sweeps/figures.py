"""The parts that the report's sections (experiments.sweeps.report) and the study's (experiments.study) are made of:
a section, the jobs it compares (completed ones, repeats merged into medians), tables and plots."""

import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and in tests
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from experiments.run.files import replacing  # noqa: E402
from experiments.sweeps.record import Job  # noqa: E402

# Settings that a section reads from metrics.json instead (the values that ran, whatever set them).
BATCH_KEYS = ("data.batch_size",)
DEVICE_KEYS = ("trainer.accelerator", "trainer.devices", "trainer.num_nodes", "trainer.strategy")
ACCUMULATION_KEYS = ("trainer.accumulate_grad_batches",)


@dataclass
class Section:
    title: str
    columns: list[str] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    plot: Path | None = None
    note: str = ""  # why the section is empty, or what its numbers say


def loss_curves(job: Job, tag: str = "train/loss") -> list[tuple[int, float]]:
    """(step, value) points of one scalar tag from the job's TensorBoard event files."""
    points = []
    for run_dir in sorted({p.parent for p in job.dir.glob("tensorboard/**/events.out.tfevents.*")}):
        events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0}).Reload()
        if tag in events.Tags()["scalars"]:
            points += [(e.step, e.value) for e in events.Scalars(tag)]
    return sorted(points)


def varying(jobs: list[Job], but: tuple[str, ...] = ()) -> list[str]:
    """The settings whose values differ between jobs (the ones a sweep compares), less those under `but`."""
    keys = {k for job in jobs for k in job.settings if not k.startswith(but)}
    return sorted(k for k in keys if len({job.settings.get(k) for job in jobs}) > 1)


def series_label(job: Job, keys: list[str], extra: tuple = ()) -> str:
    parts = [*extra, *(f"{k}={job.settings.get(k)}" for k in keys)]
    return ", ".join(str(p) for p in parts) or "all jobs"


def device_label(m: dict) -> str:
    return f"{m['accelerator']} x{m['devices'] * m['num_nodes']} {m['strategy']}"


def completed(jobs: list[Job]) -> list[Job]:
    return [j for j in jobs if j.status == "completed" and j.metrics.get("samples_per_sec")]


SPEED_FIGURES = ("samples_per_sec", "step_time_ms", "transfer_ms", "data_ms", "compute_ms", "comm_ms", "framework_ms")
REPEAT_KEYS = ("seed", "data.seed")


def median_of_repeats(jobs: list[Job]) -> list[Job]:
    """One job per configuration: jobs that differ only in their seed are repeats of one measurement, and its
    speed figures become their medians (a machine shared with other work slows some runs, never speeds one
    up). The job with the lowest seed stands for the group (its checkpoint, its loss curve)."""
    groups: dict[tuple, list[Job]] = {}
    for job in completed(jobs):
        key = tuple(sorted((k, v) for k, v in job.settings.items() if k not in REPEAT_KEYS))
        groups.setdefault(key, []).append(job)
    merged = []
    for group in groups.values():
        group.sort(key=lambda j: int(j.settings.get("seed", 0)))
        medians = {k: statistics.median(j.metrics[k] for j in group) for k in SPEED_FIGURES if k in group[0].metrics}
        merged.append(replace(group[0], metrics=group[0].metrics | medians | {"repeats": len(group)}))
    return sorted(merged, key=lambda j: j.num)


def fmt(value) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}"
    return str(value)


def fmt_none(value):
    return "" if value is None else value


def markdown_table(columns: list[str], rows: list[dict]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def log2_axis(ax) -> None:
    """Batch sizes and accumulation steps double: space them evenly, and label the plotted values (64, 128),
    not powers (2^6, 2^7). Call it after plotting."""
    ax.set_xscale("log", base=2)
    ticks = sorted({x for line in ax.lines if line.get_marker() in ("o", "x") for x in line.get_xdata()})
    ax.set_xticks(ticks, labels=[f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())


def save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    with replacing(path) as tmp:  # a crash never leaves half a PNG
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return path


def series_lines(ax, rows: list[dict], x: str, y: str, first: list[tuple] = ()) -> None:
    """A line per `series` of `rows`, its points sorted by `x`, after the points in `first` (a common start)."""
    for label in dict.fromkeys(r["series"] for r in rows):
        points = [*first, *sorted((r[x], r[y]) for r in rows if r["series"] == label)]
        ax.plot(*zip(*points, strict=True), marker="o", label=label)


def with_plot(section: Section, rows: list[dict], fig, ax, path: Path) -> Section:
    """The section with its table (`rows`) and its plot, saved to `path`."""
    ax.legend(fontsize="x-small")
    section.columns, section.rows = list(rows[0]), rows
    section.plot = save(fig, path)
    return section


def by_series(jobs: list[Job], x_keys: tuple[str, ...]) -> dict[str, list[Job]]:
    """Jobs grouped by their device set-up and every swept setting that is not on the x axis (`x_keys`)."""
    keys = varying(jobs, but=x_keys + DEVICE_KEYS)
    groups: dict[str, list[Job]] = {}
    for job in jobs:
        groups.setdefault(series_label(job, keys, (device_label(job.metrics),)), []).append(job)
    return groups


def xy_section(
    jobs: list[Job],
    out: Path,
    title: str,
    x: str,
    y: str,
    x_keys: tuple[str, ...],
    xlabel: str,
    ylabel: str,
    filename: str,
    shown: tuple[str, ...] = (),
    also: tuple[tuple[str, str, str], ...] = (),
    missing: str = "",
) -> Section:
    """One metric against another, a line per series; skipped when no series has two x values. The table adds
    the metrics `shown`, which tell apart the rows of a series at one x; `also` holds (metric, ylabel, title) of
    more metrics against the same x, each in a panel of its own beside the first. With `missing` (what a null `y`
    means: "not reached"), a completed job without `y` is a row that says so, and a cross along each panel's top."""
    section = Section(title)
    with_x = [j for j in completed(jobs) if j.metrics.get(x) is not None]
    if not missing:
        with_x = [j for j in with_x if j.metrics.get(y) is not None]
    groups = {k: sorted(v, key=lambda j: j.metrics[x]) for k, v in by_series(with_x, x_keys).items()}
    groups = {k: v for k, v in groups.items() if len({j.metrics[x] for j in v}) > 1}
    if not groups:
        section.note = f"No plot: no series of completed jobs has two values of `{x}` in this sweep."
        return section
    panels = [(y, ylabel, title), *also]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, (metric, label, panel_title) in zip(axes[0], panels, strict=True):
        for series, group in groups.items():
            measured = [j for j in group if j.metrics.get(y) is not None]
            line = ax.plot([j.metrics[x] for j in measured], [j.metrics[metric] for j in measured], marker="o",
                           label=series)  # fmt: skip
            missed = [j.metrics[x] for j in group if j.metrics.get(y) is None]
            if missed:  # at the panel's top, in the series' colour: the x is the job's, the height says nothing
                ax.plot(missed, [0.97] * len(missed), marker="x", markersize=10, linestyle="none", label=f"{series}: "
                        f"{missing}", color=line[0].get_color(), transform=ax.get_xaxis_transform())  # fmt: skip
        ax.set(title=panel_title, xlabel=xlabel, ylabel=label)
        log2_axis(ax)
        ax.legend(fontsize="x-small")
    extra = [metric for metric, _, _ in also]
    for label, group in groups.items():
        section.rows += [
            {"series": label, x: j.metrics[x], **{k: j.metrics.get(k) for k in shown},
             y: missing if j.metrics.get(y) is None else j.metrics[y], **{k: fmt_none(j.metrics.get(k)) for k in extra},
             **compute_share(j)}
            for j in group
        ]  # fmt: skip
    section.columns = ["series", x, *shown, y, *extra, "compute_pct"]
    section.plot = save(fig, out / filename)
    return section


def compute_share(job: Job) -> dict:
    """How much of a step was compute (forward, backward, update), in %: every speed table says it."""
    m = job.metrics
    return {"compute_pct": 100 * m["compute_ms"] / m["step_time_ms"]} if m.get("compute_ms") is not None else {}


def best_val_mse(job: Job) -> dict:
    """The lowest val/mse the job logged (its final val_mse where it left no TensorBoard files), and that over
    the optimum: 1.0 is the exact least-squares fit, the target is target.mse_ratio."""
    best = min([value for _, value in loss_curves(job, "val/mse")] + [job.metrics["val_mse"]])
    return {"best_val_mse": best, "best_over_optimum": best / job.metrics["optimal_val_mse"]}


def baseline_key(job: Job, keys: list[str]) -> tuple:
    """What a job must share with its baseline: batch, accumulation and every swept non-device setting."""
    m = job.metrics
    return (m["global_batch_size"], m["accumulate_grad_batches"], *(job.settings.get(k) for k in keys))


def samples_seen(job: Job, step: int) -> int | None:
    """Samples trained on by the end of optimizer step `step` (TensorBoard's index, from 0): the x of a loss curve,
    which compares jobs of different batch sizes and accumulations, as steps do not."""
    batch = job.metrics.get("effective_batch_size")
    return None if batch is None else (step + 1) * batch


def over_optimum(metrics: dict) -> float | None:
    """val_mse over the exact least-squares optimum's (1.0: the best a linear model does); None when unknown."""
    val_mse, optimum = metrics.get("val_mse"), metrics.get("optimal_val_mse")
    return None if val_mse is None or not optimum else val_mse / optimum
