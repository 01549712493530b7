"""The commands the README and docs show name recipes that exist: a renamed or deleted recipe breaks them."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, benchmark

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
    results_index = benchmark("results_index")
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


RESULTS = REPO / "docs" / "results"
FIGURE_PAGES = {"README.md": 3, "docs/PERFORMANCE.md": 12, "docs/performance-archive.md": 60}


def _tables(text: str) -> list[list[list[str]]]:
    """Each Markdown table as rows of cells, header first, the separator row left out."""
    tables, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def _number(cell: str) -> float | None:
    m = re.search(r"-?\d[\d,]*\.?\d*", cell.replace("**", ""))
    return float(m.group().replace(",", "")) if m else None


def _compiled_gib(d: dict) -> float:
    c = d["compiled"]
    total = d.get("device_total_bytes") or c.get("device_total_bytes")
    if total is None:
        m = c["memory"]
        total = m["argument_size"] + m["output_size"] + m["temp_size"] - m["alias_size"] + m["generated_code_size"]
    return total / 2**30


# A column's header -> what its figure is, from the row's first results file (and its second, upstream's).
CHECKS = {
    "s/step": lambda ours, up: round(ours["step_s_median"], 3),
    "TFLOPS/GPU": lambda ours, up: round(ours["model_tflops_per_gpu"], 1),
    "MFU": lambda ours, up: round(100 * ours["mfu_bf16"], 1),
    "peak GiB": lambda ours, up: round(ours["peak_device_memory_gib"], 1),
    "upstream's best": lambda ours, up: round(up["model_tflops_per_gpu"], 1),
    "ratio": lambda ours, up: ours["model_tflops_per_gpu"] / up["model_tflops_per_gpu"],
    "over upstream's best": lambda ours, up: ours["model_tflops_per_gpu"] / up["model_tflops_per_gpu"],
    "XLA total GiB": lambda ours, up: round(_compiled_gib(ours), 1),
    "planned GiB": lambda ours, up: round(ours["planned"]["memory_per_gpu_bytes"] / 2**30, 1),
}


def _check_header(header: str) -> str | None:
    for name in CHECKS:
        if header == name or (name == "upstream's best" and header.startswith(name)):
            return name
    return None


@pytest.mark.parametrize("page", FIGURE_PAGES, ids=lambda p: p)
def test_every_figure_in_the_tables_comes_from_its_results_file(page):
    """Each row of a figures table names its results file (ours first, then upstream's where it compares), and
    every s/step, TFLOPS/GPU, MFU, peak, upstream and ratio cell is that JSON's value as rounded there."""
    checked, wrong = 0, []
    for table in _tables((REPO / page).read_text(encoding="utf-8")):
        header = table[0]
        raw = next((i for i, h in enumerate(header) if h.startswith("raw JSON")), None)
        if raw is None:
            assert "TFLOPS/GPU" not in header, f"{page}: a table of TFLOPS/GPU without a raw JSON column: {header}"
            continue
        for row in table[1:]:
            files = re.findall(r"`([^`]+\.json)`", row[raw])
            assert files, f"{page}: a row without its results file: {row[0]}"
            if "{" in files[0]:
                continue  # a brace pattern names several files: the prose beside it gives their figures
            data = [json.loads((RESULTS / f).read_text(encoding="utf-8")) for f in files]
            ours, up = data[0], (data[1] if len(data) > 1 else None)
            for col, cell in zip(header, row, strict=True):
                name = _check_header(col)
                value = _number(cell)
                if name is None or value is None:
                    continue
                if name in ("upstream's best", "ratio", "over upstream's best") and up is None:
                    wrong.append(f"{row[0]}: {col} {cell} but no upstream results file")
                    continue
                expected = CHECKS[name](ours, up)
                tolerance = 0.006 if "ratio" in name or name.startswith("over") else 1e-9
                if abs(value - expected) > tolerance:
                    wrong.append(f"{row[0]}: {col} {cell}, {files[0]} says {expected:.4g}")
                checked += 1
    assert not wrong, f"{page}: figures that are not their results file's:\n" + "\n".join(wrong)
    assert checked >= FIGURE_PAGES[page], f"{page}: only {checked} figures checked; has the table format changed?"


SECTION_REF = re.compile(r'((?:docs/)?[A-Za-z-]+\.md),? "([^"]+)"')


def test_sections_named_in_prose_exist():
    """`docs/PLAN.md, "Compiled vs planned"` in a doc, comment or recipe names the start of a heading of that page."""
    missing = []
    for path in _tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for page, section in SECTION_REF.findall(text):
            target = REPO / page if page.startswith("docs/") or page == "README.md" else REPO / "docs" / page
            if not target.exists():
                continue
            headings = re.findall(r"^#+ (.+)$", target.read_text(encoding="utf-8"), flags=re.M)
            if not any(h.strip("`").startswith(section) for h in headings):
                missing.append(f'{path.relative_to(REPO)}: {page}, "{section}"')
    assert not missing, "sections named that no heading starts with:\n" + "\n".join(missing)
