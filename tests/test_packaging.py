"""Set-up files agree with each other: environment.yml's pip section mirrors pyproject.toml."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!;\s\[]", requirement.strip(), maxsplit=1)[0].lower()


def _normalise(requirement: str) -> str:
    return re.sub(r"\s+", "", requirement.split("#")[0]).replace("'", '"').lower()


def test_environment_yml_mirrors_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [r for r in project["dependencies"] if _name(r) != "torch"]
    for extra in project["optional-dependencies"].values():
        wanted += extra
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = lines.index("  - pip:") + 1
    pip_section = [line.strip()[2:] for line in lines[start:] if line.startswith("      - ")]
    pip_section = [r for r in pip_section if r != "-e ."]
    assert sorted(map(_normalise, pip_section)) == sorted(map(_normalise, wanted))
    assert "-e ." in [line.strip()[2:] for line in lines[start:]], "environment.yml installs ."
