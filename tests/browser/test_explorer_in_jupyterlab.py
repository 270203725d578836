"""Lesson 02 in a real JupyterLab and a real browser: it runs, and the explorer's buttons work.

Starts JupyterLab (127.0.0.1, a free port, a random token) on a copy of notebook 02, opens it in
headless Chromium through Playwright, runs all cells, then clicks each button of the
block-table explorer and checks that its picture changes (the PNG data differs), that the browser
console logged no error, and (saving the notebook from JupyterLab) that every cell ran and none
raised.

Needs Debian's `chromium` (/usr/bin/chromium, or PAGED_REF_CHROMIUM) and `pip install playwright`
(its own browser download is not used). Runs only with PAGED_REF_BROWSER=1: `make test-browser`,
which .ci/run calls after `make test`.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "02_block_allocator.ipynb"
CHROMIUM = os.environ.get("PAGED_REF_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
BUTTONS = ["+1 token", "+N tokens", "decode step (all)", "finish", "start new request", "reset"]

pytestmark = pytest.mark.skipif(os.environ.get("PAGED_REF_BROWSER") != "1",
                                reason="browser test: run `make test-browser`")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(workdir: Path, tries: int = 3, timeout: float = 90.0):
    """Start JupyterLab in ``workdir``; return (process, base url, token). Retries on a new port."""
    token = secrets.token_hex(16)
    env = dict(os.environ, PAGED_REF_IMPL="solutions", CUDA_VISIBLE_DEVICES="",
               JUPYTERLAB_SETTINGS_DIR=str(workdir / ".settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(workdir / ".workspaces"))
    log = workdir / "lab.log"
    for _ in range(tries):
        port = free_port()
        cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
               f"--port={port}", "--port-retries=0", f"--IdentityProvider.token={token}",
               f"--ServerApp.root_dir={workdir}", "--LabApp.news_url=",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        if hasattr(os, "getuid") and os.getuid() == 0:
            cmd.append("--allow-root")
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log.open("w"),
                                stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5):
                    return proc, url, token
            except OSError:
                time.sleep(0.5)
        proc.kill()
        proc.wait()
    pytest.fail(f"JupyterLab did not start after {tries} tries:\n{log.read_text()[-3000:]}")


@pytest.fixture
def lab(tmp_path):
    shutil.copy(NOTEBOOK, tmp_path / NOTEBOOK.name)  # the run's outputs never touch the repo
    proc, url, token = start_lab(tmp_path)
    yield url, token, tmp_path
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def wait_for_idle_kernel(page, timeout_ms: int = 120_000) -> None:
    """Until the status bar says the notebook's kernel is connected and idle."""
    page.locator(".jp-StatusBar-Widget").get_by_text(
        re.compile(r"Python 3 \(ipykernel\) \| Idle")).first.wait_for(timeout=timeout_ms)


def wait_for_every_cell_run(page, timeout_s: float = 120) -> None:
    """Until no code cell is queued ("[*]:") and the last one shows its count ("[16]:").

    Cells scrolled out of view render no text (JupyterLab's windowing): those are skipped.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        prompts = [p.strip() for p in
                   page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts() if p.strip()]
        if prompts and "[*]:" not in prompts and re.fullmatch(r"\[\d+\]:", prompts[-1]):
            return
        time.sleep(0.5)
    pytest.fail(f"the notebook did not finish in {timeout_s} s: prompts {prompts}")


def explorer_image(page):
    """The explorer's <img>: inside the widget box that holds the '+1 token' button."""
    box = page.locator(".widget-vbox").filter(
        has=page.get_by_role("button", name="+1 token", exact=True)).last
    return box.locator(".widget-output img").first


def test_notebook_02_runs_and_the_explorer_buttons_change_the_picture(lab):
    playwright = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install chromium (see README)")
    url, token, workdir = lab
    artifacts = Path(os.environ.get("PAGED_REF_BROWSER_ARTIFACTS", workdir))
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            for attempt in (1, 2):  # one retry, in a fresh page, if the UI was too slow
                errors: list[str] = []
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                try:
                    drive_notebook(page, url, token, errors)
                    save_notebook(page)
                    break
                except playwright.TimeoutError:
                    shot = artifacts / f"failure-{attempt}.png"
                    page.screenshot(path=str(shot), full_page=True)
                    log = (workdir / "lab.log").read_text()[-3000:]
                    print(f"attempt {attempt} timed out; screenshot: {shot}\n"
                          f"console errors: {errors}\nJupyterLab log:\n{log}")
                    if attempt == 2:
                        raise
                finally:
                    page.close()
        finally:
            browser.close()
    assert not errors, f"browser console errors: {errors}"
    saved = json.loads((workdir / NOTEBOOK.name).read_text())
    code = [c for c in saved["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] for c in code), "a code cell did not run"
    raised = [o.get("ename") for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert not raised, f"cells raised {raised}"


def save_notebook(page, timeout_s: float = 30) -> None:
    """File > Save Notebook, and wait until the tab no longer shows unsaved changes."""
    page.get_by_role("menuitem", name="File", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Save Notebook")).first.click()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if page.locator(".lm-TabBar-tab.jp-mod-current.jp-mod-dirty").count() == 0:
            return
        time.sleep(0.3)
    pytest.fail("the notebook was not saved")


def drive_notebook(page, url: str, token: str, errors: list[str]) -> None:
    """Open notebook 02, run all cells, click every explorer button; fail on anything odd."""
    page.set_default_timeout(60_000)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{url}/lab/tree/{NOTEBOOK.name}?token={token}")
    page.locator(".jp-NotebookPanel .jp-Notebook .jp-CodeCell").first.wait_for()
    wait_for_idle_kernel(page)
    news = page.get_by_role("button", name="No", exact=True)  # the "Jupyter news?" toast
    if news.count():
        news.first.click()

    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    image = explorer_image(page)
    image.wait_for(timeout=120_000)
    wait_for_every_cell_run(page)
    assert page.get_by_text("FAILED").count() == 0, "a check cell failed"

    for label in BUTTONS:
        before = image.get_attribute("src")
        page.get_by_role("button", name=label, exact=True).first.click()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            image = explorer_image(page)
            if image.count() and image.get_attribute("src") not in (None, before):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the picture did not change after '{label}'")
