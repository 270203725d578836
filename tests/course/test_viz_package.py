"""paged_course.viz is a package of short modules, one topic each, and ``viz.NAME`` keeps
working for every picture a notebook, a test or another module asks for."""

from __future__ import annotations

import json
import re
from pathlib import Path

import paged_course
from paged_course import viz

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(viz.__file__).parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_every_module_is_short():
    sizes = {p.name: len(p.read_text().splitlines()) for p in PACKAGE.glob("*.py")}
    assert len(sizes) >= 6, sizes
    assert max(sizes.values()) <= 400, sizes


def test_the_old_flat_modules_are_gone():
    course = Path(paged_course.__file__).parent
    assert not list(course.glob("viz*.py")), "pictures live in paged_course/viz/"


def _names_used(text: str) -> set[str]:
    return set(re.findall(r"\bviz\.([A-Za-z_]\w*)", text))


def test_every_name_the_notebooks_and_code_use_is_in_viz():
    used: set[str] = set()
    for path in NOTEBOOKS:
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                used |= _names_used("".join(cell["source"]))
    for folder in ("paged_course", "paged_bench", "tests", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            used |= _names_used(path.read_text())
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    missing = sorted(n for n in used - modules - {"NAME"} if not hasattr(viz, n))
    assert not missing, f"viz lacks {missing}"
    assert {"draw_block_tables", "BlockTableExplorer", "SharingExplorer"} <= used
