"""Helpers for the lesson notebooks: load your exercise file, check it, print what differs.

    import paged_course as course
    ex = course.load("ex02_block_allocator")    # your exercises/ file (reloaded on each call)
    course.check("ex02_block_allocator")        # runs its tests and prints a report

By default notebooks use your ``exercises/`` files; set ``PAGED_REF_IMPL=solutions`` (CI and
``make test`` do) to run them against the worked solutions instead.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPLS = ("exercises", "solutions")


def current_impl() -> str:
    """``"exercises"`` (the default) or ``"solutions"``, from ``PAGED_REF_IMPL``."""
    impl = os.environ.get("PAGED_REF_IMPL", "exercises")
    if impl not in IMPLS:
        raise ValueError(f"PAGED_REF_IMPL must be one of {IMPLS}, got {impl!r}")
    return impl


def _ensure_root_on_path() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def load(name: str, impl: str | None = None):
    """Import (or re-import, so your latest edits count) ``exercises.<name>``.

    In a notebook it also shows a link to the file: click it to open it in JupyterLab's editor.
    """
    impl = impl or current_impl()
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    _refuse_other_checkout()
    _ensure_root_on_path()
    module = importlib.import_module(f"{impl}.{name}")
    module = importlib.reload(module)
    _show_link(Path(module.__file__))
    return module


def _show_link(path: Path) -> None:
    """A Markdown link to ``path``, relative to the notebook, when running in a notebook."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    if shell is None or type(shell).__name__ != "ZMQInteractiveShell":
        return
    from IPython.display import Markdown, display

    relative = Path(os.path.relpath(path, Path.cwd())).as_posix()
    display(Markdown(f"Your file: [{path.parent.name}/{path.name}]({relative}) "
                     "(click to open it next to this notebook)"))


def _test_file(name: str) -> Path:
    path = ROOT / "tests" / "exercises" / f"test_{name}.py"
    if not path.exists():
        known = sorted(p.stem[5:] for p in path.parent.glob("test_ex*.py"))
        raise ValueError(f"no tests for exercise file {name!r}; known: {known}")
    return path


def check(name: str, impl: str | None = None, keyword: str | None = None) -> dict[str, int]:
    """Run the tests of ``name`` against your file (or the solutions) and print a report.

    Each test is shown as ``passed``, ``FAILED`` (with what differs) or ``todo`` (not implemented
    yet). The tests run inside this Python process, on freshly imported copies of your file and
    of the test module, so your latest edits count and a check answers in about a second.

    A failed check prints what differs and returns: the notebook runs on (the later cells use
    ``paged_ref``'s own version). With ``impl="solutions"`` (``PAGED_REF_IMPL=solutions``, as
    ``make test`` and CI set) a failure raises ``AssertionError`` instead, so a broken solution
    fails the notebook run. ``keyword`` narrows the run like ``pytest -k``. Returns the counts
    per outcome.
    """
    impl = impl or current_impl()
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    _refuse_other_checkout()
    reports = _run_tests(_test_file(name), impl, keyword)
    counts = {"passed": 0, "failed": 0, "todo": 0, "skipped": 0}
    failures = []
    for test, outcome, detail in reports:
        if outcome == "failed":
            failures.append(test)
            print(f"  FAILED  {test}\n{_indent(detail)}")
        elif outcome == "skipped" and "not implemented yet" in detail:
            outcome = "todo"
            print(f"  todo    {test}: {detail.split('not implemented yet: ')[-1]}")
        elif outcome == "skipped":
            print(f"  skipped {test}: {detail}")
        else:
            print(f"  passed  {test}")
        counts[outcome] += 1
    summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    print(f"{name} ({impl}): {summary or 'no tests ran'}")
    if failures and impl == "solutions":
        raise AssertionError(f"{len(failures)} check(s) failed in solutions/{name}: {failures}")
    if failures:
        print("Not passed yet: fix your file and run this cell again. The notebook goes on "
              "with paged_ref's own version.")
    elif counts["todo"] and not counts["passed"]:
        print("Not implemented yet: the notebook goes on with paged_ref's own version.")
    return counts


