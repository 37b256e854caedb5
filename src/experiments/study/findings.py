"""What a claim's analysis returns (`Findings`), and the readings that several analyses share."""

from typing import NamedTuple

from experiments.sweeps.figures import Section, completed, median_of_repeats
from experiments.sweeps.record import Job


class Findings(NamedTuple):
    sections: list[Section]  # tables and plots, in the order the claim's section shows them
    lines: list[str]  # the conclusions, each computed from the numbers of the sections' run
    verified: str  # which devices measured the claim, which did not


def pooled(runs: list[list[Job]]) -> list[Job]:
    """The jobs of all of a claim's sweeps, one a configuration: timed sweeps repeat each configuration with seeds
    0, 1, 2 (the slowest-varying setting, so that the repeats are minutes apart), and their medians stand for it."""
    return median_of_repeats([job for jobs in runs for job in jobs])


def ratio_text(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def by_series(section: Section, y: str) -> dict[str, list[tuple]]:
    """(global batch size, y) of each series of a section's table, in the table's order."""
    labels = dict.fromkeys(r["series"] for r in section.rows)
    return {label: [(r["global_batch_size"], r[y]) for r in section.rows if r["series"] == label] for label in labels}


def gpu_line(jobs: list[Job], what: str) -> str:
    if any(j.metrics.get("accelerator") == "cuda" for j in completed(jobs)):
        return "GPU: measured."
    return f"CPU: measured. **GPU: unverified** ({what} not measured: no GPU ran this study)."
