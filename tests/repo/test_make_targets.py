"""The Makefile's learner loop: `make lab` serves the repository root, `make test` lints only
the code we own (a learner's long lines in exercises/ never stop the tests)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def dry_run(target: str, *extra: str) -> list[str]:
    """The commands `make -n TARGET` would run (install already done is assumed)."""
    done = subprocess.run(["make", "-n", "-o", ".venv/.installed-stamp", target, *extra],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    text = done.stdout.replace("\\\n", " ")  # join continued lines
    return [line for line in text.splitlines() if line.strip()]


def test_lab_serves_the_repository_root_and_opens_lesson_00():
    [cmd] = [c for c in dry_run("lab") if "jupyter lab" in c]
    args = shlex.split(cmd)
    assert f"--ServerApp.root_dir={ROOT}" in args
    assert args[-1] == "notebooks/00_setup.ipynb"


def test_lab_args_reach_jupyterlab():
    [cmd] = [c for c in dry_run("lab", "LAB_ARGS=--ip=0.0.0.0 --port=8899") if "jupyter lab" in c]
    assert "--ip=0.0.0.0 --port=8899" in cmd


def test_make_test_does_not_lint_the_learners_exercises(tmp_path):
    [lint] = [c for c in dry_run("test") if "ruff check" in c]
    ruff = shutil.which("ruff") or str(ROOT / ".venv" / "bin" / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "ex02_block_allocator.py").write_text(
        "x = 1  # " + "a learner's very long comment " * 10 + "\n")
    args = shlex.split(lint)[1:]  # as in the Makefile, run in a copy with a learner's edit
    done = subprocess.run([ruff, *args], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    plain = subprocess.run([ruff, "check", "."], cwd=tmp_path, capture_output=True, text=True)
    assert plain.returncode == 1, "the planted long line should fail a plain ruff check"
