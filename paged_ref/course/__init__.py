"""Helpers for the lesson notebooks: load your exercise file, check it, print what differs.

    from paged_ref import course
    ex = course.load("ex02_block_allocator")    # your exercises/ file (reloaded on each call)
    course.check("ex02_block_allocator")        # runs its tests and prints a report

By default notebooks use your ``exercises/`` files; set ``PAGED_REF_IMPL=solutions`` (CI and
``make test`` do) to run them against the worked solutions instead.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
    """Import (or re-import, so your latest edits count) ``exercises.<name>``."""
    impl = impl or current_impl()
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    _ensure_root_on_path()
    module = importlib.import_module(f"{impl}.{name}")
    return importlib.reload(module)


def _test_file(name: str) -> Path:
    path = ROOT / "tests" / "exercises" / f"test_{name}.py"
    if not path.exists():
        known = sorted(p.stem[5:] for p in path.parent.glob("test_ex*.py"))
        raise ValueError(f"no tests for exercise file {name!r}; known: {known}")
    return path


def check(name: str, impl: str | None = None, keyword: str | None = None) -> dict[str, int]:
    """Run the tests of ``name`` against your file (or the solutions) and print a report.

    Each test is shown as passed, FAILED (with what differs) or "not implemented yet".
    Unsolved exercises let the notebook run on; a wrong answer raises ``AssertionError``.
    ``keyword`` narrows the run like ``pytest -k``. Returns the counts per outcome.
    """
    impl = impl or current_impl()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        # "-o addopts=": drop the project's notebook options (nbval need not be installed).
        cmd = [sys.executable, "-m", "pytest", str(_test_file(name)), "--impl", impl,
               "-o", "addopts=", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "--no-header",
               f"--junitxml={report}", "-o", "junit_family=xunit2"]
        if keyword:
            cmd += ["-k", keyword]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if not report.exists():
            raise RuntimeError(f"pytest did not run:\n{proc.stdout}\n{proc.stderr}")
        cases = ET.parse(report).getroot().iter("testcase")
        counts = {"passed": 0, "failed": 0, "not implemented": 0, "skipped": 0}
        failures = []
        for case in cases:
            test = case.get("name")
            failure = case.find("failure")
            if failure is None:
                failure = case.find("error")
            skipped = case.find("skipped")
            if failure is not None:
                counts["failed"] += 1
                failures.append(test)
                detail = (failure.get("message") or "").strip()
                print(f"  FAILED  {test}\n{_indent(detail)}")
            elif skipped is not None:
                message = skipped.get("message") or ""
                if "not implemented yet" in message:
                    counts["not implemented"] += 1
                    print(f"  todo    {test}: {message.split('not implemented yet: ')[-1]}")
                else:
                    counts["skipped"] += 1
                    print(f"  skipped {test}: {message}")
            else:
                counts["passed"] += 1
                print(f"  passed  {test}")
    summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    print(f"{name} ({impl}): {summary or 'no tests ran'}")
    if counts["failed"]:
        raise AssertionError(f"{counts['failed']} check(s) failed in {name}: {failures}")
    if counts["not implemented"] and not counts["passed"]:
        print("Not implemented yet: the notebook goes on with paged_ref's own version.")
    return counts


def _indent(text: str, prefix: str = "          ") -> str:
    return "\n".join(prefix + line for line in text.splitlines()[:25])
