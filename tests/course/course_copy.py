"""A copy of the course in a temporary folder, for tests that edit exercise files, plant bugs
and run notebook code against them without touching the checkout.

    root = make_copy(tmp_path)
    write_exercise(root, "ex07_sharing", solved={"7.1", "7.2", "7.3", "7.4"})
    out = run_python(root, "import paged_course as course; course.check(...)", "exercises")
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("paged_ref", "paged_course", "paged_bench", "exercises", "solutions", "tests", "results",
           "tools", "notebooks")
RAISE = re.compile(r'^\s*raise NotImplementedError\("Exercise (\d+\.\d+[a-z]?): \w+"\)\n',
                   re.MULTILINE)


def make_copy(root: Path) -> Path:
    """Copy the course's code (no notebooks' contents, no caches) into ``root``; return it."""
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, root / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.ipynb"))
    shutil.copy(ROOT / "pyproject.toml", root)
    return root


def solution_blocks(text: str) -> list[str]:
    """The lines between each ``# BEGIN SOLUTION`` and ``# END SOLUTION``, in order."""
    blocks, current = [], None
    for line in text.splitlines(keepends=True):
        marker = line.strip()
        if marker.startswith("# BEGIN SOLUTION"):
            current = []
        elif marker == "# END SOLUTION":
            blocks.append("".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def write_exercise(root: Path, name: str, solved: set[str], *, edits=()) -> Path:
    """Write ``exercises/<name>.py`` as a learner who solved the exercises ``solved`` (their
    worked solutions; the others stay stubs), then apply ``edits`` ``[(old, new), ...]``."""
    stub = (ROOT / "exercises" / f"{name}.py").read_text()
    blocks = solution_blocks((ROOT / "solutions" / f"{name}.py").read_text())
    raises = list(RAISE.finditer(stub))
    assert len(raises) == len(blocks), f"{name}: {len(raises)} stubs, {len(blocks)} solutions"
    text, end = [], 0
    for match, block in zip(raises, blocks, strict=True):
        text.append(stub[end:match.start()])
        text.append(block if match.group(1) in solved else match.group(0))
        end = match.end()
    text = "".join(text) + stub[end:]
    for old, new in edits:
        assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times in {name}"
        text = text.replace(old, new)
    path = root / "exercises" / f"{name}.py"
    path.write_text(text)
    return path


def run_python(root: Path, code: str, impl: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``code`` with the copy's course on the path, in the copy, with ``PAGED_REF_IMPL``."""
    env = dict(os.environ, PYTHONPATH=str(root), PAGED_REF_IMPL=impl, OMP_NUM_THREADS="1")
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a learner's Python writes bytecode caches
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout)
