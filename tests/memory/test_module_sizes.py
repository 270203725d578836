"""Issue 33's size bar for the memory and transfer packages: one job a module, each at most
400 lines."""

from __future__ import annotations

from pathlib import Path

import pytest

import paged_ref

PACKAGES = ["memory", "transfer"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_is_at_most_400_lines(package):
    folder = Path(paged_ref.__file__).parent / package
    sizes = {p.name: len(p.read_text().splitlines()) for p in folder.glob("*.py")}
    assert len(sizes) > 3, sizes
    assert {name: n for name, n in sizes.items() if n > 400} == {}
