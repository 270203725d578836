"""`make lab`, as the Makefile runs it, serves the repository root: exercises/ opens in it."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import need
from tests.repo.test_make_targets import dry_run

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_lab_serves_the_repository_root(tmp_path):
    need("jupyterlab", "`make lab` runs it (the lab extra)")
    token, port = secrets.token_hex(16), free_port()
    extra = f"--no-browser --ip=127.0.0.1 --port={port} --port-retries=0 " \
            f"--IdentityProvider.token={token} --ServerApp.open_browser=False"
    [cmd] = [c for c in dry_run("lab", f"LAB_ARGS={extra}") if "jupyter lab" in c]
    env = dict(os.environ, JUPYTERLAB_WORKSPACES_DIR=str(tmp_path))
    log = (tmp_path / "lab.log").open("w")
    proc = subprocess.Popen(shlex.split(cmd), cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        url, deadline, listing = f"http://127.0.0.1:{port}", time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/api/contents/exercises?token={token}",
                                            timeout=5) as reply:
                    listing = json.load(reply)
                break
            except OSError:
                time.sleep(0.5)
        assert listing is not None, (tmp_path / "lab.log").read_text()[-2000:]
        names = {item["name"] for item in listing["content"]}
        assert "ex02_block_allocator.py" in names
        with urllib.request.urlopen(f"{url}/api/contents/notebooks/00_setup.ipynb?token={token}"
                                    "&content=0", timeout=10) as reply:
            assert json.load(reply)["type"] == "notebook"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
