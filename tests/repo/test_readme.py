"""The README is a front door: short, with the two commands, the syllabus and where to go next;
everything it links inside the repository exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_it_is_short():
    assert len(README.split()) <= 1200, "move detail into docs/ (troubleshooting, maintainers)"


def test_it_has_the_two_commands_the_syllabus_and_the_way_on():
    for needed in ("make lab", "make test", "BEGIN LESSON TIMES", "core", "extension",
                   "docs/contract.md", "docs/glossary.md", "docs/troubleshooting.md",
                   "workshop/README.md", "results/README.md"):
        assert needed in README, needed


def test_every_relative_link_exists():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, missing
