"""docs/glossary.md: one entry per term, each with an explicit anchor; every link into it from a
notebook or a page lands on an entry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GLOSSARY = ROOT / "docs" / "glossary.md"
ANCHOR = re.compile(r'<a id="([a-z0-9-]+)"></a>\n### ')
LINK = re.compile(r"glossary\.md#([A-Za-z0-9_.-]+)")


def anchors(text: str) -> list[str]:
    return ANCHOR.findall(text)


def broken_links(text: str, known: set[str]) -> list[str]:
    return sorted({a for a in LINK.findall(text) if a not in known})


def test_anchors_are_unique_and_lower_case():
    found = anchors(GLOSSARY.read_text())
    assert len(found) >= 30
    assert len(found) == len(set(found)), "an anchor is defined twice"


def test_each_entry_is_short():
    text = GLOSSARY.read_text()
    entry = r'<a id="([a-z0-9-]+)"></a>\n### [^\n]+\n(.*?)(?=\n<a id=|\n## |\Z)'
    for anchor, body in re.findall(entry, text, re.S):
        sentences = len(re.findall(r"[.!?](?:\s|$)", body.strip()))
        assert 1 <= sentences <= 4, f"{anchor}: {sentences} sentences"


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb"))
                         + sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"],
                         ids=lambda p: p.name)
def test_links_land_on_an_entry(path):
    known = set(anchors(GLOSSARY.read_text()))
    assert not broken_links(path.read_text(), known), f"{path.name}: no such glossary entry"


def test_a_broken_link_is_caught():
    known = set(anchors(GLOSSARY.read_text()))
    assert broken_links("see [CTA](../docs/glossary.md#cta-block)", known) == ["cta-block"]
    assert broken_links("see [CTA](../docs/glossary.md#cta)", known) == []
