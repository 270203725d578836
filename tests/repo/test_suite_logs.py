"""The GPU suite's logs as tests finish (``tools/gpu/suite.sh``: ``PAGED_REF_DURATIONS_LOG``,
``PAGED_REF_FAILURE_LOG``, written by ``tests/conftest.py``) hold the outer run's tests only.
A test that plants a mistake in a copy of the course runs pytest there in a subprocess, which
inherits the variables: its caught failures once landed in the logs as if they were the suite's
(2026-12-08, H100: 11 such lines). ``PAGED_REF_LOG_ROOT`` names the repository whose tests
log; a run of another copy's tests writes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ONE_TEST = "tests/test_cache_math.py::test_cdiv_and_slot_of_elementwise_on_arrays"


def logged_lines(tmp_path: Path, log_root: Path) -> list[str]:
    log = tmp_path / f"durations_{log_root.name}.log"
    env = {**os.environ, "PAGED_REF_DURATIONS_LOG": str(log), "PAGED_REF_LOG_ROOT": str(log_root)}
    subprocess.run([sys.executable, "-m", "pytest", ONE_TEST, "-q", "-p", "no:cacheprovider",
                    "-p", "no:xdist", "-o", "addopts="], cwd=ROOT, env=env, check=True,
                   capture_output=True)
    return log.read_text().splitlines() if log.exists() else []


def test_only_the_named_repository_logs(tmp_path):
    lines = logged_lines(tmp_path, ROOT)
    assert [line.split()[1:3] for line in lines] == [["setup", "passed"], ["call", "passed"],
                                                     ["teardown", "passed"]]
    assert logged_lines(tmp_path, tmp_path) == [], "a copy's run logged into the suite's file"
