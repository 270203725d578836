"""Check an exercise in the notebook: run its tests on your file, print one line, remember the
verdict.

    course.check("ex04_triton_paged_decode", keyword="load_kv_tile")
    # ex04 4.2: 8 passed
    # ex04 4.2: 1 FAILED, 7 passed — test_load_kv_tile_uses_64bit_offsets: load_kv_tile read ...
    course.passed("ex04_triton_paged_decode", "4.2")   # True once that check passed

The tests (``tests/exercises/test_<name>.py``, the same that check the solutions) run inside
this Python process with pytest, on freshly imported copies of your file and of the test
module, so your latest save counts.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from paged_course.exercise_files import (
    EXERCISE,
    ROOT,
    exercise_path,
    file_stamp,
    import_fresh,
    pick_impl,
    place_in_exercise,
    refuse_other_checkout,
)
from paged_course.learner import GOES_ON


def test_file(name: str) -> Path:
    """``tests/exercises/test_<name>.py``. Raises ValueError for an unknown exercise file."""
    path = ROOT / "tests" / "exercises" / f"test_{name}.py"
    if not path.exists():
        known = sorted(p.stem[5:] for p in path.parent.glob("test_ex*.py"))
        raise ValueError(f"no tests for exercise file {name!r}; known: {known}")
    return path


# ---- which exercises a check covers ----------------------------------------------------------

_TABLES: dict[str, tuple[tuple[int, int], dict[str, str]]] = {}


def exercise_table(name: str) -> dict[str, str]:
    """Exercise number -> the function it asks for, e.g. ``{"2.1": "allocate", ...}``.

    Read from the worked solution through tools/make_exercises.py, which numbers the
    exercises (so this never disagrees with the stubs, whatever the learner edited).
    """
    path = exercise_path(name, "solutions")
    stamp = file_stamp(path)
    if name not in _TABLES or _TABLES[name][0] != stamp:
        tool_path = ROOT / "tools" / "make_exercises.py"
        if tool_path.is_file():
            spec = importlib.util.spec_from_file_location("_make_exercises", tool_path)
            tool = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(tool)
            stub = tool.make_stub(path.read_text(), tool.lesson_number(path), path.name)
        else:  # a copy without tools/: the stubs still in the learner's file
            stub = exercise_path(name, "exercises").read_text()
        table = dict(m.group(0).removeprefix("Exercise ").split(": ")
                     for m in EXERCISE.finditer(stub))
        _TABLES[name] = (stamp, table)
    return dict(_TABLES[name][1])


def _names(word: str, function: str) -> bool:
    """Does the keyword word ``word`` name ``function`` (``append`` names
    ``append_tokens_on_device``, ``online_update`` names ``online_softmax_update``)?"""
    if word == function or function.startswith(word + "_") or function.endswith("_" + word):
        return True
    return "_" in word and set(word.split("_")) <= set(function.split("_"))


def covered(name: str, keyword: str | None) -> list[str]:
    """The exercise numbers a check with ``keyword`` covers: all of the file's without one;
    else those the keyword names by number (``2_4``) or function (``load_kv_tile``)."""
    table = exercise_table(name)
    if not keyword:
        return list(table)
    words = re.findall(r"(not\s+)?(\w+)", keyword)
    wanted = [w for negated, w in words if not negated and w not in ("and", "or", "not")]
    return [number for number, function in table.items()
            if any(w == number.replace(".", "_") or _names(w, function) for w in wanted)]


def short_name(name: str) -> str:
    """``ex04_triton_paged_decode`` -> ``ex04``."""
    return name.split("_")[0]


# ---- the result of one check -----------------------------------------------------------------


@dataclass(frozen=True)
class CheckResult:
    """What one :func:`check` found. ``result["passed"]`` etc. read :attr:`counts`.

    name:      the exercise file, e.g. ``"ex04_triton_paged_decode"``
    impl:      ``"exercises"`` or ``"solutions"``
    exercises: the exercise numbers it covered, e.g. ``("4.2",)``
    label:     how the report names it, e.g. ``"ex04 4.2"``
    counts:    tests per outcome: passed, failed, todo (not implemented yet), skipped
    failures:  ``(test, what differs)`` per failed test
    todo:      the unsolved exercises it met, e.g. ``("Exercise 4.2: load_kv_tile",)``
    """

    name: str
    impl: str
    exercises: tuple[str, ...]
    label: str
    counts: dict[str, int]
    failures: tuple[tuple[str, str], ...] = ()
    todo: tuple[str, ...] = ()
    skips: tuple[str, ...] = ()
    stamp: tuple[int, int] | None = field(default=None, compare=False)

    def __getitem__(self, outcome: str) -> int:
        return self.counts[outcome]

    @property
    def verdict(self) -> str:
        """``"failed"``, ``"todo"``, ``"passed"`` or ``"no tests"`` (in that precedence)."""
        if self.counts["failed"]:
            return "failed"
        if self.counts["todo"]:
            return "todo"
        return "passed" if self.counts["passed"] else "no tests"

    @property
    def ok(self) -> bool:
        """Every selected test passed (none failed, none unsolved, at least one ran)."""
        return self.verdict == "passed"

    def summary(self) -> str:
        """The report's one line."""
        c = self.counts
        if c["failed"]:
            test, detail = self.failures[0]
            first = detail.strip().splitlines()[0] if detail.strip() else "failed"
            more = f", {c['passed']} passed" if c["passed"] else ""
            return f"{self.label}: {c['failed']} FAILED{more} — {test}: {first}"
        if c["todo"]:
            todo = ", ".join(dict.fromkeys(self.todo))
            if not c["passed"]:
                return f"{self.label}: not implemented yet ({todo}); {GOES_ON}"
            return f"{self.label}: {c['passed']} passed, {c['todo']} not implemented yet ({todo})"
        if not c["passed"]:
            return f"{self.label}: no tests ran" + (f" ({self.skips[0]})" if self.skips else "")
        skipped = f", {c['skipped']} skipped ({self.skips[0]})" if c["skipped"] else ""
        return f"{self.label}: {c['passed']} passed{skipped}"

    def report(self) -> str:
        """The summary line, then what differs for each failure (nothing else)."""
        lines = [self.summary()]
        if self.failures:
            same: dict[str, list[str]] = {}  # parametrized cases often fail the same way
            for test, detail in self.failures:
                same.setdefault(detail, []).append(test)
            for detail, tests in same.items():
                more = f" (and {len(tests) - 1} more, the same way)" if len(tests) > 1 else ""
                lines.append(f"  FAILED {tests[0]}{more}")
                lines.extend("      " + line for line in detail.splitlines()[:25])
            if self.impl == "exercises":
                lines.append(f"  Fix {self.impl}/{self.name}.py and run this cell again; "
                             f"{GOES_ON}.")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    def _ipython_display_(self) -> None:
        """Nothing: :func:`check` printed the report already (a cell ending in a check shows
        the report once, not a dict as well)."""


