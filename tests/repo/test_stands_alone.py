"""The repository stands alone: no file points to documents that live outside it."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Spelled in pieces so that this file does not match itself.
FORBIDDEN = ("DESIGN" + ".md", "../" + "shared", "/work/" + "shared")


def tracked_text_files() -> list[Path]:
    """Files git tracks (every file under ROOT outside .venv/.git when git is not there)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout
        paths = [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "site", "__pycache__"}
        paths = [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.parts)]
    return [p for p in paths if p.is_file() and p.suffix not in {".png", ".whl", ".pdf"}]


def test_nothing_points_outside_the_repository():
    hits = []
    for path in tracked_text_files():
        text = path.read_text(errors="replace")
        hits += [f"{path.relative_to(ROOT)}: {word}" for word in FORBIDDEN if word in text]
    assert not hits, f"the contract lives in docs/contract.md; these point elsewhere: {hits}"


def test_contract_page_exists_and_is_linked():
    contract = ROOT / "docs" / "contract.md"
    assert contract.exists()
    assert "docs/contract.md" in (ROOT / "README.md").read_text()
