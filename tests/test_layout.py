"""The layout keeps its promises: the cache's arithmetic imports nothing, and the library
(``paged_ref``, what a serving engine imports, ``engine/`` included) never imports the course
support (``paged_course``) or the benchmark suites (``paged_bench``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "paged_ref"
LIBRARY = sorted(PACKAGE.rglob("*.py"))


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


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_library_imports_no_course_or_bench_code(path):
    outside = {m for m in imported_modules(path) if m.startswith(("paged_course", "paged_bench"))}
    assert not outside, f"{path.relative_to(PACKAGE)} imports {outside}"


def test_import_paged_ref_leaves_transfer_for_later():
    """``import paged_ref`` loads neither ``paged_ref.transfer`` nor any part of
    ``torch.distributed`` beyond what ``import torch`` itself loads; the first use of
    ``paged_ref.transfer`` imports it."""
    code = """if True:
        import sys
        import torch
        before = set(sys.modules)
        import paged_ref
        new = sorted(m for m in set(sys.modules) - before
                     if m.startswith(("torch.distributed", "paged_ref.transfer")))
        assert not new, f"import paged_ref imported {new}"
        assert paged_ref.transfer.MODES and "paged_ref.transfer" in sys.modules
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=PACKAGE.parent, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
