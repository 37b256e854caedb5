"""docs/study.md as markdown: a header, then one section a claim between markers (<!-- study:NAME begin --> ...
end) in the order of the claims' records; a run of some claims replaces their sections and keeps the others."""

import re
from pathlib import Path

from experiments.study.claims import NAMES, Claim
from experiments.study.findings import Findings
from experiments.sweeps.figures import markdown_table, median_of_repeats
from experiments.sweeps.record import Job

HEADER = """# The seed's advice, measured

Each section below is one machine's answer: the machine it names, the seed's model (or the widths it names), the
sizes of its sweeps. Yours may differ wherever the physics does (a GPU, more cores, a model that computes): `python
advise.py [any train.py override]` measures the same knobs for your model and data on your machine in about two
minutes and prints the `python train.py` command that pays there ([advice.md](advice.md)).

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

To add a claim, add one record to `CLAIMS` in `src/experiments/study/claims.py`: its name (its markers here and
`--only NAME`), title, the seed's sentence, its sweeps (each `python train.py -m` of a
`conf/experiment/study_*.yaml`) and its analysis, a function from the jobs of each sweep to tables, plots and
conclusions (`Findings`, beside the others in `src/experiments/study/speed.py` or `memory.py`); then `python
scripts/study.py --only NAME` writes its section, in the order of the records.
"""
SECTION = re.compile(r"<!-- study:(\w+) begin -->\n(.*?)\n<!-- study:\1 end -->", re.DOTALL)


def sections_of(text: str) -> dict[str, str]:
    """The sections of a study file by claim: the text between each claim's begin and end markers."""
    found = {claim: body for claim, body in SECTION.findall(text)}
    begun = re.findall(r"<!-- study:(\w+) begin -->", text)
    if sorted(begun) != sorted(found) or not set(found) <= set(NAMES):
        raise ValueError(f"the study file's markers do not pair up with known claims: {begun}")
    return found


def splice(old: str, new: dict[str, str]) -> str:
    """The study file: the header, then every claim's section in the order of the records, from `new` where it
    was run now, else as `old` (the file as it was) has it; a claim in neither is left out."""
    kept = sections_of(old) | new
    body = [f"<!-- study:{c} begin -->\n{kept[c].strip()}\n<!-- study:{c} end -->\n" for c in NAMES if c in kept]
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


def render_claim(
    claim: Claim, results: list[tuple[list[Job], str]], found: Findings, relative_to: Path, run: str
) -> str:
    """A claim's section: `results` are each sweep's jobs and its command as typed; `run` says which run."""
    text = [f"## {claim.title}\n", f"The seed: *{claim.seed}*\n", f"{run}\n", "Sweeps:\n"]
    text += [f"    {typed}" for _, typed in results]
    text.append(f"\n{repeats_line(results)}\n")
    for s in found.sections:
        if s.plot:
            text.append(f"![{s.title}]({s.plot.relative_to(relative_to)})\n")
        if s.rows:
            text.append(markdown_table(s.columns, s.rows) + "\n")
        elif s.note:
            text.append(s.note + "\n")
    text.append("**What the numbers say.**\n")
    text += [f"- {line}" for line in found.lines]
    text.append(f"\n{found.verified}\n")
    return "\n".join(text)


def render_short_of_gpus(claim: Claim, gpus: int) -> str:
    """The section of a claim that needs more GPUs than the machine has: no sweep ran."""
    return claim.short_of_gpus.format(title=claim.title, seed=claim.seed, gpus=gpus)
