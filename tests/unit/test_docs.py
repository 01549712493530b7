"""The commands the README and docs show name recipes that exist: a renamed or deleted recipe breaks them."""

from __future__ import annotations

import re
import sys

import pytest
from conftest import REPO

from maxtext_moe.recipe import composition

# A recipe named where a command takes one: `maxtext-moe <command> NAME` or `--recipe NAME`.
COMMAND = re.compile(
    r"(?:maxtext-moe (?:train|show|plan|bench|launch|checkpoints|doctor)|--recipe)\s+(deepseek3-[A-Za-z0-9.-]+)"
)
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_commands_in_the_docs_name_shipped_recipes(doc):
    named = set(COMMAND.findall(doc.read_text(encoding="utf-8")))
    assert not named - set(composition.recipe_names()), f"{doc.name} names recipes that do not exist"


def test_the_pattern_finds_the_readmes_recipes():
    assert "deepseek3-proxy-h200-1gpu" in COMMAND.findall((REPO / "README.md").read_text(encoding="utf-8"))


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGES = [*DOCS, REPO / "docs" / "results" / "INDEX.md"]


@pytest.mark.parametrize("doc", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    """Every relative link in a page names a file of the repository, and a `#anchor` one of its headings."""
    broken = []
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), flags=re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{doc.name}: links that lead nowhere: {broken}"


def test_the_results_index_is_what_the_script_writes():
    """docs/results/INDEX.md is generated from the JSON beside it: a new or changed result needs the script run."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import results_index
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    committed = (REPO / "docs" / "results" / "INDEX.md").read_text(encoding="utf-8")
    assert committed == results_index.render(), "docs/results/INDEX.md is stale: run python benchmarks/results_index.py"
