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
