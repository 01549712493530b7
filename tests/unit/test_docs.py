"""The commands the README and docs show name recipes that exist: a renamed or deleted recipe breaks them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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


# Words that narrate how the project got here instead of saying what the product does: work sessions, numbered
# device calls, issue numbers, rounds, times of day. History belongs in git; results files keep their names.
HISTORY = re.compile(r"(?i:\bsessions?\b|\bissues? ?#?\d+|\(issue\b|\bround \d+|\bnight\b)|\b[Cc]all (?:\d+|[A-D])\b")
# Technical uses of the word that are not history: pytest's fixture scope and a subprocess's new session.
NOT_HISTORY = ('scope="session"', "start_new_session")
SCANNED = ("README.md", "docs", "maxtext_moe", "benchmarks", "scripts", "tests", "configs", "recipes")


def _tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", *SCANNED], cwd=REPO, capture_output=True, text=True, check=True)
    files = []
    for name in listed.stdout.splitlines():
        if name.startswith("docs/results/") and name != "docs/results/INDEX.md":
            continue  # raw results are data, names and notes as recorded
        if name == "tests/unit/test_docs.py":
            continue  # the patterns themselves
        path = REPO / name
        if path.suffix in {".gz", ".png", ".xz", ".tar", ".pb"} or not path.is_file():
            continue
        files.append(path)
    return files


def test_docs_and_code_speak_of_the_product_not_its_history():
    offending = []
    for path in _tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line) and not any(ok in line for ok in NOT_HISTORY):
                offending.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offending, "history words (say what holds, not when or in which session):\n" + "\n".join(offending)


def test_the_history_pattern_catches_what_it_should():
    for bad in ("the fifth session", "call 2 of 5", "in call D", "issue #15", "(issue 5)", "round 3", "the night's"):
        assert HISTORY.search(bad), bad
    for ok in ("Call a function", "36 GEMM calls a step", "a second call does not wrap twice", "recall 2"):
        assert not HISTORY.search(ok), ok
