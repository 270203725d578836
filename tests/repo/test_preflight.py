"""tools/preflight.py says READY on a machine set up by `make install`, and NOT READY + why."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import preflight  # noqa: E402

from tests.conftest import need  # noqa: E402


def test_ready_here(capsys):
    """On a machine set up by `make install`: with the lab extra and ipywidgets (a bare GPU
    machine that runs the suite from the checkout has neither: skipped there)."""
    for module in ("jupyterlab", "jupyter_client", "ipywidgets"):
        need(module, "what `make install` puts here and preflight asks for")
    assert preflight.main() == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "READY" in out and "triton kernel" in out and "jupyter kernel" in out


def test_not_ready_says_why(capsys, monkeypatch):
    monkeypatch.setattr(preflight, "MIN_FREE_GB", 1e12)
    assert preflight.main() == 1
    out = capsys.readouterr().out
    assert "NOT READY" in out and "disk:" in out.split("NOT READY")[1]
