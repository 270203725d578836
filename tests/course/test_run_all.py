"""Restart & Run All reaches the end of a lesson when the learner's exercise runs but gives
wrong numbers: the check cell and the comparisons print what differs, nothing stops."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.course.course_copy import ROOT, make_copy, write_exercise

NOTEBOOK = "04_triton_paged_decode.ipynb"
NO_SCALE = ("scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale",
            "scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)")
RUN = """
import sys
import nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(nb, timeout=900, kernel_name="python3",
               resources={"metadata": {"path": sys.argv[2]}}).execute()
nbformat.write(nb, sys.argv[1])
"""


def test_lesson_04_runs_to_its_last_cell_with_a_wrong_4_3(tmp_path):
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    root = make_copy(tmp_path / "course")
    write_exercise(root, "ex04_triton_paged_decode", solved={"4.1", "4.2", "4.3"},
                   edits=[NO_SCALE])  # 4.3 runs, but forgets the scale: wrong numbers
    notebook = root / "notebooks" / NOTEBOOK
    shutil.copy(ROOT / "notebooks" / NOTEBOOK, notebook)
    env = dict(os.environ, PYTHONPATH=str(root), PAGED_REF_IMPL="exercises",
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(RUN), str(notebook),
                           str(notebook.parent)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, f"the run stopped:\n{done.stderr[-3000:]}"
    cells = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    assert all(c.get("execution_count") for c in cells), "every code cell ran"
    text = "\n".join("".join(o.get("text", "")) for c in cells for o in c["outputs"])
    assert "ex04 4.3: " in text and "FAILED" in text, "the 4.3 check says it failed"
    assert "NOT the same yet: your paged_decode" in text, "the comparison says what differs"
