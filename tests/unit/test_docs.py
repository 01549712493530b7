"""The commands the README and docs show name recipes that exist: a renamed or deleted recipe breaks them."""

from __future__ import annotations

import re

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