class _Collector:
    """A pytest plugin that keeps (test name, outcome, detail) for each test."""

    def __init__(self) -> None:
        self.results: list[tuple[str, str, str]] = []

    def pytest_configure(self, config) -> None:
        config.option.tbstyle = "native"  # the report keeps only the message: skip pytest's
        # costly source-annotated traceback

    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "call" and report.outcome == "passed":
            return  # set-up and tear-down that went fine
        if report.when == "teardown" and report.outcome == "skipped":
            return
        name = report.nodeid.split("::")[-1]
        if report.outcome == "skipped":
            longrepr = report.longrepr
            detail = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            detail = detail.removeprefix("Skipped: ")
        elif report.outcome == "failed":
            crash = getattr(report.longrepr, "reprcrash", None)
            detail = crash.message if crash is not None else str(report.longrepr)
            if report.when != "call":
                name = f"{name} ({report.when})"
        else:
            detail = ""
        self.results.append((name, report.outcome, detail))

    def pytest_collectreport(self, report) -> None:
        if report.failed:  # the test file (or the exercise it imports) does not import
            crash = getattr(report.longrepr, "reprcrash", None)
            detail = crash.message if crash is not None else str(report.longrepr)
            self.results.append((f"importing {report.nodeid}", "failed", detail))


def _run_tests(test_file: Path, impl: str, keyword: str | None) -> list[tuple[str, str, str]]:
    """Run one test file in this process with pytest; forget cached modules first."""
    import pytest

    _ensure_root_on_path()
    stale = [m for m in sys.modules
             if m.startswith((f"{impl}.", "tests.exercises.", "tests.conftest"))]
    for module in stale:  # the learner's file and the tests, as they are on disk now
        del sys.modules[module]
    importlib.invalidate_caches()
    args = [str(test_file), f"--rootdir={ROOT}", "--impl", impl, "-o", "addopts=",
            "--capture=sys", "-p", "no:terminal", "-p", "no:cacheprovider",
            "-p", "no:faulthandler", "-p", "no:unraisableexception",
            "-p", "no:threadexception", "-W",
            "ignore::pytest.PytestAssertRewriteWarning"]
    if keyword:
        args += ["-k", keyword]
    collector = _Collector()
    # Only pytest's own plugins: importing every installed one costs seconds, checks need none.
    autoload = os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    try:
        code = pytest.main(args, plugins=[collector])
    finally:
        if autoload is None:
            del os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"]
        else:
            os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = autoload
    if code not in (0, 1, 5) and not collector.results:
        raise RuntimeError(f"pytest could not run {test_file.name} (exit code {code})")
    return collector.results


def _checkout_of(path: Path) -> Path | None:
    """The enclosing checkout of this course (a folder with paged_ref/ and exercises/)."""
    for folder in (path, *path.parents):
        if (folder / "paged_ref").is_dir() and (folder / "exercises").is_dir():
            return folder
    return None


def _refuse_other_checkout() -> None:
    """Stop if the notebook sits in another checkout than the ``paged_ref`` this kernel runs.

    A kernel registered by another checkout would check that checkout's exercises, not the
    ones you are editing. The notebook's folder is the kernel's working directory.
    """
    here = _checkout_of(Path.cwd().resolve())
    if here is not None and here != ROOT.resolve():
        raise RuntimeError(
            f"this kernel runs paged_ref from {ROOT} but the notebook is in {here}: your "
            f"checks would test the wrong exercises/. Open the notebook with `make lab` in "
            f"{here} (or pick that checkout's kernel, see `make kernel`), then restart.")


def _indent(text: str, prefix: str = "          ") -> str:
    return "\n".join(prefix + line for line in text.splitlines()[:25])
