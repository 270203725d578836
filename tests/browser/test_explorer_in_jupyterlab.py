"""Lessons 02 and 07 in a real JupyterLab and a real browser: they run, and the explorers work.

Starts JupyterLab (127.0.0.1, a free port, a random token) on a copy of the notebook, opens it in
headless Chromium through Playwright and runs all cells. Lesson 02: clicks each button of the
block-table explorer and checks that its picture changes (the PNG data differs). Lesson 07 (only
its cells up to the sharing explorer): forks a request, appends to the fork (a copy-on-write),
finishes the parent, asks a question (a prefix-cache hit) and steps, checking after each click
that the picture changes and the status line reports the reference counts, the copy and the hit.
Both: the browser console logged no error, and (saving the notebook from JupyterLab) every cell
ran and none raised.

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
NOTEBOOK_07 = ROOT / "notebooks" / "07_sharing_blocks.ipynb"
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
    """A JupyterLab serving ``tmp_path`` (tests put a copy of their notebook there, so the
    run's outputs never touch the repo)."""
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


def explorer_box(page):
    """The explorer's widget box: the one that holds the '+1 token' button."""
    return page.locator(".widget-vbox").filter(
        has=page.get_by_role("button", name="+1 token", exact=True)).last


def explorer_image(page):
    """The explorer's <img>, inside its widget box."""
    return explorer_box(page).locator(".widget-output img").first


def run_in_browser(lab, name: str, drive) -> None:
    """Open notebook ``name`` (already in the lab's folder), ``drive(page, url, token, name,
    errors)`` it, save it; then check the console logged no error and every cell ran cleanly."""
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
                    drive(page, url, token, name, errors)
                    save_notebook(page)
                    break
                except playwright.TimeoutError:
                    shot = artifacts / f"failure-{Path(name).stem}-{attempt}.png"
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
    saved = json.loads((workdir / name).read_text())
    code = [c for c in saved["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] for c in code), "a code cell did not run"
    raised = [o.get("ename") for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert not raised, f"cells raised {raised}"


def test_notebook_02_runs_and_the_explorer_buttons_change_the_picture(lab):
    shutil.copy(NOTEBOOK, lab[2] / NOTEBOOK.name)
    run_in_browser(lab, NOTEBOOK.name, drive_notebook)


def cells_up_to(source: Path, target: Path, marker: str) -> None:
    """Write ``source``'s cells up to the first code cell containing ``marker``, without
    outputs, to ``target``."""
    nb = json.loads(source.read_text())
    end = next(i for i, c in enumerate(nb["cells"])
               if c["cell_type"] == "code" and marker in "".join(c["source"]))
    nb["cells"] = nb["cells"][: end + 1]
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    target.write_text(json.dumps(nb))


def test_notebook_07_sharing_explorer_shows_forks_copies_and_hits(lab):
    name = NOTEBOOK_07.name
    cells_up_to(NOTEBOOK_07, lab[2] / name, "viz.SharingExplorer(")
    run_in_browser(lab, name, drive_sharing_explorer)


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


def open_and_run_all(page, url: str, token: str, name: str, errors: list[str]) -> None:
    """Open notebook ``name``, run all its cells, wait for the explorer and for every cell."""
    page.set_default_timeout(60_000)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{url}/lab/tree/{name}?token={token}")
    page.locator(".jp-NotebookPanel .jp-Notebook .jp-CodeCell").first.wait_for()
    wait_for_idle_kernel(page)
    news = page.get_by_role("button", name="No", exact=True)  # the "Jupyter news?" toast
    if news.count():
        news.first.click()

    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    explorer_image(page).wait_for(timeout=120_000)
    wait_for_every_cell_run(page)
    assert page.get_by_text("FAILED").count() == 0, "a check cell failed"


def click_and_wait(page, label: str, expect: tuple[str, ...] = (), timeout_s: float = 30) -> str:
    """Click the explorer's button ``label``; wait until its picture changed and its status
    line contains every string of ``expect``. Returns the status line."""
    before = explorer_image(page).get_attribute("src")
    explorer_box(page).get_by_role("button", name=label, exact=True).click()
    deadline = time.monotonic() + timeout_s
    status, changed = "", False
    while time.monotonic() < deadline:
        image = explorer_image(page)
        status = explorer_box(page).locator(".widget-html").first.inner_text()
        changed = bool(image.count()) and image.get_attribute("src") not in (None, before)
        if changed and all(text in status for text in expect):
            return status
        time.sleep(0.2)
    pytest.fail(f"after '{label}': picture changed: {changed}; status {status!r}, "
                f"expected it to contain {expect}")


def drive_notebook(page, url: str, token: str, name: str, errors: list[str]) -> None:
    """Notebook 02: run all cells, click every explorer button; fail on anything odd."""
    open_and_run_all(page, url, token, name, errors)
    for label in BUTTONS:
        click_and_wait(page, label)


def choose_request(page, seq_id: int) -> None:
    """Pick request ``seq_id`` in the explorer's dropdown (the kernel hears of it at once)."""
    explorer_box(page).locator("select").first.select_option(label=f"req {seq_id}")
    time.sleep(0.5)  # the widget's new value travels to the kernel


def drive_sharing_explorer(page, url: str, token: str, name: str, errors: list[str]) -> None:
    """Notebook 07 up to its explorer: requests 0 and 1 share the system prompt's two blocks
    (blocks 0, 1); their third blocks are 2 and 3. Fork, copy-on-write, finish, hit, step."""
    open_and_run_all(page, url, token, name, errors)
    status = explorer_box(page).locator(".widget-html").first
    assert "8 found in the prefix cache" in status.inner_text()
    choose_request(page, 0)
    click_and_wait(page, "fork (one more sample)",
                   ("forked req 0 → req 2", "blocks [0, 1, 2] shared", "holders now [3, 3, 2]"))
    choose_request(page, 2)
    click_and_wait(page, "+1 token", ("req 2: +1 token(s) → length 11", "copy-on-write [(2, "))
    choose_request(page, 0)
    click_and_wait(page, "finish", ("finished req 0", "lost a holder (now [2, 2, 0])"))
    click_and_wait(page, "ask: system prompt + N tokens",
                   ("started req 3: 12 prompt tokens, 8 found in the prefix cache",))
    click_and_wait(page, "decode step (all)", ("decode step for 3 requests",))
