"""The docs agree with what they describe: docs/metrics.md is the metrics.json schema, and every link between
the README and the docs pages leads somewhere."""

import re

from conftest import ROOT

from experiments.run.metrics import NAMES, markdown_page

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_metrics_page_is_the_schema():
    page = (ROOT / "docs" / "metrics.md").read_text()
    assert page == markdown_page(), "docs/metrics.md is stale: python -m experiments.run.metrics > docs/metrics.md"
    assert re.findall(r"^\| `(\w+)` \|", page, flags=re.MULTILINE) == NAMES


def anchors(page) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_link_leads_to_a_file_and_heading():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path) if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def quick_start() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\n+```bash\n(.*?)```", readme, flags=re.DOTALL)[1]
    return [line.split("#")[0].strip() for line in block.splitlines()]


def test_the_readme_sets_up_a_machine_without_a_gpu_and_ci_runs_its_commands():
    commands = quick_start()
    cpu_build = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    setup = 'pip install -e ".[dev]"'
    assert cpu_build in commands and setup in commands
    assert commands.index(cpu_build) < commands.index(setup)  # first: the set-up then keeps the CPU build
    ci = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    quiet = [c.replace("pip install --quiet", "pip install") for c in ci]
    assert setup in quiet and "pytest" in ci  # CI runs the README's set-up and test commands as they are written
