"""Notebook code cells stay short: helpers longer than a screen belong in the library.

Applies to every notebook in ``notebooks/``, present and future. The course aims at 25 lines a
cell; this test fails above 30, so a cell that grows a helper gets moved to ``paged_ref``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
MAX_LINES = 30


def code_cells(path: Path) -> list[tuple[int, list[str]]]:
    """(index, source lines) of each code cell of the notebook at ``path``."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return [(i, "".join(c["source"]).splitlines()) for i, c in enumerate(cells)
            if c["cell_type"] == "code"]


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found in notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_code_cells_are_short(path):
    long = [(i, len(lines), lines[0] if lines else "") for i, lines in code_cells(path)
            if len(lines) > MAX_LINES]
    assert not long, (
        f"{path.name}: code cells longer than {MAX_LINES} lines (move the helper into "
        "paged_ref, e.g. paged_course/viz/ for a picture): "
        + "; ".join(f"cell {i} ({n} lines, starts {first!r})" for i, n, first in long))


def test_the_check_catches_a_long_cell(tmp_path):
    cell = {"cell_type": "code", "source": ["x = 1\n"] * (MAX_LINES + 1), "metadata": {},
            "outputs": [], "execution_count": None}
    path = tmp_path / "long.ipynb"
    path.write_text(json.dumps({"cells": [cell]}))
    with pytest.raises(AssertionError, match="cell 0"):
        test_code_cells_are_short(path)
