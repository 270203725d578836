"""Committed notebook outputs stay clean: the notebook runner turns progress bars off (tqdm's
and transformers' "Loading weights", which landed in lesson 11's stderr and, as widgets, left
"(an interactive widget ...)" placeholders in lessons 09 and 11)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import execute_notebooks as tool  # noqa: E402

BARS = """
from tqdm.auto import tqdm
list(tqdm(range(3), desc="plain"))
from transformers.utils import logging
list(logging.tqdm(range(3), desc="Loading weights"))
"""


def test_the_runner_runs_every_notebook_without_progress_bars(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    import nbclient

    seen = {}

    class Client:  # stands in for the kernel: records the environment it would inherit
        def __init__(self, nb, **kwargs):
            self.nb = nb

        def execute(self):
            seen.update({k: os.environ.get(k) for k in tool.QUIET})

    for key in ("PAGED_REF_IMPL", "CUDA_VISIBLE_DEVICES", *tool.QUIET):
        monkeypatch.delenv(key, raising=False)  # restored after the test
    monkeypatch.setattr(nbclient, "NotebookClient", Client)
    path = tmp_path / "probe.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")]), path)
    name, _, error, _ = tool.execute(path)
    assert error is None, error
    assert seen == tool.QUIET


def test_quiet_means_no_bars_in_stderr():
    pytest.importorskip("transformers")
    env = dict(os.environ, **tool.QUIET)
    done = subprocess.run([sys.executable, "-c", BARS], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Loading weights" not in done.stderr and "plain" not in done.stderr, done.stderr
    loud = subprocess.run([sys.executable, "-c", BARS], capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in env.items() if k not in tool.QUIET})
    assert "Loading weights" in loud.stderr, "without QUIET the bars show (the test can fail)"