# ---- verdicts: which exercises passed their last check ----------------------------------------

_VERDICTS: dict[tuple[str, str, str], CheckResult] = {}


def _remember(result: CheckResult, keyword: str | None) -> None:
    for key in (*result.exercises, keyword or "*"):
        _VERDICTS[(result.impl, result.name, key)] = result


#: Why an exercise is not compared yet, for one exercise and for several.
_WAITING = {
    "unchecked": ("not checked yet: run its check cell", "not checked yet: run their checks"),
    "saved": ("you saved the file since its check: run the check again",
              "you saved the file since their checks: run them again"),
}
_VERDICT_WORDS = {"todo": "not implemented yet", "no tests": "no tests ran"}


def _why_waiting(why: str, count: int) -> str:
    """The words in brackets after the waiting exercises (one reason, ``count`` of them)."""
    if why in _WAITING:
        return _WAITING[why][count > 1]
    word = _VERDICT_WORDS.get(why, why)
    return f"{word} in its last check" if count == 1 else f"{word} in their last checks"


def passed(name: str, *exercises: str, impl: str | None = None, say: bool = True) -> bool:
    """Did each of ``exercises`` (numbers such as ``"2.4"``, or the keyword of a check) pass
    its last :func:`check`, with the file unchanged since?

    Use it before a line that claims your code agrees with ``paged_ref``: the example a
    cell runs can agree while a case of the check still fails. With ``say`` (default) it
    prints one line saying which check to run or fix when the answer is no.

    Raises:
        ValueError: no exercise named, or an unknown ``impl`` or file ``name``.
    """
    if not exercises:
        raise ValueError("name at least one exercise, e.g. passed('ex02_block_allocator', '2.4')")
    impl = pick_impl(impl)
    stamp = file_stamp(exercise_path(name, impl))
    waiting: dict[str, list[str]] = {}  # why -> the exercises waiting for that reason
    for ex in exercises:
        last = _VERDICTS.get((impl, name, ex))
        if last is None:
            why = "unchecked"
        elif last.stamp != stamp:
            why = "saved"
        elif not last.ok:
            why = last.verdict
        else:
            continue
        waiting.setdefault(why, []).append(ex)
    if waiting and say:
        print(f"{short_name(name)}: not compared with paged_ref yet; waiting for "
              + "; ".join(f"{', '.join(exs)} ({_why_waiting(why, len(exs))})"
                          for why, exs in waiting.items()))
    return not waiting


# ---- running the tests -----------------------------------------------------------------------


@dataclass
class _Test:
    nodeid: str
    name: str
    outcome: str  # passed, failed, todo, skipped
    detail: str


