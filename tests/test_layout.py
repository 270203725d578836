"""The layout keeps its promises: the cache's arithmetic imports nothing, and the reference
implementation (what a serving engine imports) never imports course support."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "paged_ref"
REFERENCE_IMPLEMENTATION = sorted(
    p for p in [*PACKAGE.glob("*.py"), *PACKAGE.glob("kernels/*.py")] if p.name != "bench.py")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_cache_math_imports_nothing():
    assert imported_modules(PACKAGE / "cache_math.py") <= {"__future__",
                                                           "__future__.annotations"}


@pytest.mark.parametrize("path", REFERENCE_IMPLEMENTATION, ids=lambda p: p.name)
def test_reference_implementation_does_not_import_course_support(path):
    course = {m for m in imported_modules(path) if m.startswith("paged_ref.course")}
    assert not course, f"{path.name} imports {course}"
