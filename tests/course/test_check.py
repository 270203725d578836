"""``course.check``: in-process, sees each edit, prints FAILED without stopping the notebook,
and still fails the notebook run when a *solution* is wrong (CI).

Each test works on a copy of the course (paged_ref, exercises, solutions, tests) in a temporary
folder, so planting a bug never touches the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RIGHT = "    return (num_tokens + block_size - 1) // block_size\n"
WRONG = "    return num_tokens // block_size\n"  # floor instead of ceiling: the classic slip


@pytest.fixture(scope="module")
def course_copy(tmp_path_factory) -> Path:
    """A copy of the course whose exercise 2.3 is solved in exercises/ (right) and solutions/."""
    root = tmp_path_factory.mktemp("course")
    for folder in ("paged_ref", "paged_course", "paged_bench", "exercises", "solutions", "tests",
                   "notebooks"):
        shutil.copytree(ROOT / folder, root / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.ipynb"))
    shutil.copy(ROOT / "pyproject.toml", root)
    solution = (root / "solutions" / "ex02_block_allocator.py").read_text()
    assert RIGHT in solution, "the planted bug no longer matches solutions/ex02"
    (root / "exercises" / "ex02_block_allocator.py").write_text(solution)
    return root


def run_python(root: Path, code: str, impl: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root), PAGED_REF_IMPL=impl)
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)


def plant(root: Path, folder: str, old: str, new: str) -> None:
    path = root / folder / "ex02_block_allocator.py"
    path.write_text(path.read_text().replace(old, new))


SCRIPT = """
import time
from pathlib import Path
import paged_course as course
assert course.ROOT == Path.cwd(), course.ROOT
t = time.perf_counter()
first = course.check("ex02_block_allocator", keyword="2_3")
path = Path("exercises/ex02_block_allocator.py")
path.write_text(path.read_text().replace({right!r}, {wrong!r}))
second = course.check("ex02_block_allocator", keyword="2_3")
print("went on", first["passed"], second["failed"], f"{{time.perf_counter() - t:.2f}}")
"""


def test_check_sees_each_edit_and_a_failure_does_not_stop(course_copy):
    done = run_python(course_copy, SCRIPT.format(right=RIGHT, wrong=WRONG), "exercises")
    assert done.returncode == 0, done.stderr
    assert "ex02 2.3: 5 FAILED" in done.stdout and "FAILED test_2_3_blocks_needed" in done.stdout, (
        done.stdout)
    assert "expected" in done.stdout, f"the report should say what differs:\n{done.stdout}"
    went_on = [line for line in done.stdout.splitlines() if line.startswith("went on")]
    assert went_on, done.stdout
    _, _, passed, failed, seconds = went_on[0].split()
    assert int(passed) > 0 and int(failed) > 0
    plant(course_copy, "exercises", WRONG, RIGHT)


def test_a_wrong_solution_fails_the_notebook_run(course_copy, tmp_path):
    """nbval (as in `make test`, PAGED_REF_IMPL=solutions) fails when a solution is wrong."""
    pytest.importorskip("nbval")
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3",
                                                           "display_name": "Python 3"}})
    nb.cells = [nbformat.v4.new_code_cell("import paged_course as course\n"
                                          'course.check("ex02_block_allocator", keyword="2_3");'),
                nbformat.v4.new_code_cell('print("went on")')]
    notebook = course_copy / "notebooks" / "check_probe.ipynb"
    nbformat.write(nb, notebook)
    plant(course_copy, "solutions", RIGHT, WRONG)
    try:
        env = dict(os.environ, PYTHONPATH=str(course_copy), PAGED_REF_IMPL="solutions")
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist",
             "-o", "addopts=", "--nbval-lax", "--nbval-current-env", str(notebook)],
            cwd=course_copy, env=env, capture_output=True, text=True, timeout=300)
    finally:
        plant(course_copy, "solutions", WRONG, RIGHT)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "check(s) failed in solutions/ex02_block_allocator" in done.stdout, done.stdout[-3000:]


def test_check_refuses_a_notebook_from_another_checkout(tmp_path, monkeypatch):
    """A kernel of one checkout must not check a notebook that lives in another one."""
    import paged_course as course

    other = tmp_path / "other"
    for folder in ("paged_ref", "exercises", "notebooks"):
        (other / folder).mkdir(parents=True)
    monkeypatch.chdir(other / "notebooks")
    with pytest.raises(RuntimeError, match="wrong exercises") as info:
        course.check("ex02_block_allocator")
    assert str(other) in str(info.value)
    monkeypatch.chdir(tmp_path)  # not inside any checkout: fine
    course._refuse_other_checkout()
