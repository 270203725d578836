"""The layout keeps its promises: the cache's arithmetic imports nothing, and the reference
implementation (what a serving engine imports) never imports course support."""

from __future__ import annotations

import ast
import subprocess
import sys
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
