"""Shared pytest set-up: ``--impl`` picks solutions/ (default) or the learner's exercises/."""

from __future__ import annotations

import importlib
import re

import pytest

import paged_ref  # noqa: F401  (sets TRITON_INTERPRET=1 before anything imports triton)


def pytest_addoption(parser):
    parser.addoption(
        "--impl",
        choices=("solutions", "exercises"),
        default="solutions",
        help="which implementation the exercise tests check (default: solutions)",
    )


def load_exercise(config, name: str):
    """Import ``solutions.<name>`` or ``exercises.<name>`` according to ``--impl``."""
    return importlib.import_module(f"{config.getoption('--impl')}.{name}")


EXERCISE = re.compile(r"Exercise \d+\.\d+[a-z]?: \w+")  # 4.2, or a warm-up such as 4.0a


def unsolved_exercise(exc: BaseException) -> str | None:
    """``"Exercise N.M: name"`` if ``exc`` comes from an unsolved stub, else None.

    A stub raises ``NotImplementedError("Exercise N.M: ...")``. Inside a Triton kernel the
    interpreter (CPU) or the compiler (GPU) wraps it in its own error, and a compile error in a
    helper called by the kernel is re-raised from the call site; so look along the whole chain
    of causes, at types and at messages.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        found = EXERCISE.search(text)
        if found and (isinstance(exc, NotImplementedError) or "NotImplementedError" in text):
            return found.group(0)
        exc = exc.__cause__ or exc.__context__
    return None


def run_kernel(fn, *args, **kwargs):
    """Call ``fn`` (an exercise's kernel launch); a stub's NotImplementedError, which Triton
    wraps in its own error (an InterpreterError on a CPU, a compilation error on a GPU), comes
    back out unwrapped."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise
    except Exception as e:
        todo = unsolved_exercise(e)
        if todo:
            raise NotImplementedError(todo) from None
        raise


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With ``--impl exercises``, an unsolved exercise is reported as skipped, not failed."""
    outcome = yield
    report = outcome.get_result()
    todo = call.excinfo and unsolved_exercise(call.excinfo.value)
    if todo and item.config.getoption("--impl") == "exercises":
        message = todo
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"not implemented yet: {message}")