class _Collector:
    """A pytest plugin that keeps each test's outcome and, for an error raised in an exercise
    file, the line of that file where it happened."""

    def __init__(self, impl: str) -> None:
        self.impl = impl
        self.tests: list[_Test] = []

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
            outcome = "todo" if "not implemented yet" in detail else "skipped"
            detail = detail.split("not implemented yet: ")[-1]
        elif report.outcome == "failed":
            crash = getattr(report.longrepr, "reprcrash", None)
            detail = crash.message if crash is not None else str(report.longrepr)
            detail = detail.removeprefix("AssertionError: ")  # what differs says enough
            outcome = "failed"
            if report.when != "call":
                name = f"{name} ({report.when})"
        else:
            detail, outcome = "", "passed"
        self.tests.append(_Test(report.nodeid, name, outcome, detail))

    def pytest_collectreport(self, report) -> None:
        if report.failed:  # the test file does not import
            crash = getattr(report.longrepr, "reprcrash", None)
            detail = crash.message if crash is not None else str(report.longrepr)
            self.tests.append(_Test(report.nodeid, f"importing {report.nodeid}", "failed",
                                    detail))

    def pytest_exception_interact(self, node, call, report) -> None:
        """(pytest calls this right after the failed report) Add where in the exercise file
        the error happened: a plain ``IndexError`` says nothing about which line."""
        if not self.tests or self.tests[-1].nodeid != node.nodeid:
            return
        last = self.tests[-1]
        place = place_in_exercise(call.excinfo.value, self.impl)
        if last.outcome == "failed" and place is not None:
            last.detail = f"{last.detail}\n{place}"


def run_tests(test_path: Path, impl: str, keyword: str | None) -> list[_Test]:
    """Run one test file in this process with pytest; forget cached modules first."""
    import pytest

    stale = [m for m in sys.modules
             if m.startswith((f"{impl}.", "tests.exercises.", "tests.conftest"))]
    for module in stale:  # the learner's file and the tests, as they are on disk now
        del sys.modules[module]
    importlib.invalidate_caches()
    args = [str(test_path), f"--rootdir={ROOT}", "--impl", impl, "-o", "addopts=",
            "--capture=sys", "-p", "no:terminal", "-p", "no:cacheprovider",
            "-p", "no:faulthandler", "-p", "no:unraisableexception",
            "-p", "no:threadexception", "-W",
            "ignore::pytest.PytestAssertRewriteWarning"]
    if keyword:
        args += ["-k", keyword]
    collector = _Collector(impl)
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
    if code not in (0, 1, 5) and not collector.tests:
        raise RuntimeError(f"pytest could not run {test_path.name} (exit code {code})")
    return collector.tests


def _does_not_import(name: str, impl: str, err: Exception) -> _Test:
    place = place_in_exercise(err, impl)
    if isinstance(err, SyntaxError) and place is None:
        place = f"at {impl}/{name}.py:{err.lineno}:  {(err.text or '').strip()}"
    detail = f"{type(err).__name__}: {err}" + (f"\n{place}" if place else "")
    return _Test(name, f"your {impl}/{name}.py does not import", "failed", detail)


def check(name: str, impl: str | None = None, keyword: str | None = None) -> CheckResult:
    """Run the tests of ``name`` against your file (or the solutions) and print one line:
    ``ex04 4.2: 8 passed``, ``… not implemented yet …`` or ``… 1 FAILED — test: what
    differs``, then what differs for each failed test (with the line of your file where an
    error was raised).

    A failed check prints and returns: the notebook runs on (the later cells use paged_ref's
    own version). With ``impl="solutions"`` (``PAGED_REF_IMPL=solutions``, as ``make test``
    and CI set) a failure raises ``AssertionError`` instead, so a broken solution fails the
    notebook run. ``keyword`` narrows the run like ``pytest -k``. The result is remembered for
    :func:`passed`; in a notebook it shows nothing more than the printed report.

    Raises:
        ValueError: unknown ``impl`` or exercise file.
        RuntimeError: the notebook is in another checkout; pytest could not run at all.
        AssertionError: a test failed with ``impl="solutions"``.
    """
    impl = pick_impl(impl)
    refuse_other_checkout()
    test_path = test_file(name)
    exercises = covered(name, keyword)
    label = f"{short_name(name)} {', '.join(exercises) or keyword}"
    stamp = file_stamp(exercise_path(name, impl))
    try:
        import_fresh(name, impl)
    except Exception as err:  # noqa: BLE001 (any error of the learner's file is reported)
        tests = [_does_not_import(name, impl, err)]
    else:
        tests = run_tests(test_path, impl, keyword)
    counts = {"passed": 0, "failed": 0, "todo": 0, "skipped": 0}
    for t in tests:
        counts[t.outcome] += 1
    result = CheckResult(
        name=name, impl=impl, exercises=tuple(exercises), label=label, counts=counts,
        failures=tuple((t.name, t.detail) for t in tests if t.outcome == "failed"),
        todo=tuple(t.detail for t in tests if t.outcome == "todo"),
        skips=tuple(t.detail for t in tests if t.outcome == "skipped"), stamp=stamp)
    _remember(result, keyword)
    print(result.report())
    if result.failures and impl == "solutions":
        raise AssertionError(f"{counts['failed']} check(s) failed in solutions/{name}: "
                             f"{[t for t, _ in result.failures]}")
    return result

