"""``results/`` holds the current results only: at most 45 files, each JSON stamped (GPU,
versions, date, commit), no dated copies, and a results page generated from the files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
FILES = sorted(p for p in RESULTS.rglob("*") if p.is_file())


def test_at_most_45_files_none_dated_and_no_benchmarks_diary():
    assert len(FILES) <= 45, f"{len(FILES)} files under results/ (the cap is 45)"
    dated = [p.name for p in FILES if re.search(r"20\d\d-\d\d-\d\d", p.name)]
    assert not dated, f"dated result files (git keeps history): {dated}"
    assert not (ROOT / "benchmarks" / "README.md").exists(), "the diary left the tree"


def test_every_json_is_stamped():
    for path in (p for p in FILES if p.suffix == ".json"):
        data = json.loads(path.read_text())
        missing = {"date", "commit"} - data.keys()
        assert not missing, f"{path.relative_to(ROOT)} lacks {missing}"
        assert "gpu" in data or "machine" in data, path


def test_the_results_page_is_current_and_short():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "results_page.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len((RESULTS / "README.md").read_text().split()) <= 1500
